"""The DuckDB store: schema, per-file transactional loading, idempotency, views.

Every table is declared once as a :class:`parsers.base.Table` (parser output tables in
``parsers/``, bookkeeping tables here); ``docs/schema.md`` is generated from those
declarations and from the header comments of the SQL modules in ``forensics/sql/``
(:mod:`forensics.sql_modules` reads and orders them).

A file is loaded inside one transaction (its rows and its ``files`` row together),
so an interrupted ingest leaves the database consistent and a re-run redoes only
the files that were not committed. A big file's rows go in several transactions
(DuckDB holds a transaction's rows in memory): a note in ``meta`` marks it until its
``files`` row is committed with its last rows, and the next ingest removes the rows
of a file whose note was left by an interrupted one (:meth:`Store.drop_unfinished_files`).
"""
from __future__ import annotations

import contextlib

import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.ipc as ipc

from . import parsers, sql_modules
from .database import connect as db_connect
from .database import (DB_MEMORY, FORMAT_FACTS_KEY, PARTS_KEY, FormatFacts, REPORT_DB_MEMORY, NoSuchRun, RunRow, SettingError, StoreError, StoreLocked,  # noqa: F401
                       apply_setting, attach_parts, diagnosable_runs, has_table, main_relations, memory_limit, pick_run,
                       restrict_to_run, restricted_run, set_memory_limit)
from .parsers.base import FILE_ID, JsonArrayRows, LINE_NO, Table, col

SCHEMA_VERSION = 1

FILES = Table(
    "files",
    "One row per ingested file: what it is, how much of it was read, and what went wrong.",
    (
        FILE_ID,
        col("root", pa.string(), "Absolute path of the folder, file or bundle given to `ingest`."),
        col("path", pa.string(), "Path relative to `root` ('/'-separated); for a single file, its name. Evidence cites this."),
        col("format", pa.string(), "Detected format (`driver`, `ray_worker`, `ray_raylet`, `torchrun_rank`, `nccl_debug`, `kernel`, `vllm`, `metrics_jsonl`, `kineto_trace`, `ray_timeline`, `flight_recorder`, `text`, `binary`, `empty`, ...)."),
        col("kind", pa.string(), "`text` (every line is in `lines`), `structured` (records in their own tables) or `skipped` (not parsed: see `message`)."),
        col("compressed", pa.bool_(), "The file was gzip-compressed."),
        col("bytes", pa.int64(), "Size on disk when ingested."),
        col("lines", pa.int64(), "Physical lines (`\\n`-terminated, plus a last unterminated one). For text files equal to the file's rows in `lines`."),
        col("ends_with_newline", pa.bool_(), "Whether the last byte read was `\\n` (a file that grows resumes at its last line otherwise)."),
        col("unparsed_lines", pa.int64(), "Non-empty lines that no line format recognised (still stored in `lines`)."),
        col("parse_errors", pa.int64(), "Problems found while reading the file (rows in `problems`)."),
        col("truncated", pa.bool_(), "The file ended mid-record (e.g. a trace cut off by a crash); complete records before the cut were loaded."),
        col("sha256", pa.string(), "SHA-256 of the bytes ingested."),
        col("mtime", pa.timestamp("us"), "Modification time of the file (UTC)."),
        col("node", pa.string(), "Host suggested by the folder layout, if any."),
        col("pid", pa.int64(), "Process id suggested by the file name, if any."),
        col("rank", pa.int32(), "Rank suggested by the path, if any."),
        col("actor", pa.string(), "Actor / role suggested by the file, if any."),
        col("status", pa.string(), "`ok`, `partial` (loaded with problems), `skipped` or `error`."),
        col("message", pa.string(), "Why a file was skipped or failed, in words."),
        col("ingested_at", pa.timestamp("us"), "When this file was (last) loaded, UTC."),
        col("run_id", pa.int64(), "The run the file belongs to (`runs`): the innermost run found around it."),
    ),
)

RUNS = Table(
    "runs",
    "The runs in the database: one row per ingested PATH (`parent_id` null) and one per run found inside it "
    "(a Ray `session_*` folder, a bundle folder among sibling folders that each hold their own logs, a driver log "
    "of its own). The diagnosis and the report read one run at a time (`--run`); `files.run_id` names a file's run.",
    (
        col("run_id", pa.int64(), "Id (`files.run_id`); stable across re-ingests of the same PATH."),
        col("parent_id", pa.int64(), "The PATH's run this run was found in; null for a PATH itself."),
        col("root", pa.string(), "Absolute path of the folder, file or bundle given to `ingest` (as `files.root`)."),
        col("rel", pa.string(), "The folder or file of the run, relative to `root` (`''`: the whole PATH)."),
        col("name", pa.string(), "The name `--run` takes and the diagnosis shows: the PATH's name, then `/rel`."),
        col("kind", pa.string(), "`path` (a PATH, or a PATH that holds runs), `ray_session`, `bundle` (a folder among siblings) or `driver_log`."),
        col("path_prefix", pa.string(), "PATH rows: the first component of `files.path` of its files when the database holds "
                                         "several PATHs (the PATH's name, unique in the database); null when it holds one."),
        col("files", pa.int64(), "Files of the run (rows of `files`, its inner runs' included)."),
        col("ingested_at", pa.timestamp("us"), "When the run was first ingested, UTC."),
        col("updated_at", pa.timestamp("us"), "When an ingest last added to it, UTC."),
    ),
)

PROBLEMS = Table(
    "problems",
    "Problems met while reading input files: undecodable bytes, truncation, corrupt records, unreadable files.",
    (
        FILE_ID,
        LINE_NO,
        col("kind", pa.string(), "`error`, `warning` or `truncated`."),
        col("message", pa.string(), "What went wrong, in words."),
    ),
)

META = Table(
    "meta",
    "Key/value facts about the database: `schema_version`, `schema_fingerprint`; `format_facts` (JSON: per format "
    "the `software` its logs are of and whether a file is one process's `own_output`, as the ingest that wrote the "
    "database knew them; the diagnosis reads them instead of loading the format modules); `parts_url` (a views-only "
    "database: where its parts are); `loading_file` (while a big file is loaded in pieces).",
    (col("key", pa.string(), "Name."), col("value", pa.string(), "Value.")),
)


def all_tables(builtin_only: bool = False) -> list[Table]:
    """The bookkeeping tables and every table the formats fill (``builtin_only``: the
    formats of this package, not those other packages add)."""
    return [FILES, RUNS, PROBLEMS, META, *parsers.all_tables(builtin_only)]


def _duck_type(t: pa.DataType) -> str:
    if pa.types.is_int32(t):
        return "INTEGER"
    if pa.types.is_int64(t):
        return "BIGINT"
    if pa.types.is_float64(t):
        return "DOUBLE"
    if pa.types.is_float32(t):
        return "FLOAT"
    if pa.types.is_boolean(t):
        return "BOOLEAN"
    if pa.types.is_timestamp(t):
        return "TIMESTAMP"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "VARCHAR"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _duck_type(t.value_type) + "[]"
    if pa.types.is_struct(t):
        return "STRUCT(" + ", ".join(f'"{f.name}" {_duck_type(f.type)}' for f in t) + ")"
    raise TypeError(f"no DuckDB type for {t}")


# Columns stored with zstd instead of the compression DuckDB picks by analysing each
# segment. They hold long, varied text (every log line twice; each trace event's args):
# DuckDB's analysis of them cost more than the compression itself. Measured with one
# DuckDB thread, insert + commit (bench/README.md, "Sixth session"):
# - the 6.0M `lines` rows of bench_ingest.py's 1 GB folder: 14.8 CPU s and 398 MiB ->
#   10.5 s and 162 MiB;
# - one trace's 388k `trace_events` rows: 0.71-0.83 CPU s -> 0.57-0.69 s, 14.1 -> 9.5 MiB;
# a regular expression over all of `lines.text` is as fast. Short or repetitive text
# (metric values, names, categories) stays with DuckDB's choice: zstd made it bigger.
COLUMN_COMPRESSION = {
    ("lines", "text"): "zstd",
    ("lines", "message"): "zstd",
    ("trace_events", "args"): "zstd",
}


def ddl(table: Table) -> str:
    """The table's CREATE statement. A column with a ``default`` (stored once, see
    :class:`parsers.base.Column`) is a virtual column over a hidden ``_<name>`` column,
    which comes last and holds the column's own value only where it differs."""
    def column(c, name: str) -> str:
        method = COLUMN_COMPRESSION.get((table.name, c.name))
        return f'"{name}" {_duck_type(c.type)}' + (f" USING COMPRESSION {method}" if method else "")

    cols = [f'"{c.name}" {_duck_type(c.type)} GENERATED ALWAYS AS (coalesce("{stored_name(c)}", {c.default})) VIRTUAL'
            if c.default else column(c, c.name) for c in table.columns]
    cols += [column(c, stored_name(c)) for c in table.columns if c.default]
    return f'CREATE TABLE IF NOT EXISTS "{table.name}" ({", ".join(cols)})'


def stored_name(c) -> str:
    """The hidden column that holds a stored-once column's own values (see :func:`ddl`)."""
    return f"_{c.name}"


def insert_sql(table: Table, source: str, stores_once: bool = True) -> str:
    """``INSERT`` of the rows of ``source`` (a relation with the table's declared columns)
    into ``table``: a stored-once column's value goes to its hidden column only where it
    differs from the column's default. ``stores_once`` False: a database made before
    those columns existed, which keeps every value in the column itself."""
    once = [c for c in table.columns if c.default] if stores_once else []
    if not once:
        cols = ", ".join(f'"{c.name}"' for c in table.columns)
        return f'INSERT INTO "{table.name}" SELECT {cols} FROM {source}'
    plain = [c for c in table.columns if not c.default]
    target = [f'"{c.name}"' for c in plain] + [f'"{stored_name(c)}"' for c in once]
    values = [f'"{c.name}"' for c in plain] + [f'CASE WHEN "{c.name}" = ({c.default}) THEN NULL ELSE "{c.name}" END' for c in once]
    return f'INSERT INTO "{table.name}" ({", ".join(target)}) SELECT {", ".join(values)} FROM {source}'


def _schema_fingerprint() -> str:
    import hashlib

    h = hashlib.sha256(str(SCHEMA_VERSION).encode())
    for table in all_tables():
        h.update(ddl(table).encode())
    h.update(sql_modules.version().encode())
    return h.hexdigest()


def quiet_progress_bar(con: duckdb.DuckDBPyConnection) -> None:
    """Keep DuckDB's own progress bar off the user's terminal: long statements (the year
    fix over all lines) would draw it between ingest's messages. In a Jupyter kernel DuckDB
    draws it with ipywidgets and, when those are not installed, refuses the setting; it
    draws nothing there either, so the refusal is left at that."""
    try:
        con.execute("SET enable_progress_bar = false")
    except duckdb.InvalidInputException as exc:
        if "progress bar" not in str(exc):
            raise


class JsonRowsRefused(Exception):
    """DuckDB's JSON reader did not give exactly the rows the parser would have (a value
    of an unexpected type, an element it cannot read, a different count): the file is
    to be parsed the usual way."""


REFUSED_MARK = "forensics: an element the parser reads differently"


@dataclass
class KnownFile:
    file_id: int
    bytes: int
    sha256: str
    lines: int
    ends_with_newline: bool
    kind: str
    format: str


def template_path() -> str:
    """Where the empty database of this schema is kept (env FORENSICS_CACHE: the folder;
    default ``$XDG_CACHE_HOME/forensics``, else ``~/.cache/forensics``)."""
    folder = os.environ.get("FORENSICS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "forensics")
    return os.path.join(folder, f"empty-{_schema_fingerprint()[:20]}-duckdb{duckdb.__version__}.duckdb")


KEEP_TEMPLATES = 4  # empty databases kept in the cache (other schema or DuckDB versions: ~1 MB each)
_STALE_BUILD_S = 3600  # a template build older than this was left by a process that died


def _prune_templates(current: str) -> list[str]:
    """Remove cached empty databases of other schemas or DuckDB versions beyond the
    :data:`KEEP_TEMPLATES` - 1 most recently made ones, and builds left by processes that
    died; return what was removed. Never raises: a file that cannot be removed (another
    process removed it first, or has it open where that prevents removal), or a folder
    that cannot be listed, is left for a later prune; a stale cache file harms nothing."""
    folder = os.path.dirname(current)
    now = time.time()
    others, removed = [], []
    try:
        with os.scandir(folder) as entries:
            for e in entries:
                if not (e.name.startswith("empty-") and e.is_file()) or e.path == current:
                    continue
                mtime = e.stat().st_mtime
                if e.name.endswith(".duckdb"):
                    others.append((mtime, e.path))
                elif e.name.endswith((".tmp", ".tmp.wal")) and now - mtime > _STALE_BUILD_S:
                    removed.append(e.path)
    except OSError:  # see the docstring
        return []
    removed += [p for _, p in sorted(others, reverse=True)[KEEP_TEMPLATES - 1:]]
    gone = []
    for p in removed:
        try:
            os.unlink(p)
            gone.append(p)
        except OSError:
            pass  # see the docstring
    return gone


def _start_from_template(path: str) -> bool:
    """Make the new database ``path`` a copy of an empty database with every table and
    view of this schema, built once per schema and DuckDB version in :func:`template_path`.

    Binding the analysis views costs about 1.3 s of CPU for each database they are
    created in (DuckDB binds a view, and every view under it, at CREATE VIEW), while
    opening a database that has them costs nothing: a copy skips that cost. When the
    cache cannot be written or read (read-only home, disk full), the database is made
    the usual way: that only costs the time. Returns whether ``path`` is such a copy."""
    template = template_path()
    try:
        if not os.path.exists(template):
            os.makedirs(os.path.dirname(template), exist_ok=True)
            building = f"{template}.{os.getpid()}.{threading.get_ident()}.tmp"
            try:
                Store(building, _template=False).close()
                os.replace(building, template)  # atomic: readers see a whole file or none
                _prune_templates(template)
            finally:
                for leftover in (building, building + ".wal"):
                    if os.path.exists(leftover):
                        os.unlink(leftover)
        copying = path + ".forensics-new"
        try:
            shutil.copyfile(template, copying)
            os.link(copying, path)  # not os.replace: a database another process made meanwhile stays
        finally:
            if os.path.exists(copying):
                os.unlink(copying)
        return True
    except (OSError, duckdb.Error, StoreError):
        return False  # see the docstring: the database is then made the usual way


class Store:
    def __init__(self, path: str | os.PathLike, read_only: bool = False, defer_views: bool = False,
                 _template: bool = True):
        """``defer_views``: create missing tables now but the analysis views only at
        :meth:`finish_schema` (binding them costs about a second of CPU, which ingest
        spends while the parser processes start). A new database file starts as a copy
        of an empty one that has them (:func:`_start_from_template`)."""
        self.path = str(path)
        copied = (_template and not read_only and not self.path.startswith(":memory:") and not os.path.exists(self.path)
                  and _start_from_template(self.path))
        try:
            try:
                self.con = db_connect(self.path, read_only=read_only)
            except duckdb.Error:
                if not copied:
                    raise
                # the cached copy is damaged (it was whole when written): drop both, start afresh
                for damaged in (self.path, template_path()):
                    if os.path.exists(damaged):
                        os.unlink(damaged)
                self.con = db_connect(self.path, read_only=read_only)
        except duckdb.IOException as exc:
            text = str(exc)
            if "lock" in text.lower():
                raise StoreLocked(
                    f"database {self.path} is in use by another process (another `forensics ingest`?); "
                    "wait for it to finish and run again"
                ) from None
            raise StoreError(f"cannot open database {self.path}: {text}") from None
        except duckdb.Error as exc:  # e.g. a file that is not a DuckDB database
            raise StoreError(f"cannot open database {self.path}: {exc}") from None
        self.read_only = read_only
        self._pending_fingerprint: str | None = None
        self._stores_once: dict[str, bool] = {}  # per table: does it have the hidden columns (insert_sql)
        quiet_progress_bar(self.con)
        try:
            parts = attach_parts(self.con)
            if parts and not read_only:
                raise StoreError(f"{self.path} is made of views over the parts at {parts}: ingest into it with "
                                 f"`--engine ray --parts {parts} --views-only`, or give another --db")
        except StoreError:
            self.con.close()
            raise
        if not read_only:
            self.ensure_schema(defer_views)
            self.record_format_facts()

    # -- schema ---------------------------------------------------------------
    def ensure_schema(self, defer_views: bool = False) -> None:
        """Create or extend the tables, then (re)create the views (``defer_views``: at
        :meth:`finish_schema`). Skipped when the database already has this exact schema
        and these exact views (a fingerprint of the declarations and SQL modules is kept
        in ``meta``, written once the views exist)."""
        con = self.con
        fingerprint = _schema_fingerprint()
        try:
            row = con.execute("SELECT value FROM meta WHERE key = 'schema_fingerprint'").fetchone()
        except duckdb.CatalogException:
            row = None
        if row and row[0] == fingerprint:
            return
        for table in all_tables():
            con.execute(ddl(table))
            have = {r[0] for r in con.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = ?", [table.name]).fetchall()}
            for c in table.columns:
                if c.name not in have:
                    con.execute(f'ALTER TABLE "{table.name}" ADD COLUMN "{c.name}" {_duck_type(c.type)}')
        self._pending_fingerprint = fingerprint
        if not defer_views:
            self.finish_schema()

    def finish_schema(self) -> None:
        """Create the views that :meth:`ensure_schema` deferred (nothing when none were)."""
        if self._pending_fingerprint is None:
            return
        con = self.con
        self.create_views()
        con.execute("DELETE FROM meta WHERE key IN ('schema_version', 'schema_fingerprint')")
        con.execute("INSERT INTO meta VALUES ('schema_version', ?), ('schema_fingerprint', ?)",
                    [str(SCHEMA_VERSION), self._pending_fingerprint])
        self._pending_fingerprint = None

    def record_format_facts(self) -> None:
        """Keep in ``meta`` what the diagnosis needs to know of this installation's formats
        (:class:`forensics.database.FormatFacts`), so that reading the database needs no
        format module. Written when it differs (a format package installed or removed)."""
        facts = FormatFacts.of_registry().to_json()
        have = self.con.execute("SELECT value FROM meta WHERE key = ?", [FORMAT_FACTS_KEY]).fetchall()
        if have and have[0][0] == facts:
            return
        self.con.execute("DELETE FROM meta WHERE key = ?", [FORMAT_FACTS_KEY])
        self.con.execute("INSERT INTO meta VALUES (?, ?)", [FORMAT_FACTS_KEY, facts])

    def create_views(self) -> None:
        """(Re)create every SQL module's views and macros (forensics/sql/, in dependency order)."""
        sql_modules.create(self.con)

    # -- files ----------------------------------------------------------------
    def known_files(self, root: str, node: str | None = None) -> dict[str, KnownFile]:
        """Every file already ingested from ``root``, by path relative to it (without the
        PATH's prefix, :meth:`path_prefix`); ``node``: read on that node, by the Ray engine
        (one path is a different file on each node)."""
        cut = len(self.path_prefix(root) or "")
        cut += 1 if cut else 0
        where, params = "root = ?", [root]
        if node is not None:
            where, params = "root = ? AND node = ?", [root, node]
        rows = self.con.execute(
            f"SELECT path, file_id, bytes, sha256, lines, ends_with_newline, kind, format FROM files WHERE {where}", params
        ).fetchall()
        return {r[0][cut:]: KnownFile(*r[1:]) for r in rows}

    # -- runs -----------------------------------------------------------------
    def path_runs(self) -> dict[str, tuple[int, str, str | None]]:
        """The ingested PATHs: root -> (run_id, name, path prefix or None). Files of a
        database written before runs existed get their PATH's row first."""
        legacy = [r[0] for r in self.con.execute(
            "SELECT DISTINCT root FROM files WHERE run_id IS NULL AND root NOT IN (SELECT root FROM runs) ORDER BY 1").fetchall()]
        for root in legacy:
            self.add_path_run(root)
        if legacy:
            for root in legacy:
                self.assign_runs(root)
            if len(self._path_rows()) > 1:  # several PATHs, until now without prefixes
                self.ensure_prefixes()
        return self._path_rows()

    def _path_rows(self) -> dict[str, tuple[int, str, str | None]]:
        return {r[0]: (int(r[1]), r[2], r[3]) for r in self.con.execute(
            "SELECT root, run_id, name, path_prefix FROM runs WHERE parent_id IS NULL ORDER BY run_id").fetchall()}

    def path_prefix(self, root: str) -> str | None:
        row = self.con.execute("SELECT path_prefix FROM runs WHERE parent_id IS NULL AND root = ?", [root]).fetchone()
        return row[0] if row else None

    def _next_run_id(self) -> int:
        return int(self.con.execute("SELECT coalesce(max(run_id), 0) + 1 FROM runs").fetchone()[0])

    def add_path_run(self, root: str) -> int:
        """A row for the newly ingested PATH ``root``; its name is the PATH's own name, made
        unique among the database's PATHs with the folders above it."""
        taken = {r[0] for r in self.con.execute("SELECT name FROM runs WHERE parent_id IS NULL").fetchall()}
        parts = [p for p in root.replace("\\", "/").split("/") if p] or [root]
        name = parts[-1]
        for i in range(2, len(parts) + 1):
            if name not in taken:
                break
            name = "/".join(parts[-i:])
        n = 2
        base = name
        while name in taken:
            name, n = f"{base}~{n}", n + 1
        run_id = self._next_run_id()
        now = _now()
        self.con.execute("INSERT INTO runs (run_id, parent_id, root, rel, name, kind, path_prefix, files, ingested_at, updated_at) "
                         "VALUES (?, NULL, ?, '', ?, 'path', NULL, 0, ?, ?)", [run_id, root, name, now, now])
        return run_id

    def ensure_prefixes(self) -> None:
        """Several PATHs in the database: every file's path starts with its PATH's name
        (../shared/contract.md), so that two ``driver.log`` are never confused. PATHs
        stored without a prefix get it now."""
        for root, (_, name, prefix) in self._path_rows().items():
            if prefix is None:
                self.con.execute("UPDATE files SET path = ? || '/' || path WHERE root = ?", [name, root])
                self.con.execute("UPDATE runs SET path_prefix = ? WHERE parent_id IS NULL AND root = ?", [name, root])

    def run_names(self, roots: list[str]) -> list[str]:
        """The names of the runs (those a diagnosis reads) of the PATHs ``roots``."""
        return [r.name for r in diagnosable_runs(self.con) if r.root in roots]

    def assign_runs(self, root: str) -> None:
        """Find the runs among the files of the PATH ``root`` (:mod:`forensics.runs`) and
        record them: a row per run found inside it (ids kept for runs already known), each
        file's ``run_id``, each run's file count."""
        from .runs import DRIVER_FORMATS, find_runs

        path_id, name, prefix = self._path_rows()[root]
        cut = len(prefix) + 1 if prefix else 0
        files = self.con.execute("SELECT file_id, path, format FROM files WHERE root = ?", [root]).fetchall()
        by_rel = {p[cut:]: fid for fid, p, _ in files}
        drivers = [fid for fid, _, fmt in files if fmt in DRIVER_FORMATS]
        pids: dict[str, set[int]] = {}
        if len(drivers) >= 2:
            rel_of = {fid: p[cut:] for fid, p, _ in files}
            for fid, named in self.con.execute(
                    "SELECT file_id, list(DISTINCT pid) FROM lines WHERE list_contains(?, file_id) AND pid IS NOT NULL GROUP BY file_id",
                    [drivers]).fetchall():
                pids[rel_of[fid]] = set(named)
        found, _rest = find_runs([(p[cut:], fmt) for _, p, fmt in files], pids)
        known = {r[0]: int(r[1]) for r in self.con.execute(
            "SELECT rel, run_id FROM runs WHERE parent_id = ?", [path_id]).fetchall()}
        now = _now()
        self.con.execute("UPDATE files SET run_id = ? WHERE root = ?", [path_id, root])
        keep = []
        for run in found:
            if run.rel == "":
                continue
            run_id = known.get(run.rel)
            if run_id is None:
                run_id = self._next_run_id()
                self.con.execute(
                    "INSERT INTO runs (run_id, parent_id, root, rel, name, kind, path_prefix, files, ingested_at, updated_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, NULL, 0, ?, ?)", [run_id, path_id, root, run.rel, f"{name}/{run.rel}", run.kind, now, now])
            keep.append(run_id)
            ids = [by_rel[f] for f in run.files if f in by_rel]
            self.con.execute("UPDATE files SET run_id = ? WHERE list_contains(?, file_id)", [run_id, ids])
        gone = [i for i in known.values() if i not in keep]
        if gone:
            self.con.execute("DELETE FROM runs WHERE list_contains(?, run_id)", [gone])
        self.con.execute(
            "UPDATE runs SET files = (SELECT count(*) FROM files f WHERE f.run_id = runs.run_id) WHERE parent_id = ?", [path_id])
        self.con.execute("UPDATE runs SET files = (SELECT count(*) FROM files WHERE root = ?), updated_at = ? WHERE run_id = ?",
                         [root, now, path_id])

    def next_file_id(self) -> int:
        return int(self.con.execute("SELECT coalesce(max(file_id), 0) + 1 FROM files").fetchone()[0])

    def last_line_offset(self, file_id: int, line_no: int) -> int | None:
        row = self.con.execute("SELECT byte_offset FROM lines WHERE file_id = ? AND line_no = ?", [file_id, line_no]).fetchone()
        return int(row[0]) if row else None

    def tables_with_file_rows(self) -> list[Table]:
        return [t for t in all_tables() if t.columns and t.columns[0].name == "file_id" and t.name != "files"]

    def begin(self) -> None:
        self.con.execute("BEGIN TRANSACTION")

    def commit(self) -> None:
        self.con.execute("COMMIT")

    def rollback(self) -> None:
        self.con.execute("ROLLBACK")

    @contextlib.contextmanager
    def transaction(self):
        """``with store.transaction(): ...``: the block's statements are committed together,
        or, when the block raises (Ctrl-C included), rolled back and the exception goes on.
        Should the rollback fail too (a failed COMMIT has ended the transaction already),
        its message is added to the exception that goes on, not put in its place."""
        self.begin()
        try:
            yield
            self.commit()
        except BaseException as exc:
            try:
                self.rollback()
            except duckdb.Error as also:
                exc.add_note(f"(and the rollback after it failed: {also})")
            raise

    def delete_file_rows(self, file_id: int, replace_from_line: int | None) -> None:
        """Remove a file's rows before it is loaded again: all of them, or (a grown
        file) those from ``replace_from_line`` on. Its ``files`` row goes too."""
        con = self.con
        for t in self.tables_with_file_rows():
            if replace_from_line is None:
                con.execute(f'DELETE FROM "{t.name}" WHERE file_id = ?', [file_id])
            elif any(c.name == "line_no" for c in t.columns):
                con.execute(f'DELETE FROM "{t.name}" WHERE file_id = ? AND line_no >= ?', [file_id, replace_from_line])
        con.execute("DELETE FROM files WHERE file_id = ?", [file_id])

    # -- big files, committed in pieces ----------------------------------------
    # DuckDB holds a transaction's new rows in memory until it commits, so the rows of
    # a big file go in several transactions. The first one also notes the file in
    # `meta`; the last one, with the file's `files` row, removes the note. A note left
    # by an interrupted ingest names a file whose rows are incomplete:
    # drop_unfinished_files removes them before the next ingest plans anything.
    def mark_loading(self, file_id: int, path: str) -> None:
        self.con.execute("INSERT INTO meta VALUES ('loading_file', ?)", [f"{file_id} {path}"])

    def finish_loading(self, file_id: int) -> None:
        self.con.execute("DELETE FROM meta WHERE key = 'loading_file' AND split_part(value, ' ', 1) = ?", [str(file_id)])

    def drop_unfinished_files(self) -> list[str]:
        """Remove every row of the files whose load was cut between two pieces (their
        ``files`` row included), so that the next ingest reads them whole; returns their paths."""
        notes = {}
        for (value,) in self.con.execute("SELECT value FROM meta WHERE key = 'loading_file'").fetchall():
            file_id, _, path = value.partition(" ")
            notes[int(file_id)] = path
        if notes:
            with self.transaction():
                for file_id in notes:
                    self.delete_file_rows(file_id, None)
                self.con.execute("DELETE FROM meta WHERE key = 'loading_file'")
        return sorted(notes.values())

    def insert_parts(self, parts: dict[str, list[str]], con: duckdb.DuckDBPyConnection | None = None) -> dict[str, int]:
        """Insert spooled Arrow IPC parts, Arrow tables, or parts with a ``read()`` that
        gives their table (on ``con``, a cursor of this store, else its connection);
        return rows added per table."""
        con = con or self.con
        counts: dict[str, int] = {}
        by_name = {t.name: t for t in all_tables()}
        for name, paths in parts.items():
            if name not in by_name:
                raise KeyError(f"parser produced rows for unknown table {name!r}")
            for p in paths:
                if isinstance(p, pa.Table):  # rows another engine handed over in memory
                    arrow = p
                elif not isinstance(p, (str, os.PathLike)):  # a part read only now (pipeline.part_size)
                    arrow = p.read()
                else:
                    with pa.memory_map(p) as source:
                        arrow = ipc.open_file(source).read_all()
                con.register("_part", arrow)
                con.execute(self._insert_sql(by_name[name], "_part"))
                con.unregister("_part")
                counts[name] = counts.get(name, 0) + arrow.num_rows
        return counts

    def _insert_sql(self, table: Table, source: str) -> str:
        if not any(c.default for c in table.columns):
            return insert_sql(table, source)
        once = self._stores_once.get(table.name)
        if once is None:  # a database made before stored-once columns keeps them whole
            hidden = {stored_name(c) for c in table.columns if c.default}
            have = {r[0] for r in self.con.execute(
                "SELECT column_name FROM duckdb_columns() WHERE table_name = ? AND schema_name = 'main' "
                "AND database_name = current_database()", [table.name]).fetchall()}
            once = self._stores_once[table.name] = hidden <= have
        return insert_sql(table, source, once)

    def insert_rows(self, table: Table, rows: list[dict], con: duckdb.DuckDBPyConnection | None = None) -> None:
        if not rows:
            return
        con = con or self.con
        con.register("_rows", pa.Table.from_pylist(rows, schema=table.arrow_schema))
        con.execute(self._insert_sql(table, "_rows"))
        con.unregister("_rows")

    def insert_json_rows(self, handed: JsonArrayRows, con: duckdb.DuckDBPyConnection) -> int:
        """Insert the rows a parser handed over as JSON (see :class:`parsers.base.JsonArrayRows`)
        in ``con``'s open transaction and return how many there are. Raises
        :class:`JsonRowsRefused` when a row is not ``ok`` or their number is not the
        parser's count; the caller then rolls back and has the file parsed the usual way."""
        table = {t.name: t for t in all_tables()}.get(handed.table)
        if table is None:
            raise KeyError(f"parser produced rows for unknown table {handed.table!r}")
        try:
            (n,) = con.execute(self._insert_sql(
                table, f"({handed.select}) WHERE CASE WHEN ok THEN true ELSE error('{REFUSED_MARK}') END")).fetchone()
        except duckdb.InterruptException:
            raise  # the ingest is being stopped: not a reason to decode the file instead
        except duckdb.Error as exc:
            raise JsonRowsRefused(str(exc).split("\n")[0]) from None
        if n != handed.rows:
            raise JsonRowsRefused(f"{n} row(s) read where the parser found {handed.rows} element(s)")
        return int(n)

    def record_skipped(self, file_row: dict) -> None:
        """Record a file that was not parsed (call inside a transaction)."""
        self.con.execute("DELETE FROM files WHERE file_id = ?", [file_row["file_id"]])
        self.insert_rows(FILES, [file_row])

    def fix_yearless_timestamps(self) -> int:
        """Stamps printed without a year (glog, vLLM, syslog) in files that had no full
        stamp of their own take the year most common among the full stamps of their run
        (``files.run_id``: the runs of a database may be years apart), else, in a run
        without one, the year most common in the database."""
        from .parsers.lines.common import YEARLESS

        counts = """SELECT coalesce(f.run_id, -1) AS run, year(l.ts) AS y, count(*) AS n
                    FROM lines l JOIN files f USING (file_id) WHERE l.ts_quality = 'full' GROUP BY ALL"""
        # a run without a full stamp of its own takes the database's most common year
        best = f"""(SELECT f.file_id, coalesce(b.y, g.y) AS y FROM files f
                    LEFT JOIN (SELECT run, arg_max(y, n) AS y FROM ({counts}) GROUP BY run) b ON coalesce(f.run_id, -1) = b.run
                    CROSS JOIN (SELECT arg_max(y, n) AS y FROM (SELECT y, sum(n) AS n FROM ({counts}) GROUP BY y)) g
                    WHERE coalesce(b.y, g.y) <> {YEARLESS})"""
        n = self.con.execute(
            f"""UPDATE lines SET ts = ts + to_years(fy.y - {YEARLESS}),
                   ts_quality = CASE WHEN ts_quality = 'no_year' THEN 'year_inferred' ELSE ts_quality END
                FROM {best} fy
                WHERE lines.file_id = fy.file_id AND year(lines.ts) = {YEARLESS} AND lines.ts_quality IN ('no_year', 'inherited')"""
        ).fetchone()
        for table in all_tables():  # rows derived from lines carry the line's ts
            if table.name != "lines" and any(c.name == "ts" for c in table.columns) and table.columns[0].name == "file_id":
                self.con.execute(
                    f'UPDATE "{table.name}" SET ts = ts + to_years(fy.y - {YEARLESS}) FROM {best} fy '
                    f'WHERE "{table.name}".file_id = fy.file_id AND year("{table.name}".ts) = {YEARLESS}')
        return int(n[0]) if n else 0

    def table_counts(self) -> dict[str, int]:
        out = {}
        for t in all_tables():
            out[t.name] = int(self.con.execute(f'SELECT count(*) FROM "{t.name}"').fetchone()[0])
        return out

    def close(self) -> None:
        self.con.close()


def _now():
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).replace(tzinfo=None)


def write_part(path: str | Path, table: pa.Table) -> None:
    with pa.OSFile(str(path), "wb") as sink:
        with ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
