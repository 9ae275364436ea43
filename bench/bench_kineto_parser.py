"""The PyTorch profiler trace parser alone (parsers/kineto.py), without the store.

    python bench/bench_kineto_parser.py                  # real traces + a 1 GB built trace
    python bench/bench_kineto_parser.py --big-gb 2 --keep
    python bench/bench_kineto_parser.py --no-big --threads 2

Each trace is parsed in a fresh subprocess pinned to one core (``--threads`` polars
threads, 1 by default: the ingest runs one parser per core), consuming every frame
``parse_trace`` yields. Printed per trace: seconds of the parse, MB/s of decompressed
trace JSON and k events/s on them, the CPU seconds of the process and MB/s on those
(steadier than wall time on a busy machine), the peak RSS of the process (``VmHWM``:
``ru_maxrss`` would count the benchmark's own memory, which Linux carries across the
fork and exec of the child) and its RSS after the imports, and the 1-minute load average before the
run. ``--code DIR`` imports ``parsers/`` from another checkout, to compare two versions
in the same conditions. The built trace repeats the
events of a real trace (``bench/data/kineto-parser/``, removed unless ``--keep``) and
is parsed uncompressed and, with ``--big-gz``, gzipped.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from bench_traces import build_big  # noqa: E402  (the same built trace as the ingest benchmark)

# Run in the child: parse one trace, print one JSON line.
CHILD = r"""
import json, os, sys, time
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
sys.path.insert(0, sys.argv[2])
import gzip
from forensics.parsers import kineto
from forensics.parsers.base import FileContext

def status_mb(key):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) / 1024

path = sys.argv[1]
base = status_mb("VmRSS:")
ctx = FileContext(file_id=1, path=os.path.basename(path), size=os.path.getsize(path), fmt="kineto_trace")
t0 = time.perf_counter(); c0 = time.process_time()
events = parts = 0
with open(path, "rb") as raw:
    stream = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
    for table, frame in kineto.parse_trace(stream, ctx):
        if table == "trace_events":
            events += frame.num_rows if hasattr(frame, "num_rows") else frame.height
            parts += 1
        else:
            meta = frame.to_pylist()[0] if hasattr(frame, "to_pylist") else frame.to_dicts()[0]
t1 = time.perf_counter(); c1 = time.process_time()
print(json.dumps({"seconds": t1 - t0, "cpu": c1 - c0, "events": events, "parts": parts,
                  "event_count": meta["event_count"], "truncated": meta["truncated"],
                  "problems": [p.message for p in ctx.problems],
                  "peak_mb": status_mb("VmHWM:"), "base_mb": base}))
"""


def json_size(path: Path) -> int:
    """Decompressed bytes of a trace."""
    if path.suffix != ".gz":
        return path.stat().st_size
    n = 0
    with gzip.open(path, "rb") as fh:
        while block := fh.read(1 << 24):
            n += len(block)
    return n


def run(path: Path, threads: int, code: Path) -> dict:
    env = {**os.environ, "POLARS_MAX_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), str(code)], capture_output=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"parsing {path} failed:\n{proc.stderr.decode()[-3000:]}")
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


def report(name: str, path: Path, threads: int, code: Path, expected: int | None = None) -> None:
    size = json_size(path)
    load = os.getloadavg()[0]
    r = run(path, threads, code)
    ok = "" if expected is None or expected == r["events"] == r["event_count"] else f"  EVENT COUNT {r['events']} != {expected}"
    if r["problems"]:
        ok += f"  problems: {r['problems'][:2]}"
    print(f"  [load avg {load:4.2f}] {name:48s} {size / 1e6:8.1f} MB  {r['events'] / 1e3:7.0f}k ev  "
          f"{r['seconds']:6.2f} s  {size / 1e6 / r['seconds']:6.1f} MB/s  {r['events'] / 1e3 / r['seconds']:4.0f} k ev/s  "
          f"(on CPU {r['cpu']:6.2f} s: {size / 1e6 / r['cpu']:6.1f} MB/s)  peak RSS {r['peak_mb']:6.0f} MB "
          f"(after imports {r['base_mb']:4.0f}){ok}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=ROOT.parent / "shared" / "corpus")
    ap.add_argument("--big-gb", type=float, default=1.0)
    ap.add_argument("--no-big", action="store_true")
    ap.add_argument("--big-gz", action="store_true", help="also parse a gzipped copy of the built trace")
    ap.add_argument("--threads", type=int, default=1, help="POLARS_MAX_THREADS of the parser")
    ap.add_argument("--keep", action="store_true", help="keep the built trace")
    ap.add_argument("--code", type=Path, default=ROOT,
                    help="import parsers/ from this folder (e.g. a `git worktree` of another commit, to compare)")
    args = ap.parse_args()

    traces = sorted(args.corpus.glob("real/*/profiler/*.pt.trace.json*"))
    print(f"parser alone ({args.code}), {args.threads} polars thread(s), one core; {os.cpu_count()} cores on the machine")
    for path in traces:
        report(f"{path.parent.parent.name}/{path.name}", path, args.threads, args.code)
    if args.no_big or not traces:
        return
    work = ROOT / "bench" / "data" / "kineto-parser"
    work.mkdir(parents=True, exist_ok=True)
    try:
        big = work / "rank0.big.pt.trace.json"
        _, events = build_big(traces[0], big, int(args.big_gb * 1e9))
        report(f"built {big.name}", big, args.threads, args.code, events)
        if args.big_gz:
            packed = work / "rank0.big.pt.trace.json.gz"
            with open(big, "rb") as src, gzip.open(packed, "wb", compresslevel=1) as dst:
                shutil.copyfileobj(src, dst, 1 << 24)
            report(f"built {packed.name}", packed, args.threads, args.code, events)
    finally:
        if not args.keep:
            shutil.rmtree(work)


if __name__ == "__main__":
    main()
