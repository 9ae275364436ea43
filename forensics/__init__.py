"""forensics: post-mortems of distributed RL training runs from their logs.

Notebook use::

    import forensics
    run = forensics.ingest("./logs", db="run.duckdb")   # or forensics.open("run.duckdb")
    run.sql("SELECT * FROM lines WHERE level = 'ERROR' LIMIT 10")
"""
from __future__ import annotations

from .api import Run, ingest, open  # noqa: A004

__version__ = "0.1.0"
__all__ = ["Run", "ingest", "open", "__version__"]
