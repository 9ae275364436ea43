"""Opening and reading a forensics database, for the commands that only read one
(``diagnose``, ``report``, ``query``): DuckDB's settings, the parts of a views-only
database, the runs it holds, and what the ingest recorded of the formats. Nothing here
needs the schema declarations (:mod:`forensics.store`, which imports pyarrow and every
format module): a diagnosis of a small database starts without them.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import threading
import weakref
from dataclasses import dataclass

import duckdb

# DuckDB's memory limit (env FORENSICS_DB_MEMORY, one value for all three when set). DuckDB
# caches blocks up to 80% of RAM by default; ingest and diagnosis gain nothing from that.
# Measured with 256MB against 512MB: two profiler traces (190 MB of JSON) ingested in the
# same time at 380 instead of 440 MiB peak, a 2 GB trace at 430 instead of 600 MiB; 300 MB
# of text logs ingested as fast (faster, within the noise) at 1.19 instead of 1.33 GB for
# the process tree; the diagnosis of 1 GB of logs in the same time at 0.74 instead of 1.0 GB.
# The report materialises the phase views of millions of events and was 15% slower with
# 256MB on the 1,000-step x 64-rank bench (3.9 against 3.5 CPU s): it keeps 512MB, with
# which that bench ran as fast as with 16GB.
DB_MEMORY = "256MB"  # ingest and diagnosis
REPORT_DB_MEMORY = "512MB"


PARTS_KEY = "parts_url"  # meta: where the parts of a views-only database are (ingest --engine ray --views-only)


# -- interrupts -------------------------------------------------------------------------
# DuckDB's Python binding, given Ctrl-C while a statement runs, lets the statement run to
# its end before it reports the interrupt (a scan of a big table: tens of seconds); an
# explicit interrupt() of the connection running it stops it at once. The commands' signal
# handler (cli._interruptible) therefore interrupts every connection and cursor opened
# through :func:`connect` and :func:`interruptible`.
_LIVE: "weakref.WeakSet[duckdb.DuckDBPyConnection]" = weakref.WeakSet()


def interruptible(con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
    """``con`` (a connection or a cursor, which DuckDB interrupts apart from its
    connection), made known to :func:`interrupt_all`."""
    _LIVE.add(con)
    return con


def connect(database: str = ":memory:", read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """``duckdb.connect``, the connection made known to :func:`interrupt_all`."""
    return interruptible(duckdb.connect(database, read_only=read_only))


def interrupt_all() -> None:
    """Stop the statement that each open connection and cursor of :func:`connect` and
    :func:`interruptible` runs (an idle one is not affected: DuckDB keeps no pending
    interrupt for its next statement)."""
    for con in list(_LIVE):
        try:
            con.interrupt()
        except duckdb.ConnectionException:  # closed since it was made: nothing runs on it
            _LIVE.discard(con)


def statements_stop_on_interrupt(fn):
    """Decorator for the Python API (a notebook, a script): Ctrl-C, or a kernel's
    interrupt, while ``fn`` runs stops the DuckDB statement under way at once and ends the
    call with ``KeyboardInterrupt`` (DuckDB alone would finish the statement first and then
    raise an error of its own). Only in the main thread, and only while SIGINT has Python's
    default handler: a program with its own (the command line's) keeps it."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread() \
                or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return fn(*args, **kwargs)
        hit = False

        def on_interrupt(signum, frame):
            nonlocal hit
            hit = True
            interrupt_all()
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, on_interrupt)
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # DuckDB's report of the interrupt, or an error made of it
            if hit:
                raise KeyboardInterrupt from exc
            raise
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    return wrapper


def attach_parts(con: duckdb.DuckDBPyConnection) -> str | None:
    """Make the parts of a views-only database on object storage readable on ``con``:
    DuckDB reads them through an fsspec filesystem (s3fs for ``s3://``) registered on the
    connection. Nothing for other databases, or parts on a local or shared folder. Returns
    where the parts are (None: not a views-only database). A missing fsspec is a
    :class:`StoreError` saying what to install."""
    try:
        # fetchall: a result read only in part would keep the connection busy
        rows = con.execute("SELECT value FROM meta WHERE key = ?", [PARTS_KEY]).fetchall()
    except duckdb.Error:  # no meta table (an empty or foreign database)
        return None
    if not rows:
        return None
    row = rows[0]
    if "://" not in row[0] or row[0].startswith("file://"):
        return row[0]
    scheme = row[0].split("://", 1)[0]
    try:
        import fsspec

        fs = fsspec.filesystem(scheme)
    except (ImportError, ValueError) as exc:
        raise StoreError(f"this database reads its rows from {row[0]}: that needs fsspec with {scheme} support "
                         f"(pip install 'forensics[ray]'): {exc}") from None
    if not con.filesystem_is_registered(fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]):
        con.register_filesystem(fs)
    return row[0]


class SettingError(ValueError):
    """An environment setting that DuckDB does not take."""


def apply_setting(con: duckdb.DuckDBPyConnection, key: str, env: str, value) -> None:
    """``SET key = value`` on ``con``; a value DuckDB refuses raises :class:`SettingError`
    naming the environment variable ``env`` it came from."""
    try:
        con.execute(f"SET {key} = ?", [value])
    except duckdb.Error as exc:
        raise SettingError(f"{env}={value!r} is not a value DuckDB takes for {key}: {exc}") from None


def set_memory_limit(con: duckdb.DuckDBPyConnection, default: str = DB_MEMORY) -> None:
    """Apply ``FORENSICS_DB_MEMORY`` (else ``default``) to ``con``."""
    apply_setting(con, "memory_limit", "FORENSICS_DB_MEMORY", os.environ.get("FORENSICS_DB_MEMORY", default))


@contextlib.contextmanager
def memory_limit(con: duckdb.DuckDBPyConnection, default: str = DB_MEMORY):
    """``FORENSICS_DB_MEMORY`` (else ``default``) as DuckDB's memory limit for the block,
    the connection's own limit again after it. DuckDB would otherwise cache up to 80% of
    RAM while the diagnosis scans every line (DB_MEMORY says what was measured)."""
    before = con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]
    set_memory_limit(con, default)
    try:
        yield
    finally:
        con.execute("SET memory_limit = ?", [before]).fetchall()


class StoreError(RuntimeError):
    """The database cannot be opened (not a DuckDB file, unwritable folder, damaged file);
    the message says why, in words."""


class StoreLocked(StoreError):
    """Another process holds the database open for writing."""


@dataclass
class RunRow:
    run_id: int
    name: str
    root: str
    rel: str
    kind: str
    files: int


def diagnosable_runs(con: duckdb.DuckDBPyConnection) -> list[RunRow]:
    """The runs a diagnosis reads one at a time: those with files and no runs inside them
    (a PATH that holds runs is a container; files of its own, such as a README beside the
    bundles, are not a run). Empty for a database without ``runs`` rows (one written
    before runs existed, read-only: it is read whole)."""
    if not has_table(con, "runs"):
        return []
    rows = con.execute(
        """SELECT r.run_id, r.name, r.root, r.rel, r.kind, r.files FROM runs r
           WHERE r.files > 0 AND NOT EXISTS (SELECT 1 FROM runs c WHERE c.parent_id = r.run_id)
           ORDER BY r.run_id""").fetchall()
    return [RunRow(int(a), b, c, d, e, int(f)) for a, b, c, d, e, f in rows]


def main_relations(con: duckdb.DuckDBPyConnection) -> set[str]:
    """The tables and views the database itself holds (not the connection's TEMP ones):
    a views-only database's tables are views over its parts."""
    return {r[0] for r in con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main' AND database_name = current_database() "
        "UNION SELECT view_name FROM duckdb_views() WHERE schema_name = 'main' AND database_name = current_database() "
        "AND NOT temporary").fetchall()}


def has_table(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    """Whether the database has the table ``name``, or a view of that name (:func:`main_relations`)."""
    return name in main_relations(con)


class NoSuchRun(LookupError):
    """``--run`` names no run of the database, or several; the message lists them."""


def pick_run(runs: list[RunRow], wanted: str) -> RunRow:
    """The run ``wanted`` names: its id, its name, or the end of its name after a ``/``
    (``ray-healthy`` for ``real/ray-healthy``) when only one run's name ends so. Raises
    :class:`NoSuchRun` saying which runs there are."""
    w = wanted.strip().rstrip("/")
    exact = [r for r in runs if str(r.run_id) == w or r.name == w]
    if not exact:
        exact = [r for r in runs if r.name.endswith("/" + w)]
    if len(exact) == 1:
        return exact[0]
    listed = ", ".join(f"{r.run_id} {r.name}" for r in runs[:20]) + (f", ... ({len(runs)} in all)" if len(runs) > 20 else "")
    if exact:
        raise NoSuchRun(f"--run {wanted!r} names {len(exact)} runs: " + ", ".join(r.name for r in exact[:10]) + "; give its id or whole name")
    raise NoSuchRun(f"no run {wanted!r} in the database; its runs: {listed or 'none (it holds one, read whole: leave out --run)'}")


def restrict_to_run(con: duckdb.DuckDBPyConnection, run_id: int | None) -> None:
    """Make ``con`` see one run only: TEMP views named like the tables (``files`` and every
    table of file rows) shadow them with the run's rows, so every view, and every query of
    the diagnosis and the report, reads that run. ``None``: the whole database again."""
    db = con.execute("SELECT current_database()").fetchone()[0]
    quoted = '"' + db.replace('"', '""') + '"'
    have = main_relations(con)
    names = ["files", "runs"] + sorted(file_row_relations(con) - {"files", "runs"})
    for name in names:
        if name not in have:
            continue
        if run_id is None:
            con.execute(f'DROP VIEW IF EXISTS temp.main."{name}"')
            continue
        ids = f"SELECT file_id FROM {quoted}.main.files WHERE run_id = {int(run_id)}"
        where = f"run_id = {int(run_id)}" if name in ("files", "runs") else f"file_id IN ({ids})"
        con.execute(f'CREATE OR REPLACE TEMP VIEW "{name}" AS SELECT * FROM {quoted}.main."{name}" WHERE {where}')
    if run_id is None:
        con.execute(f"DROP MACRO IF EXISTS temp.main.{_RESTRICTED}")
    else:
        con.execute(f"CREATE OR REPLACE TEMP MACRO {_RESTRICTED}() AS {int(run_id)}")


_RESTRICTED = "_forensics_run"  # TEMP macro: the run a connection is restricted to (restrict_to_run)


def restricted_run(con: duckdb.DuckDBPyConnection) -> int | None:
    """The run :func:`restrict_to_run` restricted ``con`` to, or None."""
    # asked directly: listing duckdb_functions() costs a fiftieth of a second
    try:
        return int(con.execute(f"SELECT temp.main.{_RESTRICTED}()").fetchall()[0][0])
    except duckdb.CatalogException:  # no such macro: the connection sees the whole database
        return None




def file_row_relations(con: duckdb.DuckDBPyConnection) -> set[str]:
    """The tables of the database whose rows belong to a file (views over the parts, in a
    views-only database): those whose first column is ``file_id``, as every declared table
    of parser rows has it, less the analysis views of the SQL modules and the helpers
    (``_name``: a views-only database's own ``_parts_files``, ...), which no table is named like."""
    from . import sql_modules

    analysis = {name for m in sql_modules.modules() for kind, name in m.creates if kind == "VIEW"} | set(sql_modules.RETIRED_VIEWS)
    return {r[0] for r in con.execute(
        "SELECT table_name FROM duckdb_columns() WHERE schema_name = 'main' AND database_name = current_database() "
        "AND column_index = 1 AND column_name = 'file_id' AND NOT starts_with(table_name, '_')").fetchall()} & main_relations(con) - analysis


# What the diagnosis needs to know of each format (parsers.base.Format): the software whose
# logs it is (``software``: the run traits ``run:<software>``) and whether a file of it is
# one process's own output (``own_output``). The ingest that writes a database records them
# in ``meta`` under FORMAT_FACTS_KEY (store.Store.record_format_facts), so that reading the
# database needs no format module; a database without them (made before) is read with the
# registry's (format_facts).
FORMAT_FACTS_KEY = "format_facts"


@dataclass(frozen=True)
class FormatFacts:
    software: dict[str, str]  # format name -> software
    own_output: frozenset[str]  # formats whose file is one process's own output

    def to_json(self) -> str:
        names = sorted(set(self.software) | self.own_output)
        return json.dumps({n: {"software": self.software.get(n), "own_output": n in self.own_output} for n in names},
                          sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "FormatFacts":
        d = json.loads(text)
        return cls({n: v["software"] for n, v in d.items() if v.get("software")},
                   frozenset(n for n, v in d.items() if v.get("own_output")))

    @classmethod
    def of_registry(cls) -> "FormatFacts":
        """The facts of the formats this installation knows (imports every format module)."""
        from .parsers import registry

        fmts = registry.formats()
        return cls({f.name: f.software for f in fmts if f.software}, frozenset(f.name for f in fmts if f.own_output))


def format_facts(con: duckdb.DuckDBPyConnection) -> FormatFacts:
    """The format facts the database's ingest recorded, else this installation's."""
    try:
        rows = con.execute("SELECT value FROM meta WHERE key = ?", [FORMAT_FACTS_KEY]).fetchall()
    except duckdb.CatalogException:  # no meta table: not written by an ingest
        rows = []
    if rows and rows[0][0]:
        try:
            return FormatFacts.from_json(rows[0][0])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not what an ingest writes
            logging.getLogger(__name__).debug("meta %s not readable (%s): the registry's facts", FORMAT_FACTS_KEY, exc)
    return FormatFacts.of_registry()
