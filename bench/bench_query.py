"""Benchmark: peak memory and time of `forensics query` printing a big result.

    python bench/bench_query.py [--lines 1200000] [--corpus ../shared/corpus] [--materialised] [--keep]

Builds a database of at least --lines rows in `lines` under bench/data/ (git-ignored;
removed afterwards unless --keep): the corpus's text bundles (``real/*``, ``cases/*``) are
ingested once, then their rows are repeated (each copy under other line numbers) until
there are enough. Then, each in a subprocess with its output going to a file,
``forensics query "SELECT * FROM lines" -f json``, ``-f ndjson`` and ``-f csv``, and prints
for each the wall time, the output size and the peak RSS (sampled every 50 ms with
psutil), with the load average beside them (the machine may be shared).
``--materialised`` also measures the way the command worked before it streamed (the whole
result as a polars DataFrame, then ``json.dumps`` of its rows), for comparison.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import REPO, scratch  # noqa: E402

SQL = "SELECT * FROM lines"
MATERIALISED = """
import json, math, sys
from forensics import api
df = api.query(sys.argv[1], sys.argv[2])
rows = [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()} for r in df.to_dicts()]
sys.stdout.write(json.dumps(rows, default=str, indent=1, allow_nan=False) + "\\n")
"""


def measure(cmd: list[str], out_path: Path) -> tuple[float, int, int]:
    """Wall seconds, peak RSS of the process (bytes) and its exit status; stdout to ``out_path``."""
    t0 = time.perf_counter()
    with open(out_path, "wb") as out:
        proc = psutil.Popen(cmd, stdout=out, stderr=subprocess.PIPE)
        peak = 0
        while proc.poll() is None:
            try:
                peak = max(peak, proc.memory_info().rss)
            except psutil.Error:  # it ended between poll and the reading
                pass
            time.sleep(0.05)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.returncode != 0:
        print(err[-2000:])
    return time.perf_counter() - t0, peak, proc.returncode


def build(db: Path, corpus: Path, want: int) -> int:
    """Ingest the corpus's bundles into ``db`` and repeat the rows of `lines` up to ``want``."""
    from forensics import api

    bundles = sorted(p for part in ("real", "cases") for p in (corpus / part).glob("*") if p.is_dir())
    if not bundles:
        raise SystemExit(f"no corpus bundles under {corpus}")
    api.ingest([str(p) for p in bundles], db=str(db), exclude=["label.json", "*.json.gz", "*.json"]).close()
    con = duckdb.connect(str(db))
    con.execute("SET enable_progress_bar = false")
    have, top = con.execute("SELECT count(*), max(line_no) FROM lines").fetchone()
    copies = max(0, -(-want // max(have, 1)) - 1)
    if copies:
        # the stored columns only: message is a generated column over the hidden _message
        stored = [c for (c,) in con.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'lines' "
            "AND is_generated = 'NEVER' ORDER BY ordinal_position").fetchall()]
        names = ", ".join(f'"{c}"' for c in stored)
        values = ", ".join(f"l.line_no + r.k * {int(top) + 1}" if c == "line_no" else f'l."{c}"' for c in stored)
        con.execute(f"""INSERT INTO lines ({names}) SELECT {values}
                        FROM lines l, range(1, {copies + 1}) r(k)""")
    (n,) = con.execute("SELECT count(*) FROM lines").fetchone()
    con.close()
    return int(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=1_200_000)
    ap.add_argument("--corpus", type=Path, default=REPO.parent / "shared" / "corpus")
    ap.add_argument("--materialised", action="store_true", help="also measure the materialising way, for comparison")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    (REPO / "bench" / "data").mkdir(parents=True, exist_ok=True)
    with scratch(args.keep) as (work, db):
        work.mkdir(exist_ok=True)
        t0 = time.perf_counter()
        n = build(db, args.corpus, args.lines)
        print(f"built {db} in {time.perf_counter() - t0:.0f} s: {n:,} rows in lines, {db.stat().st_size / 2**20:,.0f} MiB")
        print(f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB memory")
        runs = [(f"-f {fmt}", [sys.executable, "-m", "forensics", "query", SQL, "--db", str(db), "-f", fmt])
                for fmt in ("json", "ndjson", "csv")]
        if args.materialised:
            runs.append(("materialised json (before)", [sys.executable, "-c", MATERIALISED, str(db), SQL]))
        for name, cmd in runs:
            out = work / "out"
            wall, peak, rc = measure(cmd, out)
            size = out.stat().st_size
            out.unlink()
            print(f"forensics query {name}: {wall:.1f} s, exit {rc}, {size / 2**20:,.0f} MiB written, "
                  f"peak RSS {peak / 2**20:,.0f} MiB (load average {os.getloadavg()[0]:.1f})", flush=True)
        if args.keep:
            print(f"kept {db}")

if __name__ == "__main__":
    main()
