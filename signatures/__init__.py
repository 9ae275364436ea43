"""The built-in signature catalogue: YAML rule files read as package data
(``importlib.resources.files("forensics.signatures")``). No code lives here."""
