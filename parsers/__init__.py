"""The input formats: one module each, pure functions from a byte stream to frames.

Each format declares itself next to its parser (:class:`~.base.Format`: name, sniff
rules, priority, parse function, tables); the text splitter's line formats live in
:mod:`.lines`. :mod:`.registry` finds the declarations (ours and other packages', through
the entry point group ``forensics.formats``); this package lists none of them. The
functions below are the registry's, for the pipeline and the store: ``parser_for`` gives
a detected format's parse function, ``all_tables()`` every table the formats fill (the
whole database schema apart from the bookkeeping tables of ``forensics.store``).
"""
from __future__ import annotations

import importlib

_FROM_BASE = ("FileContext", "Format", "LineFormat", "ParseOutput", "Sniff", "Table")
_FROM_REGISTRY = ("all_tables", "format_named", "formats", "line_formats", "parser_for", "problems")
__all__ = [*_FROM_BASE, *_FROM_REGISTRY]


def __getattr__(name: str):
    # imported when first asked for (PEP 562): the base module imports polars and pyarrow,
    # which a reader of the database (:mod:`.conventions`) does not need
    if name in _FROM_BASE or name in _FROM_REGISTRY:
        module = importlib.import_module(f"{__name__}.{'base' if name in _FROM_BASE else 'registry'}")
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
