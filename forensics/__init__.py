"""forensics: post-mortems of distributed RL training runs from their logs.

Notebook use::

    import forensics
    run = forensics.ingest("./logs", db="run.duckdb")   # or forensics.open("run.duckdb")
    run.sql("SELECT * FROM lines WHERE level = 'ERROR' LIMIT 10")
"""
from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Run", "ingest", "open", "__version__"]

if TYPE_CHECKING:
    from .api import Run, ingest, open  # noqa: A004


def __getattr__(name: str):
    # The API (DuckDB, polars, pyarrow: most of a second) is imported on first use, so
    # that the command line can catch a Ctrl-C during its own imports (forensics.entry).
    if name in ("Run", "ingest", "open"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
