"""The Python API: everything the command line does is one call here, the same call a
notebook makes (docs/cli.md, "Python equivalents").

* one function per command, taking the database path as the command's ``--db`` does:
  :func:`ingest`, :func:`diagnose`, :func:`report`, :func:`query`, :func:`export`,
  :func:`catalogue` (``forensics signatures``) and :func:`evaluate`;
* :class:`Run`, an opened database (:func:`open`, or what :func:`ingest` returns), for
  the questions a notebook asks one after the other on one connection.

A problem the user can fix (no database at the path, a file that is not a DuckDB
database, a database another process writes, a bad signature folder, a setting DuckDB
refuses, an output that cannot be written, an SQL error) is raised as
:class:`ForensicsError`, its message in words; anything else is a bug of ours.
"""
from __future__ import annotations

import builtins
import contextlib
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable

import duckdb

from .database import DB_MEMORY, NoSuchRun, SettingError, StoreError, memory_limit, statements_stop_on_interrupt
from .errors import ForensicsError

# Imported where used: polars, pyarrow and the parsers (the store, the ingest, the phase
# views and the exports) are half a second of imports that reading a diagnosis of a small
# database does without, as are the diagnosis and the report for the other commands.
if TYPE_CHECKING:
    import polars as pl

    from . import export as export_mod
    from . import pipeline
    from .catalogue import Catalogue
    from .diagnose import Diagnosis
    from .evaluate import EvalReport
    from .report import ReportResult


def _no_database(db: str | os.PathLike) -> ForensicsError:
    return ForensicsError(f"no database at {db}: run `forensics ingest PATH --db {db}` first")


class Run:
    """An ingested run: a DuckDB database opened read-only unless ``write=True`` (a
    database that does not exist yet is then created)."""

    def __init__(self, db: str | os.PathLike = "forensics.duckdb", write: bool = False):
        if not write and not os.path.exists(db):
            raise _no_database(db)
        from . import phases as phases_mod
        from .store import Store

        self.db = str(db)
        try:
            self.store = Store(self.db, read_only=not write)
        except StoreError as exc:  # in use by an ingest, not a DuckDB file, unwritable folder
            raise ForensicsError(str(exc)) from exc
        self.con = self.store.con
        self.last_ingest: pipeline.IngestSummary | None = None
        phases_mod.attach(self.con)  # phase rules (signatures/phases.yaml) for the phase views

    @statements_stop_on_interrupt
    def sql(self, query: str, params: list[Any] | None = None) -> pl.DataFrame:
        """Run SQL and return a polars DataFrame (``.to_pandas()`` for pandas). DuckDB's
        own errors (syntax, unknown table, ...) come as they are; :func:`query` turns
        them into :class:`ForensicsError`."""
        import polars as pl

        rel = self.con.sql(query, params=params) if params else self.con.sql(query)
        if rel is None:  # a statement without a result (DDL, INSERT, ...)
            return pl.DataFrame()
        return pl.from_arrow(rel.to_arrow_table())  # type: ignore[return-value]

    def tables(self) -> list[str]:
        """Names of every table and view in the database, sorted."""
        return [r[0] for r in self.con.execute("SELECT table_name FROM information_schema.tables ORDER BY 1").fetchall()]

    def views(self) -> list[str]:
        """Names of the analysis views (``forensics/sql/*.sql``, documented in docs/schema.md),
        sorted; the modules' helpers (``_name``) are not for users and are left out."""
        return [r[0] for r in self.con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_type = 'VIEW' "
            "AND NOT starts_with(table_name, '_') ORDER BY 1").fetchall()]

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
        import polars as pl

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
        from . import export as export_mod

        return export_mod.parquet(self.con, out_dir, tables)

    def export_chrome_trace(
        self,
        path: str | os.PathLike,
        categories: list[str] | tuple[str, ...] | None = None,
    ) -> export_mod.ChromeTraceSummary:
        """Write one merged Chrome/Perfetto trace of all ranks (phase spans, kernels,
        annotations, warning/error log lines) to ``path``; see :func:`forensics.export.chrome_trace`.
        ``categories``: ``trace_events.category`` values to include (None: the defaults)."""
        from . import export as export_mod

        return export_mod.chrome_trace(self.con, path, categories=categories or export_mod.DEFAULT_CATEGORIES)

    def phases(self) -> pl.DataFrame:
        """Seconds per (rank, step, phase, sub_phase) with their source (view ``phases``)."""
        from . import phases as phases_mod

        return phases_mod.phases(self.con)

    def phase_steps(self) -> pl.DataFrame:
        """One row per (rank, step): rollout/reward/train/sync/other/idle seconds, step time,
        GPU busy/idle and collective waits where traces exist (view ``phase_steps``)."""
        from . import phases as phases_mod

        return phases_mod.phase_steps(self.con)

    def timeline(self) -> pl.DataFrame:
        """Every phase span with wall-clock bounds in µs since the epoch (view ``phase_timeline``)."""
        from . import phases as phases_mod

        return phases_mod.timeline(self.con)

    def findings(self) -> list[dict]:
        """Performance findings: stragglers, slow weight sync, rollout long tail, step time jumps."""
        from . import findings as findings_mod

        return findings_mod.findings(self.con)

    def report(self, path: str | os.PathLike = "report.html", title: str | None = None) -> "ReportResult":
        """Write the self-contained post-mortem HTML to ``path``; returns a ``report.ReportResult``."""
        from . import report as report_mod

        return report_mod.write_report_con(self.con, path, title or f"forensics post-mortem: {os.path.basename(self.db)}")

    def runs(self) -> pl.DataFrame:
        """The runs in the database (table ``runs``): one row per ingested PATH and per run
        found inside it; ``files.run_id`` names each file's run."""
        return self.sql("SELECT * FROM runs ORDER BY run_id")

    def diagnose(self, signatures: list[str] | tuple[str, ...] = (), run: str | int | None = None) -> "Diagnosis | RunDiagnoses":
        """Root cause, cascade and remediation of the run (a ``forensics.diagnose.Diagnosis``;
        ``.to_dict()`` is the ``forensics diagnose --json`` object). ``signatures``: folders of
        extra rule files. A database of several runs gives a ``diagnose.RunDiagnoses`` (one
        diagnosis per run), unless ``run`` (an id or a name, as ``--run``) picks one."""
        from . import diagnose as dg

        try:
            return dg.diagnose(signature_dirs=signatures, con=self.con, run=None if run is None else str(run))
        except NoSuchRun as exc:
            raise ForensicsError(str(exc)) from exc

    def headline(self) -> str | None:
        """The diagnosis in one line (what ``forensics ingest`` prints after ``diagnosis:``),
        without the performance findings; ``nothing to diagnose (...)`` for a database
        without log lines, None when this installation has no diagnosis. Runs under the
        diagnosis' memory limit (``FORENSICS_DB_MEMORY``, as ``forensics diagnose``)."""
        try:
            from . import diagnose as dg
        except ImportError:
            return None
        try:
            with memory_limit(self.con, DB_MEMORY):
                return dg.diagnose(con=self.con, performance=False).headline()
        except dg.NothingToDiagnose as exc:
            return f"nothing to diagnose ({exc})"

    def close(self) -> None:
        """Close the database (a ``with forensics.open(...) as run:`` block does it for you)."""
        self.store.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open(db: str | os.PathLike = "forensics.duckdb", write: bool = False) -> Run:  # noqa: A001
    """Open an ingested database (read-only by default); ``forensics --db FILE``."""
    return Run(db, write=write)


# -- one function per command ---------------------------------------------------------------

def ingest(
    paths: str | os.PathLike | list | None,
    db: str | os.PathLike = "forensics.duckdb",
    workers: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    debug: bool = False,
    exclude: list[str] | None = None,
    add: bool = False,
    engine: str = "local",
    address: str | None = None,
    parts: str | None = None,
    views_only: bool = False,
    shared: bool = False,
) -> Run:
    """Ingest folders / files / bundles into ``db`` (``forensics ingest``) and return the
    database opened read-only; ``run.last_ingest`` is the summary (files by format, rows
    per table, problems), ``run.headline()`` the diagnosis in one line.

    ``workers``: parser processes (None: one per core); ``progress(done, total, path)``
    is called with the bytes read so far and the bytes to read: once before the first
    byte, every 0.2 s while the parsers read (a big file moves it too) and as files are
    loaded (``path``: the last one); ``exclude``: globs of files not to read; ``debug``:
    a parser's bug is reported with its traceback; ``add``: put PATHs beside the runs of
    other PATHs the database holds (without it that is a :class:`ForensicsError` saying
    so; the same PATHs again are always fine). PATHs that hold no file to read are a
    :class:`ForensicsError` too (no database is left behind). Ctrl-C stops it as
    ``KeyboardInterrupt``, with the files loaded so far committed.

    ``engine="ray"``: :func:`ingest_ray`, with ``address``, ``parts``, ``views_only`` and
    ``shared`` (options of that engine only); it needs no ``paths``."""
    if engine not in ("local", "ray"):
        raise ForensicsError(f"unknown engine {engine!r}: use local or ray")
    if engine == "ray":
        return ingest_ray(paths, db, address=address, parts=parts, views_only=views_only, shared=shared,
                          workers=workers, progress=progress, debug=debug, exclude=exclude)
    ray_options = {"address": address, "parts": parts, "views_only": views_only, "shared": shared}
    if any(ray_options.values()):
        given = ", ".join("--" + k.replace("_", "-") for k, v in ray_options.items() if v)
        raise ForensicsError(f"{given}: only with the Ray engine (--engine ray)")
    if not paths:
        raise ForensicsError("give PATHS to ingest (only the Ray engine reads the cluster's own logs without them)")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    from . import pipeline

    return _ingested(db, debug, (), lambda: pipeline.ingest(
        [str(p) for p in paths], str(db), workers=workers, progress=progress, debug=debug, exclude=exclude, add=add))


def _ingested(db, debug: bool, user_errors: tuple, run_ingest: Callable[[], pipeline.IngestSummary]) -> Run:
    """Run an engine's ingest, its user errors (and ``user_errors``) as :class:`ForensicsError`,
    and return the database opened read-only with the summary as ``last_ingest``."""
    from . import pipeline

    try:
        summary = run_ingest()
    except (StoreError, pipeline.IngestError, *user_errors) as exc:
        raise ForensicsError(str(exc)) from exc
    except duckdb.IOException as exc:  # the database cannot be written (disk full, ...)
        if debug:
            raise
        raise ForensicsError(f"cannot write the database {db}: {exc}") from exc
    run = Run(db)
    run.last_ingest = summary
    return run


def ingest_ray(
    paths: str | os.PathLike | list | None = None,
    db: str | os.PathLike = "forensics.duckdb",
    address: str | None = None,
    parts: str | None = None,
    views_only: bool = False,
    shared: bool = False,
    workers: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    debug: bool = False,
    exclude: list[str] | None = None,
) -> Run:
    """Ingest on the Ray cluster at ``address`` (``forensics ingest --engine ray``; None:
    the cluster this process is connected to, else ``RAY_ADDRESS``, else the local one)
    and return the database opened read-only, as :func:`ingest` does.

    ``paths``: None, every alive node reads its own Ray session logs; else every node
    reads those paths where they exist on it (``{node}`` in a path stands for the node's
    name). ``shared`` (implied when a path is a URL such as ``s3://bucket/logs``): the paths
    are one file list every node can read, split across the cluster's CPUs. ``parts``: a
    folder or URL the nodes write their Parquet parts to (None: the rows come back through
    the Ray object store); ``views_only``: leave the parts there and make ``db`` views over
    them. ``workers``: parser processes per node (None: the node's CPUs). A node that dies
    is named in ``run.last_ingest.messages`` with the files it did not load; everything
    else is loaded, and a re-run loads the rest. Needs ``pip install 'forensics[ray]'``."""
    from . import distributed

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    return _ingested(db, debug, (distributed.EngineError,), lambda: distributed.ingest(
        [str(p) for p in paths] if paths else None, str(db), address=address, parts=parts, views_only=views_only,
        shared=shared, workers=workers, progress=progress, debug=debug, exclude=exclude))


def collect(out: str | os.PathLike, address: str | None = None) -> dict:
    """Copy every alive node's Ray session logs into ``out/node_<node>/...`` through Ray's
    state API (``forensics collect``), for a cluster about to be torn down; ``forensics
    ingest OUT`` then names each file's node. Returns ``{"out", "nodes": {node: files},
    "bytes", "messages"}``. Needs ``pip install 'forensics[ray]'``."""
    from . import distributed

    try:
        return distributed.collect(str(out), address)
    except distributed.EngineError as exc:
        raise ForensicsError(str(exc)) from exc
    except OSError as exc:
        raise ForensicsError(f"cannot write {out}: {exc}") from exc


@statements_stop_on_interrupt
def query(db: str | os.PathLike, sql: str, write: bool = False) -> pl.DataFrame:
    """Run one SQL statement on ``db`` (``forensics query``) and return its result;
    read-only unless ``write``. An error of the statement is a :class:`ForensicsError`
    naming DuckDB's exception (``ParserException: ...``)."""
    run = Run(db, write=write)
    try:
        return run.sql(sql)
    except Exception as exc:  # duckdb errors: syntax, missing table, ...; and what polars cannot convert
        raise ForensicsError(f"{exc.__class__.__name__}: {exc}") from exc
    finally:
        run.close()


class QueryStream:
    """The result of :func:`query_batches`: its Arrow ``schema``; iterate for the batches (once)."""

    def __init__(self, schema, batches):
        self.schema = schema
        self._batches = batches

    def __iter__(self):
        return iter(self._batches)


BATCH_ROWS = 16_384  # rows per Arrow record batch that query_batches hands over


@contextlib.contextmanager
def query_batches(db: str | os.PathLike, sql: str, write: bool = False, batch_rows: int = BATCH_ROWS):
    """Run one SQL statement on ``db`` and stream its result (``forensics query``): yields a
    :class:`QueryStream` (``.schema``, the Arrow schema; iterating it gives
    ``pyarrow.RecordBatch`` es as DuckDB makes them), so a result of millions of rows is
    never held whole. A statement without a result (DDL) gives no batches. Errors of the statement, when it starts or while its rows are
    read, are :class:`ForensicsError` naming DuckDB's exception; the database is closed
    when the block ends."""
    import pyarrow as pa

    run = Run(db, write=write)
    try:
        try:
            rel = run.con.sql(sql)
            reader = (rel.to_arrow_reader(batch_rows) if rel is not None
                      else pa.RecordBatchReader.from_batches(pa.schema([]), []))
        except Exception as exc:  # duckdb errors: syntax, missing table, ...
            raise ForensicsError(f"{exc.__class__.__name__}: {exc}") from exc

        def checked():
            try:
                yield from reader
            except (duckdb.Error, pa.ArrowException) as exc:  # an error met while the rows are made
                raise ForensicsError(f"{exc.__class__.__name__}: {exc}") from exc

        yield QueryStream(reader.schema, checked())
    finally:
        run.close()


@statements_stop_on_interrupt
def export(
    db: str | os.PathLike,
    parquet: str | os.PathLike | None = None,
    chrome_trace: str | os.PathLike | None = None,
    categories: list[str] | tuple[str, ...] | None = None,
) -> dict:
    """Export ``db`` (``forensics export``): one ``<table>.parquet`` per table into the
    folder ``parquet``, and/or one Chrome/Perfetto trace of the whole run to the file
    ``chrome_trace`` (``categories``: the profiler categories to put in it; None: the
    defaults). Returns what was written, the object ``forensics export --json`` prints:
    ``{"db", "parquet": {"dir", "tables": {table: rows}}, "chrome_trace": {...}}``."""
    if not parquet and not chrome_trace:
        raise ForensicsError("nothing to export: give --parquet DIR and/or --chrome-trace FILE.json")
    run = Run(db)
    written: dict = {"db": str(db)}
    try:
        if parquet:
            written["parquet"] = {"dir": str(parquet), "tables": run.export_parquet(parquet)}
        if chrome_trace:
            written["chrome_trace"] = run.export_chrome_trace(chrome_trace, categories=categories or None).to_dict()
    except (OSError, duckdb.IOException) as exc:  # cannot write there: a user error, not a bug
        raise ForensicsError(f"cannot write: {exc}") from exc
    finally:
        run.close()
    return written


@statements_stop_on_interrupt
def report(db: str | os.PathLike, output: str | os.PathLike = "report.html", title: str | None = None,
           run: str | int | None = None) -> "ReportResult":
    """Write the self-contained post-mortem HTML of ``db`` to ``output`` (``forensics
    report``; ``title`` default: the database name); returns a ``report.ReportResult``
    (``path``, ``bytes``, ``seconds``, ``notes``). Reads with DuckDB's memory limit of
    ``FORENSICS_DB_MEMORY`` (default 512MB). A database of several runs needs ``run``
    (``--run``: a run's id or name): the report is of one run."""
    from . import report as report_mod

    if not os.path.exists(db):
        raise _no_database(db)
    try:
        return report_mod.write_report(db, output, title, run=None if run is None else str(run))
    except NoSuchRun as exc:
        raise ForensicsError(str(exc)) from exc
    except duckdb.IOException as exc:  # locked or unreadable database
        raise ForensicsError(f"cannot read {db}: {exc}") from exc
    except SettingError as exc:
        raise ForensicsError(str(exc)) from exc
    except OSError as exc:  # cannot write the output
        raise ForensicsError(f"cannot write {output}: {exc}") from exc


@statements_stop_on_interrupt
def diagnose(db: str | os.PathLike, signatures: Iterable[str] = (), context: int = 0,
             run: str | int | None = None) -> "Diagnosis | RunDiagnoses":
    """Diagnose the run(s) in ``db`` (``forensics diagnose``): a ``diagnose.Diagnosis``
    whose ``.to_dict()`` is the ``--json`` object of ../shared/contract.md and which
    :func:`render_diagnosis` writes as text. ``signatures``: folders of extra rule files.
    ``context``: the lines around each root cause's first evidence line (``--context N``).
    A database that holds several runs (table ``runs``) gives a ``diagnose.RunDiagnoses``,
    each run diagnosed over its own files (``.to_dict()``: ``{"runs": [...]}``, docs/cli.md),
    unless ``run`` (``--run``: a run's id or name) picks one.
    Reads with DuckDB's memory limit of ``FORENSICS_DB_MEMORY`` (default 256MB)."""
    from . import catalogue as sig
    from . import diagnose as dg

    if not os.path.exists(db):
        raise _no_database(db)
    try:
        return dg.diagnose(db, list(signatures), context=max(0, int(context)), run=None if run is None else str(run))
    except NoSuchRun as exc:
        raise ForensicsError(str(exc)) from exc
    except sig.SignatureError as exc:
        raise ForensicsError(f"signature catalogue: {exc}") from exc
    except dg.NothingToDiagnose as exc:
        raise ForensicsError(str(exc)) from exc
    except duckdb.IOException as exc:  # locked or unreadable database
        raise ForensicsError(f"cannot read {db}: {exc}") from exc
    except SettingError as exc:
        raise ForensicsError(str(exc)) from exc


def render_diagnosis(diagnosis: "Diagnosis", verbose: bool = False) -> str:
    """A diagnosis as the text ``forensics diagnose`` prints (``verbose``: every evidence
    line of every root cause)."""
    from . import diagnose as dg

    return dg.render(diagnosis, verbose=verbose)


def catalogue(signatures: Iterable[str] = (), check: bool = False) -> "Catalogue":
    """The signature catalogue (``forensics signatures``): the built-in rules and those
    of the folders ``signatures``, which override built-in rules of the same id; a
    ``catalogue.Catalogue`` (``rules``, ``classes``, ``metric_detectors``, ``sources``).
    ``check``: also compile every pattern with DuckDB's regex engine (RE2)."""
    from . import catalogue as sig

    try:
        cat = sig.load(list(signatures))
        if check:
            sig.check_with_duckdb(cat)
    except sig.SignatureError as exc:
        raise ForensicsError(str(exc)) from exc
    return cat


@statements_stop_on_interrupt
def evaluate(corpus_dir: str | os.PathLike, work: str | os.PathLike | None = None, signatures: Iterable[str] = ()) -> "EvalReport":
    """Ingest every labelled bundle under ``corpus_dir`` (each folder with a label.json),
    diagnose it and score the diagnosis against its label (``forensics evaluate``); an
    ``evaluate.EvalReport`` (``.to_dict()`` is the ``--json`` object, :func:`render_evaluation`
    the text). ``work``: where the per-bundle databases are kept (default: a temporary folder)."""
    from . import catalogue as sig
    from . import evaluate as ev

    try:
        return ev.evaluate(corpus_dir, work_dir=work, signature_dirs=list(signatures))
    except FileNotFoundError as exc:  # no corpus folder there
        raise ForensicsError(str(exc)) from exc
    except sig.SignatureError as exc:
        raise ForensicsError(f"signature catalogue: {exc}") from exc


def render_evaluation(report: "EvalReport") -> str:
    """An evaluation as the text ``forensics evaluate`` prints: one line per bundle, then the scores."""
    from . import evaluate as ev

    return ev.render(report)


_ = builtins  # keep the builtin ``open`` reachable for readers of this module
