"""Prototype, not used by forensics: load Kineto traces with DuckDB's own JSON reader.

    python bench/proto_trace_duckdb_json.py [--corpus ../shared/corpus] [--threads 2] [--check]

bench/README.md ("where 5x would have to come from") names DuckDB's JSON reader as the
road to 5x HTA on trace ingest. This script measures that road end to end on the real
traces of each ``<corpus>/real/*/profiler/`` folder, in a subprocess whose wall time and
peak RSS it samples the way bench_traces.py does:

1. each trace's event array is copied (decompressed) to a file of its own; the line of
   every event's ``{`` comes from the same pass (Kineto puts each opening brace on a
   line ``  {`` of its own; NumPy over the bytes);
2. one thread per trace, each with one DuckDB thread, runs ``INSERT INTO trace_events
   SELECT ... FROM read_json(<array>, format='array') POSITIONAL JOIN <line numbers>``
   into a fresh database file with the real schema. The same columns as
   parsers/kineto.py are derived: category, wall clock, device/stream, the args fields
   (one ``json_transform`` per event);
3. a checkpoint.

It checks that the rows equal the events of each file. ``--check`` also ingests the
folder with ``forensics ingest`` and counts the rows that differ, with ``args`` compared
as JSON values (DuckDB stores it minified, the parser as written).

It covers only well-formed Kineto traces. A product version would send truncated,
malformed or mistyped traces to the present parser. It would also have to keep the
line numbers on disk to stay bounded on multi-GB traces (here they are an array in
memory).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

INNER = r'''
import gzip, json, os, re, sys, threading, time
t0 = time.perf_counter()
import duckdb, numpy as np, pyarrow as pa
sys.path.insert(0, sys.argv[1])
from forensics.store import ddl
from parsers.kineto import TRACE_EVENTS, GPU_CATEGORIES, rank_from_name
t_import = time.perf_counter() - t0

ARGS_STRUCT = json.dumps({"External id": "BIGINT", "correlation": "BIGINT", "device": "INTEGER",
                          "stream": "BIGINT", "Collective name": "VARCHAR", "In msg nelems": "BIGINT",
                          "Out msg nelems": "BIGINT", "dtype": "VARCHAR", "Group size": "INTEGER",
                          "Process Group Name": "VARCHAR", "Process Group Description": "VARCHAR"})
KEY = re.compile(rb'"traceEvents"\s*:\s*\[')


def spool(src, dst):
    """Copy the event array of trace ``src`` to ``dst``; (events, line numbers, header).
    Kineto writes every event's opening brace on a line of its own, ``  {``: the event
    starts are those lines (the count is checked against the rows DuckDB reads)."""
    opener = gzip.open if src.endswith(".gz") else open
    starts = []
    with opener(src, "rb") as fh, open(dst, "wb") as out:
        head = fh.read(1 << 20)
        m = KEY.search(head)
        meta = head[: m.start()]
        line = 1 + head.count(b"\n", 0, m.end() - 1)  # the line of data[0] (the `[`)
        data = head[m.end() - 1:]
        tail = b""
        while True:
            nxt = fh.read(8 << 20)
            if not nxt:  # cut after the array's closing bracket
                cut = data.rfind(b'"traceName"')
                end = data.rfind(b"]", 0, cut if cut >= 0 else len(data))
                tail, data = data[end + 1:], data[: end + 1]
            view = np.frombuffer(data, dtype=np.uint8)
            nl = np.flatnonzero(view == 10)
            # the line after newline i runs to the next newline; the line after the last
            # newline is complete only at the end of the data
            nxt_nl = np.append(nl[1:], len(view)) if not nxt else nl[1:]
            cur = nl[: len(nxt_nl)]
            if len(cur):
                lim = len(view) - 1
                brace = ((nxt_nl - cur == 4) & (view[np.minimum(cur + 1, lim)] == 32)
                         & (view[np.minimum(cur + 2, lim)] == 32) & (view[np.minimum(cur + 3, lim)] == 123))
                starts.append(line + 1 + np.flatnonzero(brace))
            if not nxt:
                out.write(data)
                break
            keep = int(nl[-1]) if len(nl) else len(data)  # carry the last newline and what follows it
            line += max(len(nl) - 1, 0) if len(nl) else 0
            out.write(data[:keep])
            data = data[keep:] + nxt
    lines = np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)
    return len(lines), lines.astype(np.int64), meta, tail


def header_fields(meta):
    text = meta.rstrip().rstrip(b",") + b"}"
    try:
        return json.loads(text[text.index(b"{"):])
    except ValueError:
        return {}


def load(con, file_id, path, spool_path, lines, head):
    info = head.get("distributedInfo") or {}
    rank = info.get("rank") if isinstance(info.get("rank"), int) else rank_from_name(path)
    base = head.get("baseTimeNanoseconds")
    base_us = base / 1000 if isinstance(base, int) else None
    cur = con.cursor()
    cur.execute("SET threads = 1")
    cur.register("_lines", pa.table({"seq": pa.array(np.arange(len(lines), dtype=np.int64)), "line_no": pa.array(lines)}))
    gpu = ", ".join(f"'{c}'" for c in GPU_CATEGORIES)
    wall = f"ts + {base_us}" if base_us is not None else "ts"
    lo = "0" if base_us is not None else "1e15"
    text = ("CASE WHEN json_type({c}) = 'VARCHAR' THEN {c} ->> '$' ELSE CAST({c} AS VARCHAR) END")
    cur.execute(f"""
        INSERT INTO trace_events
        WITH e AS (
            SELECT * FROM read_json('{spool_path}', format = 'array',
                columns = {{ph: 'VARCHAR', cat: 'VARCHAR', name: 'VARCHAR', pid: 'JSON', tid: 'JSON',
                            ts: 'DOUBLE', dur: 'DOUBLE', id: 'BIGINT', args: 'JSON'}})
            POSITIONAL JOIN _lines
        ), d AS (
            SELECT e.*,
                   CASE WHEN e.ph = 'M' THEN 'metadata' WHEN e.cat IS NULL THEN 'uncategorized' ELSE e.cat END AS category,
                   {text.format(c='e.pid')} AS pid_t, {text.format(c='e.tid')} AS tid_t,
                   json_transform(e.args, '{ARGS_STRUCT}') AS a
            FROM e
        )
        SELECT {file_id}::INTEGER, line_no, 'kineto', seq, {rank if rank is not None else 'NULL'}::INTEGER,
               pid_t, tid_t, ph, category, name, ts, dur,
               CASE WHEN {wall} >= {lo} AND {wall} < 9e15 THEN make_timestamp(floor({wall})::BIGINT) END,
               coalesce(a.device, CASE WHEN category IN ({gpu}) THEN TRY_CAST(pid_t AS INTEGER) END),
               coalesce(a.stream, CASE WHEN category IN ({gpu}) THEN TRY_CAST(tid_t AS BIGINT) END),
               coalesce(a.correlation, CASE WHEN category = 'ac2g' THEN id END),
               coalesce(a."External id", CASE WHEN a."External id" IS NULL AND contains(CAST(args AS VARCHAR), '"external id"') THEN TRY_CAST(args ->> 'external id' AS BIGINT) END),
               CAST(args AS VARCHAR),
               a."Collective name", a."In msg nelems", a."Out msg nelems", a.dtype, a."Group size",
               a."Process Group Name", a."Process Group Description", id
        FROM d""")
    cur.close()


def main():
    repo, folder, db, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    traces = sorted(os.path.join(folder, f) for f in os.listdir(folder) if ".json" in f)
    t1 = time.perf_counter()
    con = duckdb.connect(db)
    con.execute("SET memory_limit = '512MB'")
    con.execute(ddl(TRACE_EVENTS))
    work = os.path.dirname(db)
    results = {}

    errors = []
    stages = []  # (spool s, DuckDB insert s) per trace

    def one(i, path):
        try:
            sp = os.path.join(work, f"events-{i}.json")
            a = time.perf_counter()
            n, lines, meta, tail = spool(path, sp)
            b = time.perf_counter()
            load(con, i + 1, path, sp, lines, header_fields(meta))
            stages.append((round(b - a, 2), round(time.perf_counter() - b, 2)))
            os.unlink(sp)
            results[path] = n
        except Exception as exc:  # reported by the main thread
            errors.append(exc)

    if threads > 1:
        ts = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(traces)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    else:
        for i, p in enumerate(traces):
            one(i, p)
    if errors:
        raise errors[0]
    con.execute("CHECKPOINT")
    rows = dict(con.execute("SELECT file_id, count(*) FROM trace_events GROUP BY file_id").fetchall())
    con.close()
    t_end = time.perf_counter()
    print(json.dumps({"import_s": t_import, "load_s": t_end - t1,
                      "rows": sum(rows.values()), "events": sum(results.values()),
                      "stages": stages}))


main()
'''


def differing_rows(folder: Path, proto_db: str, work: str) -> int:
    """Rows of the prototype's database that differ from those of `forensics ingest`
    (matched by rank and position; ``args`` compared as JSON values, not text)."""
    import duckdb

    ref = os.path.join(work, "ref.duckdb")
    for p in (ref, ref + ".wal"):
        if os.path.exists(p):
            os.unlink(p)
    subprocess.run([sys.executable, "-m", "forensics", "ingest", str(folder), "--db", ref, "--quiet"],
                   check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    con = duckdb.connect(proto_db)
    con.execute(f"ATTACH '{ref}' AS ref (READ_ONLY)")
    cols = [c for (c,) in con.execute("SELECT column_name FROM duckdb_columns() WHERE database_name = 'ref' "
                                      "AND table_name = 'trace_events' ORDER BY column_index").fetchall()]
    same = " AND ".join(f"p.{c} IS NOT DISTINCT FROM r.{c}" for c in cols if c not in ("file_id", "args"))
    n = con.execute(f"""SELECT count(*) FROM trace_events p FULL JOIN ref.trace_events r ON p.rank = r.rank AND p.seq = r.seq
                        WHERE NOT ({same} AND json(p.args) IS NOT DISTINCT FROM json(r.args))""").fetchone()[0]
    con.close()
    return int(n)


def main() -> None:
    from bench_traces import measure, trace_stats

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=REPO.parent / "shared" / "corpus")
    ap.add_argument("--threads", type=int, default=2, help="traces loaded at once (one DuckDB thread each)")
    ap.add_argument("--check", action="store_true",
                    help="also ingest each folder with forensics and compare every row (args as JSON values)")
    args = ap.parse_args()
    folders = sorted(p for p in (args.corpus / "real").glob("*/profiler") if p.is_dir())
    if not folders:
        raise SystemExit(f"no <corpus>/real/*/profiler folders under {args.corpus}")
    with tempfile.TemporaryDirectory(prefix="proto-json-") as work:
        for folder in folders:
            nbytes, events = trace_stats(folder)
            db = os.path.join(work, "p.duckdb")
            for p in (db, db + ".wal"):
                if os.path.exists(p):
                    os.unlink(p)
            wall, tree, single, proc = measure([sys.executable, "-c", INNER, str(REPO), str(folder), db, str(args.threads)])
            if proc.returncode != 0:
                print(proc.stderr.decode()[-3000:])
                raise SystemExit("prototype failed")
            out = json.loads(proc.stdout)
            ok = "counts OK" if out["rows"] == out["events"] == events else f"COUNT MISMATCH (expected {events})"
            if args.check:
                print(f"  rows that differ from forensics ingest: {differing_rows(folder, db, work)}")
            print(f"[load avg {os.getloadavg()[0]:4.1f}] {folder.relative_to(args.corpus)}: wall {wall:.2f} s, "
                  f"load {out['load_s']:.2f} s ({nbytes / 1e6 / out['load_s']:.1f} MB/s), imports {out['import_s']:.2f} s, "
                  f"peak RSS tree {tree / 2**20:.0f} MiB, largest process {single / 2**20:.0f} MiB; "
                  f"{out['rows']:,} rows ({ok}); per trace (spool s, insert s): {out['stages']}")


if __name__ == "__main__":
    main()
