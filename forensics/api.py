"""The Python API the command line is a thin layer over."""
from __future__ import annotations

import builtins
import os
from typing import Any, Callable

import polars as pl

from . import pipeline
from .store import Store


class Run:
    """An ingested run: a DuckDB database opened read-only unless ``write=True``."""

    def __init__(self, db: str | os.PathLike = "forensics.duckdb", write: bool = False):
        if not write and not os.path.exists(db):
            raise FileNotFoundError(f"no database at {db}: run `forensics ingest PATH --db {db}` first")
        self.db = str(db)
        self.store = Store(self.db, read_only=not write)
        self.con = self.store.con
        self.last_ingest: pipeline.IngestSummary | None = None

    def sql(self, query: str, params: list[Any] | None = None) -> pl.DataFrame:
        """Run SQL and return a polars DataFrame (``.to_pandas()`` for pandas)."""
        rel = self.con.sql(query, params=params) if params else self.con.sql(query)
        if rel is None:  # a statement without a result (DDL, INSERT, ...)
            return pl.DataFrame()
        return pl.from_arrow(rel.to_arrow_table())  # type: ignore[return-value]

    def tables(self) -> list[str]:
        return [r[0] for r in self.con.execute("SELECT table_name FROM information_schema.tables ORDER BY 1").fetchall()]

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open(db: str | os.PathLike = "forensics.duckdb", write: bool = False) -> Run:  # noqa: A001
    """Open an ingested database (read-only by default)."""
    return Run(db, write=write)


def ingest(
    paths: str | os.PathLike | list,
    db: str | os.PathLike = "forensics.duckdb",
    workers: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    debug: bool = False,
    exclude: list[str] | None = None,
) -> Run:
    """Ingest folders / files / bundles into ``db`` and return the opened :class:`Run`."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    summary = pipeline.ingest([str(p) for p in paths], str(db), workers=workers, progress=progress, debug=debug, exclude=exclude)
    run = Run(db)
    run.last_ingest = summary
    return run


_ = builtins  # keep the builtin ``open`` reachable for readers of this module
