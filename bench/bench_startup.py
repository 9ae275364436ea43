"""Benchmark: start-up time of the command line (issue 18, target "Startup").

    python bench/bench_startup.py [-n 5] [--target 0.5] [--forensics PATH]

Ingests sample_logs/ into a small database in a temporary folder, then runs each of
``forensics --help``, ``forensics --version``, ``forensics diagnose --help`` and
``forensics diagnose --db <small db>`` N times, each in a subprocess of its own, and prints
per command the median and the fastest wall time, the target (0.5 s) and whether the
median meets it, with the load average before and after (the machine may be shared: a
busy machine makes every figure longer). Exit status 0 when every command meets the
target, 1 otherwise.

The command is the ``forensics`` script next to this Python (a venv's bin/), or --forensics.
Python compiles the project's modules on each start when it may not write their bytecode
(PYTHONDONTWRITEBYTECODE, a read-only checkout): the script says whether that is so, since
it adds a few tenths of a second to a command that loads the API.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "sample_logs"


def wall(cmd: list[str]) -> float:
    """Seconds from start to exit of ``cmd``; its output is thrown away; a failure is an error."""
    t0 = time.perf_counter()
    res = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {res.returncode}: {res.stderr[-2000:]}")
    return took


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=5, help="runs per command (default 5)")
    ap.add_argument("--target", type=float, default=0.5, help="seconds a command may take (default 0.5)")
    ap.add_argument("--forensics", default=str(Path(sys.executable).with_name("forensics")),
                    help="the forensics command (default: the one beside this Python)")
    args = ap.parse_args()
    exe = args.forensics
    if not Path(exe).exists():
        raise SystemExit(f"no forensics command at {exe}: install the project (pip install -e .) or give --forensics")
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        db = str(Path(tmp) / "small.duckdb")
        subprocess.run([exe, "ingest", str(SAMPLE), "--db", db, "--quiet"], check=True, stdout=subprocess.DEVNULL)
        commands = {
            "forensics --help": [exe, "--help"],
            "forensics --version": [exe, "--version"],
            "forensics diagnose --help": [exe, "diagnose", "--help"],
            "forensics diagnose --db small.duckdb": [exe, "diagnose", "--db", db],
        }
        print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores; {args.n} runs per command; "
              f"target {args.target:.2f} s (median)")
        print(f"bytecode written: {'no (PYTHONDONTWRITEBYTECODE is set)' if os.environ.get('PYTHONDONTWRITEBYTECODE') else 'yes'}")
        print(f"load average before: {load()}")
        print(f"{'command':<40} {'median s':>9} {'min s':>7}  result")
        ok = True
        for name, cmd in commands.items():
            wall(cmd)  # once unmeasured: the page cache and bytecode, as a user's second call finds them
            times = [wall(cmd) for _ in range(args.n)]
            med = statistics.median(times)
            passed = med < args.target
            ok &= passed
            print(f"{name:<40} {med:>9.3f} {min(times):>7.3f}  {'pass' if passed else 'FAIL'}")
        print(f"load average after: {load()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
