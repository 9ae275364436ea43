"""forensics: post-mortems of distributed RL training runs from their logs.

Notebook use::

    import forensics
    run = forensics.ingest("./logs", db="run.duckdb")   # or forensics.open("run.duckdb")
    run.sql("SELECT * FROM lines WHERE level = 'ERROR' LIMIT 10")
"""
from __future__ import annotations

import os as _os
import sys as _sys
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Run", "ingest", "open", "__version__"]



def _map_checkout_subpackages() -> None:
    """Run from a source checkout, ``forensics.parsers`` and ``forensics.signatures`` are the
    repository's top-level ``parsers/`` and ``signatures/`` folders (the layout of the design
    card; an installed wheel holds them inside the package, as ``pyproject.toml`` maps them).
    A finder for exactly those two names keeps ``import forensics.parsers`` working there
    without putting a top-level ``parsers`` on ``sys.path``."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    root = _os.path.dirname(here)
    mapped = {}
    for sub in ("parsers", "signatures"):
        inside, outside = _os.path.join(here, sub), _os.path.join(root, sub)
        if not _os.path.isdir(inside) and _os.path.isfile(_os.path.join(outside, "__init__.py")):
            mapped[f"{__name__}.{sub}"] = outside
    if not mapped:
        return
    import importlib.abc
    import importlib.util

    class _CheckoutFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            folder = mapped.get(fullname)
            if folder is None:
                return None
            return importlib.util.spec_from_file_location(
                fullname, _os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])

    if not any(type(f).__name__ == "_CheckoutFinder" for f in _sys.meta_path):
        _sys.meta_path.insert(0, _CheckoutFinder())


_map_checkout_subpackages()

if TYPE_CHECKING:
    from .api import Run, ingest, open  # noqa: A004


def __getattr__(name: str):
    # The API (DuckDB, polars, pyarrow: most of a second) is imported on first use, so
    # that the command line can catch a Ctrl-C during its own imports (forensics.entry).
    if name in ("Run", "ingest", "open"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
