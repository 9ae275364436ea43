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
(PYTHONDONTWRITEBYTECODE, a read-only checkout), which a user's installation does not: the
commands run without that variable (the unmeasured first run writes the bytecode), unless
--as-is keeps the environment as it is. The signature catalogue cache
(FORENSICS_CACHE_DIR) is a folder of the temporary one, filled by the unmeasured run, as a
user's second command finds it.
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


def wall(cmd: list[str], env: dict[str, str]) -> float:
    """Seconds from start to exit of ``cmd``; its output is thrown away; a failure is an error."""
    t0 = time.perf_counter()
    res = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
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
    ap.add_argument("--as-is", action="store_true",
                    help="keep PYTHONDONTWRITEBYTECODE if set (every start then compiles the project's modules)")
    args = ap.parse_args()
    exe = args.forensics
    if not Path(exe).exists():
        raise SystemExit(f"no forensics command at {exe}: install the project (pip install -e .) or give --forensics")
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        env = dict(os.environ, FORENSICS_CACHE_DIR=str(Path(tmp) / "cache"))
        if not args.as_is:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
        db = str(Path(tmp) / "small.duckdb")
        subprocess.run([exe, "ingest", str(SAMPLE), "--db", db, "--quiet"], check=True, stdout=subprocess.DEVNULL, env=env)
        commands = {
            "forensics --help": [exe, "--help"],
            "forensics --version": [exe, "--version"],
            "forensics diagnose --help": [exe, "diagnose", "--help"],
            "forensics diagnose --db small.duckdb": [exe, "diagnose", "--db", db],
        }
        print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores; {args.n} runs per command; "
              f"target {args.target:.2f} s (median)")
        print(f"bytecode written: {'no (PYTHONDONTWRITEBYTECODE is set)' if env.get('PYTHONDONTWRITEBYTECODE') else 'yes'}")
        print(f"load average before: {load()}")
        print(f"{'command':<40} {'median s':>9} {'min s':>7}  result")
        ok = True
        for name, cmd in commands.items():
            wall(cmd, env)  # once unmeasured: page cache, bytecode, catalogue cache, as a user's second call finds them
            times = [wall(cmd, env) for _ in range(args.n)]
            med = statistics.median(times)
            passed = med < args.target
            ok &= passed
            print(f"{name:<40} {med:>9.3f} {min(times):>7.3f}  {'pass' if passed else 'FAIL'}")
        print(f"load average after: {load()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
