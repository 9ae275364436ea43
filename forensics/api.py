"""The Python API the command line is a thin layer over."""
from __future__ import annotations

import builtins
import os
from typing import Any, Callable

import polars as pl

from . import export, pipeline
from . import phases as phases_mod
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
        phases_mod.attach(self.con)  # phase rules (signatures/phases.yaml) for the phase views

    def sql(self, query: str, params: list[Any] | None = None) -> pl.DataFrame:
        """Run SQL and return a polars DataFrame (``.to_pandas()`` for pandas)."""
        rel = self.con.sql(query, params=params) if params else self.con.sql(query)
        if rel is None:  # a statement without a result (DDL, INSERT, ...)
            return pl.DataFrame()
        return pl.from_arrow(rel.to_arrow_table())  # type: ignore[return-value]

    def tables(self) -> list[str]:
        """Names of every table and view in the database, sorted."""
        return [r[0] for r in self.con.execute("SELECT table_name FROM information_schema.tables ORDER BY 1").fetchall()]

    def views(self) -> list[str]:
        """Names of the analysis views (``forensics/sql/*.sql``, documented in docs/schema.md)."""
        return [r[0] for r in self.con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_type = 'VIEW' ORDER BY 1").fetchall()]

    def metrics(self, wide: bool = True, keys: list[str] | None = None) -> pl.DataFrame:
        """Training metrics per step (view ``step_metrics``: one value per step and key).

        ``wide=True``: one row per step, one column per metric key (named as logged,
        e.g. ``timing_s/gen``), ordered by step. ``wide=False``: the long form
        ``step, key, value, value_text, ts, reports``. ``keys`` keeps only those keys.
        """
        where = ""
        params: list[Any] = []
        if keys is not None:
            if not keys:
                raise ValueError("keys: give at least one metric key, or None for all")
            where = "WHERE key IN (" + ", ".join("?" for _ in keys) + ")"
            params = list(keys)
        long = self.sql(f"SELECT step, key, value, value_text, ts, reports FROM step_metrics {where} ORDER BY step, key", params or None)
        if not wide:
            return long
        if long.is_empty():
            return pl.DataFrame(schema={"step": pl.Int64})
        return long.pivot(on="key", index="step", values="value", aggregate_function="first", sort_columns=True).sort("step")

    def last_lines(self, n: int = 20, before_first_error: bool = False) -> pl.DataFrame:
        """The last ``n`` lines of every process stream (table macro ``tail_lines``), at the
        end of the run or, with ``before_first_error``, up to the run's first ERROR/FATAL line."""
        if before_first_error:
            return self.sql(
                "SELECT * FROM tail_lines(?, (SELECT min(ts) FROM error_lines WHERE level IN ('ERROR', 'FATAL'))) "
                "ORDER BY stream, back DESC", [n])
        return self.sql("SELECT * FROM tail_lines(?) ORDER BY stream, back DESC", [n])

    def export_parquet(self, out_dir: str | os.PathLike, tables: list[str] | None = None) -> dict[str, int]:
        """Write every table (or ``tables``) as ``<out_dir>/<table>.parquet``; returns rows per table."""
        return export.parquet(self.con, out_dir, tables)

    def export_chrome_trace(
        self,
        path: str | os.PathLike,
        categories: list[str] | tuple[str, ...] | None = None,
    ) -> export.ChromeTraceSummary:
        """Write one merged Chrome/Perfetto trace of all ranks (phase spans, kernels,
        annotations, warning/error log lines) to ``path``; see :func:`forensics.export.chrome_trace`.
        ``categories``: ``trace_events.category`` values to include (None: the defaults)."""
        return export.chrome_trace(self.con, path, categories=categories or export.DEFAULT_CATEGORIES)

    def phases(self) -> pl.DataFrame:
        """Seconds per (rank, step, phase, sub_phase) with their source (view ``phases``)."""
        return phases_mod.phases(self.con)

    def phase_steps(self) -> pl.DataFrame:
        """One row per (rank, step): rollout/reward/train/sync/other/idle seconds, step time,
        GPU busy/idle and collective waits where traces exist (view ``phase_steps``)."""
        return phases_mod.phase_steps(self.con)

    def timeline(self) -> pl.DataFrame:
        """Every phase span with wall-clock bounds in µs since the epoch (view ``phase_timeline``)."""
        return phases_mod.timeline(self.con)

    def findings(self) -> list[dict]:
        """Performance findings: stragglers, slow weight sync, rollout long tail, step time jumps."""
        from . import findings as findings_mod

        return findings_mod.findings(self.con)

    def report(self, path: str | os.PathLike = "report.html", title: str | None = None):
        """Write the self-contained post-mortem HTML to ``path``; returns a ``report.ReportResult``."""
        from . import report as report_mod

        return report_mod.write_report_con(self.con, path, title or f"forensics post-mortem: {os.path.basename(self.db)}")

    def diagnose(self, signatures: list[str] | tuple[str, ...] = ()):
        """Root cause, cascade and remediation of the run (a ``forensics.diagnose.Diagnosis``;
        ``.to_dict()`` is the ``forensics diagnose --json`` object). ``signatures``: folders of
        extra rule files."""
        from . import diagnose as dg

        return dg.diagnose(signature_dirs=signatures, con=self.con)

    def close(self) -> None:
        """Close the database (a ``with forensics.open(...) as run:`` block does it for you)."""
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
