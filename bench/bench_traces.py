"""Benchmark: PyTorch profiler trace ingest against Holistic Trace Analysis, same files, same run.

    python bench/bench_traces.py [--corpus ../shared/corpus] [--big-gb 2] [--no-big] [--hta-big] [--workers 0]
                                 [--hta-python PYTHON] [--no-hta] [--keep] [--repeat N] [--usual] [--cold]

For each folder of real traces (``<corpus>/real/*/profiler/``) and for one large trace
of about --big-gb GB that it builds by repeating the events of a real trace (under
bench/data/, git-ignored, removed afterwards unless --keep), it prints for
``forensics ingest`` (a subprocess) and for HTA's ``TraceAnalysis(trace_dir=...)`` (a
subprocess in HTA's own virtualenv, bench/.venv-hta, created on first use):

* wall seconds of the whole command, and the seconds of the load itself as the tool
  reports it (``forensics ingest --json``'s ``seconds``; the ``TraceAnalysis(...)`` call);
* MB/s of trace JSON (decompressed size) and events/s, on the load seconds;
* peak RSS of the process tree: the largest sum over its processes (psutil, sampled every
  50 ms) and the largest single process;
* the ratios HTA / forensics.

HTA is not run on the large trace unless --hta-big is given: it loads a whole trace into
memory (several times the JSON size).

``--repeat N`` runs each tool N times per folder (alternating) and prints every run, then
the medians and their ratios. ``--usual`` also runs ``forensics ingest`` with
``FORENSICS_DIRECT=0`` (every trace through forensics' own decoder instead of DuckDB's JSON
reader). A new database starts as a copy of a cached empty one (``FORENSICS_CACHE``); the
script makes that copy exist before it measures, as it does after any first ingest on a
machine, and says how long that took; ``--cold`` gives every forensics run an empty cache
instead, so that it pays for binding the analysis views itself.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
HTA_VENV = REPO / "bench" / ".venv-hta"
HTA_LOAD = """
import json, sys, time
t0 = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
t1 = time.perf_counter()
analysis = TraceAnalysis(trace_dir=sys.argv[1])
t2 = time.perf_counter()
rows = sum(len(analysis.t.get_trace(r)) for r in analysis.t.get_ranks())
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "rows": rows}))
"""


@dataclass
class Run:
    wall: float
    load: float
    peak_tree: int
    peak_single: int
    detail: dict


def measure(cmd: list[str], cwd: Path | None = None, env: dict | None = None) -> tuple[float, int, int, subprocess.CompletedProcess]:
    """Wall time and peak RSS of a command: (sum over its process tree, largest process)."""
    t0 = time.perf_counter()
    proc = psutil.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env)
    peak_tree = peak_single = 0
    while proc.poll() is None:
        try:
            rss = [p.memory_info().rss for p in [proc, *proc.children(recursive=True)]]
        except psutil.Error:  # a process ended between listing and reading it
            rss = []
        if rss:
            peak_tree = max(peak_tree, sum(rss))
            peak_single = max(peak_single, max(rss))
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    out, err = proc.communicate()
    return wall, peak_tree, peak_single, subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def ensure_hta() -> Path:
    python = HTA_VENV / "bin" / "python"
    if not python.exists():
        print(f"creating {HTA_VENV} with HolisticTraceAnalysis (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(HTA_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "HolisticTraceAnalysis"], check=True)
    return python


def run_forensics(folder: Path, work: Path, workers: int, env: dict | None = None, cold: bool = False) -> Run:
    """``forensics ingest`` of ``folder`` with ``env`` added; ``cold``: with an empty database cache."""
    db = work / f"{folder.parent.name}-{folder.name}.duckdb"
    for p in (db, Path(f"{db}.wal")):
        if p.exists():
            p.unlink()
    cmd = [sys.executable, "-m", "forensics", "ingest", str(folder), "--db", str(db), "--json"]
    if workers:
        cmd += ["--workers", str(workers)]
    cache = tempfile.mkdtemp(prefix="cold-cache-", dir=work) if cold else None
    env = {**(env or {}), **({"FORENSICS_CACHE": cache} if cache else {})}
    wall, tree, single, proc = measure(cmd, cwd=REPO, env={**os.environ, **env})
    if cache:
        shutil.rmtree(cache, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"forensics ingest failed:\n{proc.stderr.decode()[-3000:]}")
    summary = json.loads(proc.stdout)
    db.unlink()
    return Run(wall, summary["seconds"], tree, single, summary)


def run_hta(python: Path, folder: Path) -> Run:
    wall, tree, single, proc = measure([str(python), "-c", HTA_LOAD, str(folder)])
    if proc.returncode != 0:
        raise SystemExit(f"HTA failed:\n{proc.stderr.decode()[-3000:]}")
    result = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    return Run(wall, result["load_s"], tree, single, result)


def trace_stats(folder: Path) -> tuple[int, int]:
    """(decompressed JSON bytes, events) of the traces in a folder."""
    nbytes = events = 0
    for path in sorted(folder.iterdir()):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as fh:
            data = fh.read()
        nbytes += len(data)
        events += len(json.loads(data)["traceEvents"])
    return nbytes, events


def build_big(source: Path, target: Path, size: int) -> tuple[int, int]:
    """Write a Kineto trace of about ``size`` bytes that repeats the events of
    ``source``; return (bytes, events)."""
    opener = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rb") as fh:
        data = fh.read()
    doc = json.loads(data)
    n = len(doc["traceEvents"])
    start = data.index(b"[", data.index(b'"traceEvents"')) + 1
    end = data.rindex(b"]")
    head, body, tail = data[:start], data[start:end].rstrip(), data[end:]
    copies = max(1, size // len(body))
    with open(target, "wb") as out:
        out.write(head)
        for i in range(copies):
            if i:
                out.write(b",")
            out.write(body)
        out.write(b"\n  ")
        out.write(tail)
    return target.stat().st_size, n * copies


def line(tool: str, run: Run, nbytes: int, events: int, label: str | None = None) -> str:
    """One result line; the load average before it tells how busy the machine was."""
    label = label or f"load avg {os.getloadavg()[0]:4.1f}"
    return (f"  [{label}] {tool:9s} wall {run.wall:7.2f} s  load {run.load:7.2f} s  {nbytes / 1e6 / run.load:7.1f} MB/s  "
            f"{events / run.load / 1e3:8.1f} k events/s  peak RSS tree {run.peak_tree / 2**20:6.0f} MiB  "
            f"largest process {run.peak_single / 2**20:6.0f} MiB")


def median(runs: list[Run]) -> Run:
    def mid(values):
        return sorted(values)[len(values) // 2]
    return Run(mid([r.wall for r in runs]), mid([r.load for r in runs]), mid([r.peak_tree for r in runs]),
               mid([r.peak_single for r in runs]), runs[0].detail)


def compare(name: str, folder: Path, work: Path, hta: Path | None, workers: int, repeat: int = 1,
            cold: bool = False, usual: bool = False) -> None:
    nbytes, events = trace_stats(folder)
    print(f"\n{name}: {len(list(folder.iterdir()))} trace(s), {nbytes / 1e6:.0f} MB of JSON, {events:,} events", flush=True)
    ours_runs, usual_runs, hta_runs = [], [], []
    for _ in range(repeat):
        ours = run_forensics(folder, work, workers, cold=cold)
        rows = ours.detail["rows_added"].get("trace_events", 0)
        print(line("forensics", ours, nbytes, events) + f"  ({rows:,} rows{'' if rows == events else ' MISMATCH'})", flush=True)
        ours_runs.append(ours)
        if usual:
            run = run_forensics(folder, work, workers, {"FORENSICS_DIRECT": "0"}, cold=cold)
            rows = run.detail["rows_added"].get("trace_events", 0)
            print(line("(decoder)", run, nbytes, events) + f"  ({rows:,} rows{'' if rows == events else ' MISMATCH'}; FORENSICS_DIRECT=0)", flush=True)
            usual_runs.append(run)
        if hta is not None:
            theirs = run_hta(hta, folder)
            print(line("HTA", theirs, nbytes, events) + f"  ({theirs.detail['rows']:,} rows kept by HTA)", flush=True)
            hta_runs.append(theirs)
    ours = median(ours_runs)
    if repeat > 1:
        print(line("forensics", ours, nbytes, events, f"median of {repeat}"), flush=True)
    if hta_runs:
        theirs = median(hta_runs)
        if repeat > 1:
            print(line("HTA", theirs, nbytes, events, f"median of {repeat}"), flush=True)
        print(f"  HTA / forensics{' (medians)' if repeat > 1 else ''}: wall {theirs.wall / ours.wall:.1f}x, "
              f"load {theirs.load / ours.load:.1f}x, peak RSS tree {theirs.peak_tree / ours.peak_tree:.1f}x, "
              f"largest process {theirs.peak_single / ours.peak_single:.1f}x; forensics / HTA peak RSS tree "
              f"{ours.peak_tree / theirs.peak_tree:.2f}, largest process {ours.peak_single / theirs.peak_single:.2f}", flush=True)


def warm_template() -> None:
    """Make the cached empty database exist (see the module docstring), saying how long it took."""
    sys.path.insert(0, str(REPO))
    from forensics.store import Store, template_path

    if os.path.exists(template_path()):
        print(f"cached empty database: {template_path()}")
        return
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        Store(os.path.join(tmp, "warm.duckdb")).close()
    print(f"cached empty database built in {time.perf_counter() - t0:.2f} s: {template_path()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=REPO.parent / "shared" / "corpus")
    ap.add_argument("--big-gb", type=float, default=2.0)
    ap.add_argument("--no-big", action="store_true", help="skip the large built trace")
    ap.add_argument("--hta-big", action="store_true", help="run HTA on the large trace too")
    ap.add_argument("--no-hta", action="store_true")
    ap.add_argument("--hta-python", type=Path, help="a Python that has HolisticTraceAnalysis (default: bench/.venv-hta, made on first use)")
    ap.add_argument("--workers", type=int, default=0, help="forensics ingest --workers (0: one per core)")
    ap.add_argument("--keep", action="store_true", help="keep the large trace")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each tool per folder; medians are printed too")
    ap.add_argument("--usual", action="store_true", help="also run forensics with FORENSICS_DIRECT=0 (its own decoder)")
    ap.add_argument("--cold", action="store_true", help="every forensics run starts with an empty database cache")
    args = ap.parse_args()
    folders = sorted(p for p in args.corpus.glob("real/*/profiler") if p.is_dir())
    if not folders:
        raise SystemExit(f"no profiler traces under {args.corpus}/real/*/profiler")
    print(f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB memory, python {sys.version.split()[0]}")
    hta = None if args.no_hta else (args.hta_python or ensure_hta())
    if not args.cold:
        warm_template()
    data_root = REPO / "bench" / "data"
    data_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="traces-", dir=data_root))
    try:
        for folder in folders:
            compare(str(folder.relative_to(args.corpus)), folder, work, hta, args.workers, args.repeat, args.cold, args.usual)
        if not args.no_big:
            big = work / "big"
            big.mkdir()
            source = max(folders[0].iterdir(), key=lambda p: p.stat().st_size)
            t0 = time.perf_counter()
            nbytes, events = build_big(source, big / "rank0.big.pt.trace.json", int(args.big_gb * 1e9))
            print(f"\nbuilt {nbytes / 1e9:.2f} GB trace with {events:,} events from {source.name} in {time.perf_counter() - t0:.0f} s", flush=True)
            ours = run_forensics(big, work, args.workers, cold=args.cold)
            rows = ours.detail["rows_added"].get("trace_events", 0)
            print(line("forensics", ours, nbytes, events) + f"  ({rows:,} rows{'' if rows == events else ' MISMATCH'})", flush=True)
            if hta is not None and args.hta_big:
                theirs = run_hta(hta, big)
                print(line("HTA", theirs, nbytes, events), flush=True)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
