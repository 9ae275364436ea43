"""Export an ingested database: Parquet (one file per table) and one merged Chrome trace.

Parquet files are plain: DuckDB, polars, pandas and pyarrow read them without this
package. The Chrome trace (the JSON format of ``chrome://tracing`` and
https://ui.perfetto.dev) puts every rank of the run on one wall-clock timeline: phase
spans, GPU kernels and annotations from the profiler traces, Ray task spans, and the
error/warning log lines as instant events carrying their ``file:line``.

Everything is computed in DuckDB and written out in batches, so memory stays bounded
by the batch size, not by the size of the trace.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable, Sequence

import duckdb

# PyTorch profiler categories merged by default: what ran on the GPU, and the spans the
# program marked itself. CPU operators and CUDA API calls are left out unless asked for
# (they are most of a profiler trace and rarely what a post-mortem looks at). Events of
# other traces (the Ray timeline: tasks and their stages) are all taken.
DEFAULT_CATEGORIES: tuple[str, ...] = (
    "kernel", "gpu_memcpy", "gpu_memset", "user_annotation", "gpu_user_annotation",
)
GPU_CATEGORIES: tuple[str, ...] = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")
LOG_LEVELS: tuple[str, ...] = ("WARNING", "ERROR", "FATAL")
BATCH_ROWS = 20_000


# -- Parquet -----------------------------------------------------------------------

def base_tables(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Names of the database's tables (not views), sorted."""
    rows = con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_type = 'BASE TABLE' "
        "AND table_schema = 'main' AND table_catalog = current_database() ORDER BY 1"
    ).fetchall()
    return [r[0] for r in rows]


def _hidden_columns(con: duckdb.DuckDBPyConnection, table: str) -> list[str]:
    """The hidden columns behind a table's stored-once columns (``forensics.store.ddl``):
    storage, not data; the Parquet file carries the column under its own name, whole."""
    from .store import all_tables, stored_name

    declared = {t.name: t for t in all_tables()}.get(table)
    if declared is None:
        return []
    hidden = {stored_name(c) for c in declared.columns if c.default}
    if not hidden:
        return []
    have = {r[0] for r in con.execute(
        "SELECT column_name FROM duckdb_columns() WHERE table_name = ? AND schema_name = 'main' "
        "AND database_name = current_database()", [table]).fetchall()}
    return sorted(hidden & have)


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def parquet(con: duckdb.DuckDBPyConnection, out_dir: str | os.PathLike, tables: Iterable[str] | None = None) -> dict[str, int]:
    """Write one ``<table>.parquet`` per table into ``out_dir`` (created if missing).

    Empty tables are written too (a schema and no rows). Each file is written under a
    temporary name and renamed, so a reader never sees half a file.
    Returns ``{table: rows written}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = list(tables) if tables is not None else base_tables(con)
    known = set(base_tables(con))
    counts: dict[str, int] = {}
    # qualified by the database's own catalog: a temp table of the same name (a read-only
    # Run attaches some) must not stand in for the stored one
    catalog = con.execute("SELECT current_database()").fetchall()[0][0]
    for name in names:
        qualified = f"{_ident(catalog)}.main.{_ident(name)}"
        if name not in known:
            raise KeyError(f"no table {name!r} in the database (tables: {', '.join(sorted(known))})")
        final = out / f"{name}.parquet"
        tmp = out / f".{name}.parquet.tmp"
        hidden = _hidden_columns(con, name)
        select = "*" + (f" EXCLUDE ({', '.join(map(_ident, hidden))})" if hidden else "")
        con.execute(
            f"COPY (SELECT {select} FROM {qualified}) TO {_sql_string(str(tmp))} (FORMAT parquet, COMPRESSION zstd)"
        )
        os.replace(tmp, final)
        counts[name] = int(con.execute(f"SELECT count(*) FROM {qualified}").fetchall()[0][0])
    return counts


# -- Chrome / Perfetto trace ---------------------------------------------------------

@dataclass
class ChromeTraceSummary:
    """What :func:`chrome_trace` wrote."""

    path: str
    events: int = 0  # every JSON object in traceEvents, metadata included
    by_kind: dict[str, int] = field(default_factory=dict)  # phase, trace, log, metadata
    processes: list[str] = field(default_factory=list)  # process names, in pid order
    origin_utc: str | None = None  # wall-clock time of ts = 0
    unplaced_log_lines: int = 0  # warnings/errors without a timestamp (not in the trace)
    phase_source: str | None = None  # the view the phase spans came from

    def to_dict(self) -> dict:
        return {
            "path": self.path, "events": self.events, "by_kind": self.by_kind, "processes": self.processes,
            "origin_utc": self.origin_utc, "unplaced_log_lines": self.unplaced_log_lines,
            "phase_source": self.phase_source,
        }


def _relations(con: duckdb.DuckDBPyConnection) -> dict[str, set[str]]:
    """{table or view name: its column names} of the main schema."""
    rows = con.execute(
        "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'main'"
    ).fetchall()
    out: dict[str, set[str]] = {}
    for table, column in rows:
        out.setdefault(table, set()).add(column)
    return out


# Phase spans come from the phase-attribution views (forensics/sql/6*_*.sql): the first
# relation here that exists with the needed columns is used. Bounds are wall-clock
# microseconds since the epoch; `rank IS NULL` rows are run-level (the driver's timers).
PHASE_SPAN_SOURCES: tuple[str, ...] = ("phase_timeline", "phase_spans")
PHASE_SPAN_COLUMNS = {"rank", "step", "phase", "name", "start_us", "end_us"}


def phase_span_source(con: duckdb.DuckDBPyConnection) -> str | None:
    """The view the phase spans come from, or None when no phase view exists."""
    rel = _relations(con)
    for name in PHASE_SPAN_SOURCES:
        if PHASE_SPAN_COLUMNS <= rel.get(name, set()):
            return name
    return None


def _event_sql(con: duckdb.DuckDBPyConnection, categories: Sequence[str], log_levels: Sequence[str]) -> tuple[str, str | None]:
    """SQL of the unified event list (one row per span / instant, before pid/tid
    numbering) and the phase source used. Columns: proc_key, proc_group, proc_rank,
    node, role, thread_key, thread_sort, kind, ph, cat, name, base_us, frac_us, dur_us,
    args. The wall-clock start is ``base_us + frac_us`` microseconds since the epoch, kept
    apart because one double at today's epoch microseconds resolves only 0.25 us: trace
    events keep their own clock (``ts_us``) in ``frac_us`` and the file's offset to the
    epoch in ``base_us``."""
    rel = _relations(con)
    parts: list[str] = []
    if {"source", "rank", "ts", "ts_us", "dur_us", "category"} <= rel.get("trace_events", set()):
        cats = ", ".join(_sql_string(c) for c in categories) or "NULL"
        gpu = ", ".join(_sql_string(c) for c in GPU_CATEGORIES)
        parts.append(f"""
        SELECT
            CASE WHEN e.rank IS NOT NULL THEN 'rank ' || e.rank ELSE concat_ws(' ', e.source, e.pid) END AS proc_key,
            CASE WHEN e.rank IS NOT NULL THEN 0 ELSE 1 END AS proc_group,
            e.rank AS proc_rank,
            f.node, f.actor AS role,
            CASE WHEN e.category IN ({gpu})
                 THEN 'GPU ' || coalesce(CAST(e.device AS VARCHAR), e.pid) || ' stream ' || coalesce(CAST(e.stream AS VARCHAR), e.tid)
                 ELSE e.source || ' thread ' || coalesce(e.tid, '?') END AS thread_key,
            CASE WHEN e.category IN ({gpu}) THEN 3 ELSE 2 END AS thread_sort,
            'trace' AS kind,
            CASE WHEN e.dur_us IS NULL THEN 'i' ELSE 'X' END AS ph,
            e.category AS cat,
            e.name,
            o.offset_us AS base_us,
            e.ts_us AS frac_us,
            e.dur_us,
            CASE WHEN json_valid(e.args) THEN e.args::JSON END AS args
        FROM trace_events e
        JOIN files f USING (file_id)
        JOIN _ct_offsets o USING (file_id)
        WHERE (e.category IN ({cats}) OR (e.source <> 'kineto' AND e.category IS DISTINCT FROM 'metadata'))
          AND e.ph IN ('X', 'i', 'I')
          AND isfinite(e.ts_us) AND (e.dur_us IS NULL OR isfinite(e.dur_us))""")
    phase_source = phase_span_source(con)
    if phase_source:
        cols = rel[phase_source]
        extra = ", ".join(f"'{c}': {c}" for c in ("sub_phase", "source", "approximate", "file_id", "line_no") if c in cols)
        parts.append(f"""
        SELECT
            coalesce('rank ' || rank, 'run') AS proc_key, CASE WHEN rank IS NULL THEN -1 ELSE 0 END AS proc_group,
            rank AS proc_rank, NULL AS node, NULL AS role,
            'phases' AS thread_key, 1 AS thread_sort, 'phase' AS kind, 'X' AS ph, 'phase' AS cat,
            phase AS name,
            floor(start_us)::BIGINT AS base_us,
            start_us - floor(start_us) AS frac_us,
            (end_us - start_us)::DOUBLE AS dur_us,
            to_json({{'phase': phase, 'step': step, 'span': name{", " + extra if extra else ""}}}) AS args
        FROM {_ident(phase_source)}
        WHERE start_us IS NOT NULL AND end_us IS NOT NULL AND end_us >= start_us
          AND isfinite(start_us) AND isfinite(end_us)""")
    if "error_lines" in rel:
        levels = ", ".join(_sql_string(lv) for lv in log_levels) or "NULL"
        parts.append(f"""
        SELECT
            CASE WHEN l.rank IS NOT NULL THEN 'rank ' || l.rank
                 WHEN l.pid IS NOT NULL THEN concat_ws(' ', l.node, 'pid ' || l.pid)
                 ELSE 'log ' || l.path END AS proc_key,
            CASE WHEN l.rank IS NOT NULL THEN 0 WHEN l.pid IS NOT NULL THEN 1 ELSE 2 END AS proc_group,
            l.rank AS proc_rank, l.node, l.actor AS role,
            'log' AS thread_key, 0 AS thread_sort, 'log' AS kind, 'i' AS ph, 'log ' || lower(l.level) AS cat,
            l.level || ': ' || left(l.message, 120) AS name,
            epoch_us(l.ts) AS base_us,
            0.0::DOUBLE AS frac_us,
            NULL::DOUBLE AS dur_us,
            to_json({{'file': l.path || ':' || l.line_no, 'level': l.level, 'message': l.message}}) AS args
        FROM (SELECT e.* REPLACE (coalesce(e.rank, m.rank) AS rank)
              FROM error_lines e LEFT JOIN _ct_pid_rank m ON m.pid = e.pid AND e.rank IS NULL) l
        WHERE l.ts IS NOT NULL AND l.level IN ({levels})""")
    if not parts:
        return "", phase_source
    return "\nUNION ALL\n".join(parts), phase_source


# CPU-side profiler categories: their pid is the OS process id of the rank.
_HOST_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function")


def _pid_rank_table(con: duckdb.DuckDBPyConnection) -> None:
    """Temp tables ``_ct_pid_rank`` (the rank of an OS pid: the rank most evidence agrees
    on, from the profiler traces and from the ``rank_pids`` view) and ``_ct_rank_hints``
    (the node and role most lines of a rank name), so that log lines without a rank
    prefix land on their rank's process and rank processes get a node name."""
    rel = _relations(con)
    sources = []
    if {"source", "rank", "pid", "category"} <= rel.get("trace_events", set()):
        cats = ", ".join(_sql_string(c) for c in _HOST_CATEGORIES)
        sources.append(
            "SELECT TRY_CAST(pid AS BIGINT) AS pid, rank, count(*) AS n FROM trace_events "
            f"WHERE source = 'kineto' AND rank IS NOT NULL AND category IN ({cats}) GROUP BY ALL")
    if {"pid", "rank", "n"} <= rel.get("rank_pids", set()):
        sources.append("SELECT pid, rank, n FROM rank_pids")
    elif "attributed_lines" in rel:
        sources.append("SELECT pid, rank, count(*) AS n FROM attributed_lines WHERE pid IS NOT NULL AND rank IS NOT NULL GROUP BY ALL")
    union = " UNION ALL ".join(sources) if sources else "SELECT NULL::BIGINT AS pid, NULL::INTEGER AS rank, 0 AS n"
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE _ct_pid_rank AS
        SELECT pid, arg_max(rank, n) AS rank FROM (
            SELECT pid, rank, sum(n) AS n FROM ({union}) WHERE pid IS NOT NULL AND rank IS NOT NULL GROUP BY pid, rank
        ) GROUP BY pid""")
    if "attributed_lines" in rel:
        con.execute("""
            CREATE OR REPLACE TEMP TABLE _ct_rank_hints AS
            SELECT coalesce(a.rank, m.rank) AS rank, mode(a.node) AS node, mode(a.actor) AS role
            FROM attributed_lines a LEFT JOIN _ct_pid_rank m ON m.pid = a.pid AND a.rank IS NULL
            WHERE coalesce(a.rank, m.rank) IS NOT NULL GROUP BY ALL""")
    else:
        con.execute("CREATE OR REPLACE TEMP TABLE _ct_rank_hints (rank INTEGER, node VARCHAR, role VARCHAR)")


def _offsets_table(con: duckdb.DuckDBPyConnection) -> None:
    """Temp table ``_ct_offsets(file_id, offset_us)``: per trace file, the whole
    microseconds to add to its clock (``ts_us``) to get epoch microseconds, from the
    wall-clock ``ts`` of its events. A file without wall-clock times starts at the earliest
    wall-clock time of the other traces (its place in the run is unknown)."""
    if {"ts", "ts_us", "file_id"} <= _relations(con).get("trace_events", set()):
        con.execute("""
            CREATE OR REPLACE TEMP TABLE _ct_offsets AS
            WITH per_file AS (
                SELECT file_id, round(avg(epoch_us(ts) - ts_us))::BIGINT AS offset_us,
                       min(ts_us) AS first_us, min(epoch_us(ts)) AS first_epoch
                FROM trace_events WHERE isfinite(ts_us) GROUP BY file_id
            )
            SELECT file_id,
                   coalesce(offset_us, (SELECT coalesce(min(first_epoch), 0) FROM per_file) - floor(first_us)::BIGINT) AS offset_us
            FROM per_file""")
    else:
        con.execute("CREATE OR REPLACE TEMP TABLE _ct_offsets (file_id INTEGER, offset_us BIGINT)")


_METADATA_QUERIES = (
    "SELECT json_object('name', 'process_name', 'ph', 'M', 'pid', pid, 'tid', 0, 'args', json_object('name', name)) FROM _ct_procs ORDER BY pid",
    "SELECT json_object('name', 'process_sort_index', 'ph', 'M', 'pid', pid, 'tid', 0, 'args', json_object('sort_index', pid)) FROM _ct_procs ORDER BY pid",
    "SELECT json_object('name', 'thread_name', 'ph', 'M', 'pid', p.pid, 'tid', t.tid, 'args', json_object('name', t.thread_key)) "
    "FROM _ct_threads t JOIN _ct_procs p USING (proc_key) ORDER BY p.pid, t.tid",
    "SELECT json_object('name', 'thread_sort_index', 'ph', 'M', 'pid', p.pid, 'tid', t.tid, 'args', json_object('sort_index', t.tid)) "
    "FROM _ct_threads t JOIN _ct_procs p USING (proc_key) ORDER BY p.pid, t.tid",
)


def _write_batches(fh: IO[str], cursor: duckdb.DuckDBPyConnection, first: bool) -> tuple[int, bool]:
    n = 0
    while True:
        rows = cursor.fetchmany(BATCH_ROWS)
        if not rows:
            return n, first
        chunk = ",\n".join(r[0] for r in rows)
        fh.write(chunk if first else ",\n" + chunk)
        first = False
        n += len(rows)


def chrome_trace(
    con: duckdb.DuckDBPyConnection,
    path: str | os.PathLike,
    categories: Sequence[str] = DEFAULT_CATEGORIES,
    log_levels: Sequence[str] = LOG_LEVELS,
) -> ChromeTraceSummary:
    """Write one Chrome/Perfetto trace (JSON) of the whole run to ``path``.

    * one process per rank (named ``node rank N role`` through ``M`` metadata events),
      plus one per process or file whose log lines name no rank, and one per Ray node;
    * threads: ``phases`` (phase spans), ``log`` (warning/error lines as instant events,
      ``args.file`` = ``path:line``), one per CPU thread of the traces and one per GPU
      stream (kernels, memcpy/memset, GPU annotations);
    * ``ts`` is microseconds since the earliest event (``otherData.origin_utc``).

    ``categories``: the PyTorch profiler ``trace_events.category`` values taken (default:
    GPU work and user annotations; add ``cpu_op``, ``cuda_runtime``, ... for everything);
    the events of other traces (Ray timeline tasks) are always taken.
    Lines without a timestamp cannot be placed and are counted in the summary.
    """
    out_path = str(path)
    summary = ChromeTraceSummary(path=out_path)
    events_sql, summary.phase_source = _event_sql(con, categories, log_levels)
    # temp tables on the caller's connection itself, not on a cursor: the phase rules a
    # read-only Run attaches are temp tables, visible to their own connection only
    tmp = out_path + ".tmp"
    try:
        if "error_lines" in _relations(con):
            levels = ", ".join(_sql_string(lv) for lv in log_levels) or "NULL"
            summary.unplaced_log_lines = int(con.execute(
                f"SELECT count(*) FROM error_lines WHERE ts IS NULL AND level IN ({levels})").fetchall()[0][0])
        _pid_rank_table(con)
        _offsets_table(con)
        if events_sql:
            con.execute(f"CREATE OR REPLACE TEMP TABLE _ct_raw AS {events_sql}")
        else:
            con.execute(
                "CREATE OR REPLACE TEMP TABLE _ct_raw (proc_key VARCHAR, proc_group INTEGER, proc_rank INTEGER, "
                "node VARCHAR, role VARCHAR, thread_key VARCHAR, thread_sort INTEGER, kind VARCHAR, ph VARCHAR, "
                "cat VARCHAR, name VARCHAR, base_us BIGINT, frac_us DOUBLE, dur_us DOUBLE, args JSON)")
        # time zero: about the earliest event (`ref`, whole microseconds); `rel_us`, the time
        # since then, stays small enough for sub-microsecond steps
        con.execute("""
            CREATE OR REPLACE TEMP TABLE _ct_events AS
            WITH ref AS (SELECT floor(min(base_us::DOUBLE + frac_us))::BIGINT AS ref_us FROM _ct_raw)
            SELECT r.*, (r.base_us - ref.ref_us)::DOUBLE + r.frac_us AS rel_us, ref.ref_us
            FROM _ct_raw r, ref WHERE r.base_us IS NOT NULL""")
        origin = con.execute(
            "SELECT min(ref_us) + floor(min(rel_us))::BIGINT, min(rel_us) FROM _ct_events").fetchall()[0]
        zero = float(origin[1]) if origin[1] is not None else 0.0
        if origin[0] is not None:
            summary.origin_utc = con.execute(
                "SELECT strftime(make_timestamp(?::BIGINT), '%Y-%m-%dT%H:%M:%S.%fZ')", [int(origin[0])]).fetchall()[0][0]
        con.execute("""
            CREATE OR REPLACE TEMP TABLE _ct_procs AS
            SELECT e.proc_key,
                   row_number() OVER (ORDER BY e.proc_group, e.proc_rank NULLS LAST, e.proc_key)::INTEGER AS pid,
                   -- a rank's process: node, rank, role; the others' keys already name their node
                   CASE WHEN e.proc_rank IS NOT NULL
                        THEN concat_ws(' ', coalesce(e.node, h.node), e.proc_key, coalesce(e.role, h.role))
                        ELSE concat_ws(' ', e.proc_key, e.role) END AS name
            FROM (SELECT proc_key, proc_group, proc_rank, mode(node) AS node, mode(role) AS role
                  FROM _ct_events GROUP BY ALL) e
            LEFT JOIN _ct_rank_hints h ON h.rank = e.proc_rank""")
        con.execute("""
            CREATE OR REPLACE TEMP TABLE _ct_threads AS
            SELECT proc_key, thread_key,
                   row_number() OVER (PARTITION BY proc_key ORDER BY thread_sort, thread_key)::INTEGER AS tid
            FROM (SELECT DISTINCT proc_key, thread_key, thread_sort FROM _ct_events)""")
        summary.processes = [r[0] for r in con.execute("SELECT name FROM _ct_procs ORDER BY pid").fetchall()]
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write('{"displayTimeUnit": "ms",\n"traceEvents": [\n')
            first = True
            meta = 0
            for query in _METADATA_QUERIES:
                n, first = _write_batches(fh, con.execute(query), first)
                meta += n
            summary.by_kind["metadata"] = meta
            kinds = [r[0] for r in con.execute("SELECT DISTINCT kind FROM _ct_events ORDER BY 1").fetchall()]
            for kind in kinds:
                con.execute(
                    """
                    SELECT CASE WHEN e.ph = 'X'
                        THEN to_json({'name': e.name, 'cat': e.cat, 'ph': 'X', 'ts': round(e.rel_us - ?, 3),
                                      'dur': round(greatest(e.dur_us, 0), 3), 'pid': p.pid, 'tid': t.tid, 'args': e.args})
                        ELSE to_json({'name': e.name, 'cat': e.cat, 'ph': 'i', 's': 't', 'ts': round(e.rel_us - ?, 3),
                                      'pid': p.pid, 'tid': t.tid, 'args': e.args}) END
                    FROM _ct_events e
                    JOIN _ct_procs p USING (proc_key)
                    JOIN _ct_threads t USING (proc_key, thread_key)
                    WHERE e.kind = ?
                    ORDER BY e.rel_us
                    """,
                    [zero, zero, kind],
                )
                n, first = _write_batches(fh, con, first)
                summary.by_kind[kind] = n
            other = {"generator": "forensics", "origin_utc": summary.origin_utc, "phase_source": summary.phase_source}
            fh.write("\n],\n\"otherData\": " + json.dumps(other) + "}\n")
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):  # failed half-way: leave no partial file behind
            os.unlink(tmp)
        for t in ("_ct_raw", "_ct_events", "_ct_procs", "_ct_threads", "_ct_pid_rank", "_ct_rank_hints", "_ct_offsets"):
            con.execute(f"DROP TABLE IF EXISTS {t}")
    summary.events = sum(summary.by_kind.values())
    return summary
