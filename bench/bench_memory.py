"""Benchmark: peak memory and time of `forensics ingest`, `diagnose` and `report` on large mixed folders.

    python bench/bench_memory.py [--size-gb 5] [--corpus ../shared/corpus] [--workers 0]
                                 [--trace-share 0.2] [--big-share 0.2] [--keep]
    python bench/bench_memory.py --size-gb 1 2 --keep     # two folders, one table
    python bench/bench_memory.py --db bench/data/mixed-1g.duckdb bench/data/mixed-2g.duckdb
                                  # again on databases kept before: no build, no ingest

Builds, for each --size-gb, a folder of about that many GB under bench/data/ (git-ignored;
removed afterwards unless --keep, which keeps the folder and its database as
bench/data/mixed-<size>g[.duckdb]) from the labelled corpus, all of it parts of one run
(``node_NNNN`` folders, as bench/bench_ingest.py builds: one big run, one diagnosis
headline, the case the limits are about):

* many small and medium text logs: the corpus's text files replicated, each copy with
  shifted timestamps and other pids and host names (as bench/bench_ingest.py does);
* a few big text logs (up to 1 GiB each, --big-share of the bytes), made of such copies
  end to end: a driver log of a long run;
* PyTorch profiler traces (--trace-share of the bytes): copies of the corpus's
  ``real/*/profiler/*.json.gz`` under other rank numbers;

then, each in a subprocess, the ingest (``forensics.pipeline.ingest``, what
``forensics ingest`` runs before its one-line diagnosis), the diagnosis (``forensics
diagnose --json``, which ``forensics ingest`` also runs for its headline) and the HTML
report (``forensics report``), and prints for each the wall time, MB/s, peak RSS of the
process tree (the largest sum over its processes, sampled every 50 ms with psutil; shared
pages count once per process, so it overstates) and of its largest process; then the
database size and whether the line accounting holds (rows in `lines` == `files.lines` ==
physical lines). At the end, a table of all sizes: database size, ingest time, diagnose
and report peak RSS (process tree) and time, and whether both peaks are within --limit-mb
(default 1024). The point: the peaks must not grow with the size of the folder, of its
biggest file or of the database.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import duckdb
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ingest  # noqa: E402
from bench_ingest import REPO, _count_lines, text_sources, vary  # noqa: E402

BIG_FILE = 1 << 30
INGEST = """
import json, sys
from forensics import pipeline
s = pipeline.ingest([sys.argv[1]], sys.argv[2], workers=int(sys.argv[3]) or None)
print(json.dumps({"seconds": s.seconds, "files_loaded": s.files_loaded, "messages": s.messages}))
"""


def build(folder: Path, corpus: Path, target: int, trace_share: float, big_share: float) -> dict[str, tuple[int, int]]:
    """Write the folder; returns {part: (files, bytes)}."""
    sources = [(p.relative_to(corpus), p.read_bytes()) for p in text_sources(corpus)]
    traces = sorted(corpus.glob("real/*/profiler/*.json.gz"))
    if not sources:
        raise SystemExit(f"no text files under {corpus}")
    made = {"small text": [0, 0], "big text": [0, 0], "traces": [0, 0]}
    budget_traces = int(target * trace_share) if traces else 0
    budget_big = int(target * big_share)
    k = 0
    while made["traces"][1] < budget_traces:  # traces: copies under new rank numbers
        for src in traces:
            out = folder / f"node_trace{k:04d}" / "profiler" / f"rank{k * len(traces) + traces.index(src)}.{k}.pt.trace.json.gz"
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, out)
            made["traces"][0] += 1
            made["traces"][1] += out.stat().st_size
            if made["traces"][1] >= budget_traces:
                break
        k += 1
    big_dir = folder / "node_driver"
    big_dir.mkdir(parents=True, exist_ok=True)
    k = 0
    while made["big text"][1] < budget_big:  # big logs: varied copies end to end, streamed
        out = big_dir / f"driver{made['big text'][0]}.log"
        made["big text"][0] += 1
        size = 0
        with open(out, "wb") as fh:
            while size < min(BIG_FILE, budget_big - made["big text"][1]):
                for _, data in sources:
                    body = vary(data, k)
                    fh.write(body)
                    size += len(body)
                k += 1
        made["big text"][1] += size
    k = 0
    while sum(v[1] for v in made.values()) < target:  # small and medium logs
        for rel, data in sources:
            # node_NNNN: parts of one run (forensics.runs); runNNNN would make each
            # copy of a corpus bundle a run of its own, thousands of headlines
            out = folder / f"node_{k:04d}" / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            body = vary(data, k)
            out.write_bytes(body)
            made["small text"][0] += 1
            made["small text"][1] += len(body)
            if sum(v[1] for v in made.values()) >= target:
                break
        k += 1
    return {part: (n, b) for part, (n, b) in made.items()}


def measure(cmd: list[str]) -> tuple[float, int, int, "subprocess.CompletedProcess"]:
    """Wall time, peak RSS of the process tree and of its largest process (output to files)."""
    wall, peak_tree, proc = bench_ingest.run_measured(cmd)
    return wall, peak_tree, bench_ingest.LARGEST[0], proc


@contextmanager
def scratch(keep: bool, size_gb: float):
    """(folder, database) under bench/data/: kept as mixed-<size>g[.duckdb] with ``keep``,
    else a temporary name removed at the end."""
    data = REPO / "bench" / "data"
    if keep:
        folder = data / f"mixed-{size_gb:g}g"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
    else:
        folder = Path(tempfile.mkdtemp(prefix="mixed-", dir=data))
    db = folder.with_suffix(".duckdb")
    for p in (db, Path(str(db) + ".wal")):
        p.unlink(missing_ok=True)
    try:
        yield folder, db
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
            for p in (db, Path(str(db) + ".wal")):
                p.unlink(missing_ok=True)


def build_and_ingest(args: argparse.Namespace, size_gb: float, folder: Path, db: Path) -> dict:
    """Build the folder, ingest it, print the figures; returns the row of the table."""
    t0 = time.perf_counter()
    made = build(folder, args.corpus, int(size_gb * 2**30), args.trace_share, args.big_share)
    total = sum(b for _, b in made.values())
    parts = ", ".join(f"{part} {n} file(s) {b / 2**20:,.0f} MiB" for part, (n, b) in made.items())
    print(f"built {total / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s: {parts} ({folder})", flush=True)
    wall, peak_tree, peak_one, proc = measure([sys.executable, "-c", INGEST, str(folder), str(db), str(args.workers)])
    if proc.returncode != 0:
        print(proc.stderr.decode()[-3000:])
        raise SystemExit("ingest failed")
    report = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    con = duckdb.connect(str(db), read_only=True)
    lines_db, files_lines = con.execute(
        "SELECT (SELECT count(*) FROM lines), (SELECT sum(lines) FROM files WHERE kind = 'text')").fetchone()
    events = con.execute("SELECT count(*) FROM trace_events").fetchone()[0]
    con.close()
    physical = sum(_count_lines(p) for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".gz"))
    print(f"forensics ingest: {wall:.1f} s wall ({report['seconds']:.1f} s ingest), {total / 1e6 / wall:.1f} MB/s on disk; "
          f"peak RSS {peak_tree / 2**20:,.0f} MiB process tree, {peak_one / 2**20:,.0f} MiB largest process")
    print(f"{report['files_loaded']:,} files, {lines_db:,} rows in lines, {events:,} trace events; files.lines {files_lines:,}, "
          f"physical lines {physical:,} ({'accounting OK' if lines_db == files_lines == physical else 'ACCOUNTING MISMATCH'}); "
          f"{len(report['messages'])} message(s)", flush=True)
    return {"size": f"{total / 2**30:.2f} GiB", "ingest_s": wall}


def read_side(db: Path, row: dict, html_dir: Path) -> dict:
    """Measure ``forensics diagnose --json`` and ``forensics report`` of ``db``; fills ``row``."""
    row["db_mib"] = db.stat().st_size / 2**20
    print(f"database {db} {row['db_mib']:,.0f} MiB", flush=True)
    html = html_dir / (db.stem + "-report.html")
    for name, cmd in (("diagnose", ["diagnose", "--db", str(db), "--json"]),
                      ("report", ["report", "--db", str(db), "-o", str(html)])):
        wall, peak_tree, peak_one, proc = measure([sys.executable, "-m", "forensics", *cmd])
        extra = ""
        if name == "diagnose" and proc.returncode == 0:
            d = json.loads(proc.stdout.decode())
            extra = f"; verdict {d.get('verdict') or d.get('status')}, {len(json.dumps(d)) / 1e3:,.0f} kB of JSON"
        elif name == "report" and proc.returncode == 0:
            extra = f"; {html.stat().st_size / 2**20:,.1f} MiB of HTML"
            html.unlink()
        print(f"forensics {name}: {wall:.1f} s wall, exit {proc.returncode}; peak RSS {peak_tree / 2**20:,.0f} MiB process tree, "
              f"{peak_one / 2**20:,.0f} MiB largest process{extra}", flush=True)
        if proc.returncode != 0:
            print(proc.stderr.decode()[-3000:])
        row[name] = (peak_tree, wall, proc.returncode)
    return row


def table(rows: list[dict], limit_mb: int) -> None:
    print(f"\n{'size':>10} {'DB MiB':>8} {'ingest s':>9} {'diagnose MiB':>13} {'diag s':>7} {'report MiB':>11} {'report s':>9}  <= {limit_mb} MiB")
    for r in rows:
        (dp, dw, drc), (rp, rw, rrc) = r["diagnose"], r["report"]
        ok = dp <= limit_mb * 2**20 and rp <= limit_mb * 2**20 and drc == 0 and rrc == 0
        ingest = f"{r['ingest_s']:.0f}" if r.get("ingest_s") is not None else "kept"
        print(f"{r['size']:>10} {r['db_mib']:>8,.0f} {ingest:>9} {dp / 2**20:>13,.0f} {dw:>7.1f} {rp / 2**20:>11,.0f} {rw:>9.1f}  "
              f"{'pass' if ok else 'FAIL'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, nargs="+", default=[5.0])
    ap.add_argument("--db", type=Path, nargs="+", help="databases kept before (--keep): measure diagnose and report only")
    ap.add_argument("--corpus", type=Path, default=REPO.parent / "shared" / "corpus")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--trace-share", type=float, default=0.2, help="share of the bytes in profiler traces (gzip, on disk)")
    ap.add_argument("--big-share", type=float, default=0.2, help="share of the bytes in big text logs (up to 1 GiB each)")
    ap.add_argument("--limit-mb", type=int, default=1024, help="peak RSS that diagnose and report must stay within")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    data = REPO / "bench" / "data"
    data.mkdir(parents=True, exist_ok=True)
    print(f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB memory, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; FORENSICS_DB_MEMORY "
          f"{os.environ.get('FORENSICS_DB_MEMORY', '(default)')}", flush=True)
    rows = []
    if args.db:
        for db in args.db:
            rows.append(read_side(db, {"size": db.stem[-10:], "ingest_s": None}, data))
    else:
        for size in args.size_gb:
            with scratch(args.keep, size) as (folder, db):
                row = build_and_ingest(args, size, folder, db)
                rows.append(read_side(db, row, data))
    table(rows, args.limit_mb)
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
