"""Benchmark: where the headline diagnosis of a database spends its CPU (issue 18).

    python bench/bench_headline.py bench/data/text-XXXX.duckdb [--full] [--threads N]

Runs the diagnosis ``forensics ingest`` prints at its end (``performance=False``; with
--full, ``forensics diagnose``'s, performance findings included) on a database kept by
``bench_ingest.py --keep``, in this process, under the diagnosis' DuckDB memory limit, and
prints the CPU seconds of the whole diagnosis and of each of its stages (CPU of every thread
of the process: DuckDB's threads count), the wall time, the load average before and after,
and the headline itself. Each stage is timed by wrapping the stage functions that
``forensics.diagnosis`` calls, so the figures add up to the whole but for the glue
between them ("other").
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# (module, functions): the stages of forensics.diagnosis._stages
STAGES = (
    ("matching", ("line_hits", "event_hits", "drop_survived")),
    ("placement", ("attach_task_pids", "attach_bodies", "place")),
    ("times", ("attach_ts_hi",)),
    ("selection", ("resolve_classes", "choose")),
    ("explain", ("line_findings",)),
    ("incident", ("build", "alternatives")),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("db", help="a database (e.g. kept by bench_ingest.py --keep)")
    ap.add_argument("--full", action="store_true", help="the whole diagnosis, performance findings included")
    ap.add_argument("--threads", type=int, default=0, help="DuckDB threads (0: its default)")
    args = ap.parse_args()
    if not Path(args.db).is_file():
        print(f"no database at {args.db}", file=sys.stderr)
        return 2

    import duckdb

    from forensics import detectors
    from forensics import diagnosis as dg
    from forensics.database import DB_MEMORY, memory_limit
    from forensics.diagnosis import explain, incident, matching, placement, selection, times

    spent: dict[str, float] = {}

    def timed(label: str, fn):
        @functools.wraps(fn)
        def run(*a, **k):
            t0 = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.process_time() - t0
        return run

    modules = {"matching": matching, "placement": placement, "times": times, "selection": selection,
               "explain": explain, "incident": incident}
    for name, fns in STAGES:
        for fn in fns:
            setattr(modules[name], fn, timed(f"{name}.{fn}", getattr(modules[name], fn)))
    detectors.run = timed("detectors.run", detectors.run)
    facts_cls = dg.RunFacts

    class TimedFacts(facts_cls):
        def __init__(self, *a, **k):
            t0 = time.process_time()
            super().__init__(*a, **k)
            spent["RunFacts"] = spent.get("RunFacts", 0.0) + time.process_time() - t0

    dg.RunFacts = TimedFacts

    con = duckdb.connect(args.db, read_only=True)
    if args.threads:
        con.execute(f"SET threads = {int(args.threads)}")
    load0 = os.getloadavg()[0]
    t0, w0 = time.process_time(), time.perf_counter()
    with memory_limit(con, DB_MEMORY):
        result = dg.diagnose(con=con, performance=args.full)
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    con.close()
    headline = result.headline() if hasattr(result, "headline") else str(result)
    print(f"{args.db}: {'full diagnosis' if args.full else 'headline diagnosis'}, load {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"  whole            {cpu:7.2f} CPU s   {wall:7.2f} s wall")
    for label, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {label:28s} {s:7.2f}")
    print(f"  {'other':28s} {cpu - sum(spent.values()):7.2f}")
    print(f"  headline: {headline[:160]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
