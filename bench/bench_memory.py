"""Benchmark: peak memory and time of `forensics ingest` on a large mixed folder.

    python bench/bench_memory.py [--size-gb 5] [--corpus ../shared/corpus] [--workers 0]
                                 [--trace-share 0.2] [--big-share 0.2] [--keep]

Builds a folder of about --size-gb GB under bench/data/ (git-ignored; removed afterwards
unless --keep) from the labelled corpus:

* many small and medium text logs: the corpus's text files replicated, each copy with
  shifted timestamps and other pids and host names (as bench/bench_ingest.py does);
* a few big text logs (up to 1 GiB each, --big-share of the bytes), made of such copies
  end to end: a driver log of a long run;
* PyTorch profiler traces (--trace-share of the bytes): copies of the corpus's
  ``real/*/profiler/*.json.gz`` under other rank numbers;

then, each in a subprocess, the ingest (``forensics.pipeline.ingest``, what
``forensics ingest`` runs before its one-line diagnosis) and the diagnosis
(``forensics diagnose``, which ``forensics ingest`` also runs for its headline), and
prints for each the wall time, MB/s, peak RSS of the process tree (the largest sum over
its processes, sampled every 50 ms with psutil; shared pages count once per process, so
it overstates) and of its largest process; then the database size and whether the line
accounting holds (rows in `lines` == `files.lines` == physical lines). The point: the
peak must not grow with the size of the folder or of its biggest file.
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
from bench_ingest import REPO, _count_lines, text_sources, vary  # noqa: E402
from bench_traces import measure  # noqa: E402

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
            out = folder / f"replica{k:04d}" / "profiler" / f"rank{k * len(traces) + traces.index(src)}.{k}.pt.trace.json.gz"
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, out)
            made["traces"][0] += 1
            made["traces"][1] += out.stat().st_size
            if made["traces"][1] >= budget_traces:
                break
        k += 1
    big_dir = folder / "big"
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
            out = folder / f"run{k:04d}" / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            body = vary(data, k)
            out.write_bytes(body)
            made["small text"][0] += 1
            made["small text"][1] += len(body)
            if sum(v[1] for v in made.values()) >= target:
                break
        k += 1
    return {part: (n, b) for part, (n, b) in made.items()}


@contextmanager
def scratch(keep: bool):
    """(folder, database) under bench/data/, removed at the end unless ``keep``."""
    folder = Path(tempfile.mkdtemp(prefix="mixed-", dir=REPO / "bench" / "data"))
    db = folder.with_suffix(".duckdb")
    try:
        yield folder, db
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
            for p in (db, Path(str(db) + ".wal")):
                p.unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=5.0)
    ap.add_argument("--corpus", type=Path, default=REPO.parent / "shared" / "corpus")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--trace-share", type=float, default=0.2, help="share of the bytes in profiler traces (gzip, on disk)")
    ap.add_argument("--big-share", type=float, default=0.2, help="share of the bytes in big text logs (up to 1 GiB each)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    (REPO / "bench" / "data").mkdir(parents=True, exist_ok=True)
    with scratch(args.keep) as (folder, db):
        t0 = time.perf_counter()
        made = build(folder, args.corpus, int(args.size_gb * 2**30), args.trace_share, args.big_share)
        total = sum(b for _, b in made.values())
        parts = ", ".join(f"{part} {n} file(s) {b / 2**20:,.0f} MiB" for part, (n, b) in made.items())
        print(f"built {total / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s: {parts} ({folder})")
        print(f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB memory, "
              f"load average {os.getloadavg()[0]:.1f}")
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
              f"{len(report['messages'])} message(s)")
        print(f"database {db.stat().st_size / 2**20:,.0f} MiB")
        wall, peak_tree, peak_one, proc = measure([sys.executable, "-m", "forensics", "diagnose", "--db", str(db), "--json"])
        print(f"forensics diagnose: {wall:.1f} s wall, exit {proc.returncode}; peak RSS {peak_tree / 2**20:,.0f} MiB process tree, "
              f"{peak_one / 2**20:,.0f} MiB largest process")


if __name__ == "__main__":
    main()
