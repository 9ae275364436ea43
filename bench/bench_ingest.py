"""Benchmark: text-log ingest throughput and memory, with `grep -rcE` as the floor.

    python bench/bench_ingest.py [--size-mb 1024] [--corpus ../shared/corpus] [--workers 0] [--keep]
    python bench/bench_ingest.py --folder bench/data/text-XXXX     # again on a folder kept before
    python bench/bench_ingest.py --fraction 0                       # without the smaller comparison run

Builds a folder of about --size-mb of text logs by replicating the text files of the
corpus (each copy shifts its timestamps and varies pids and host names, so rows are not
identical), then prints, in one run: MB/s and peak RSS (whole process tree) of
`forensics ingest` on it, and the time of `grep -rcE` over the same folder with a few
typical error patterns. Then it ingests the first quarter of the copies (--fraction) on
its own: peak RSS that does not grow with the folder shows next to the full run. The
folder goes to bench/data/ (git-ignored) and is removed unless --keep is given.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
TEXT_SUFFIXES = (".log", ".out", ".err", ".txt", ".jsonl")
GREP_PATTERNS = [
    "out of memory", "Watchdog caught collective operation timeout", "NCCL WARN",
    "Traceback \\(most recent call last\\)", "ActorDiedError", "Error executing job",
]
_ISO = re.compile(rb"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})")
_PID = re.compile(rb"pid=(\d+)")
_HOST = re.compile(rb"\b(node|gpu|host)-?(\d+)\b")


def text_sources(corpus: Path) -> list[Path]:
    out = []
    for p in sorted(corpus.rglob("*")):
        if p.is_file() and p.name != "label.json" and (p.suffix in TEXT_SUFFIXES or p.name.endswith(".out")) and p.stat().st_size:
            out.append(p)
    return out


def vary(data: bytes, k: int) -> bytes:
    def shift(m: re.Match) -> bytes:
        try:
            t = datetime(*map(int, m.groups())) + timedelta(minutes=7 * k)
        except ValueError:
            return m.group(0)
        sep = m.group(0)[10:11]
        return t.strftime(f"%Y-%m-%d{sep.decode()}%H:%M:%S").encode()

    data = _ISO.sub(shift, data)
    data = _PID.sub(lambda m: b"pid=" + str(int(m.group(1)) + 100 * k).encode(), data)
    return _HOST.sub(lambda m: m.group(1) + b"-" + str(int(m.group(2)) + k).encode(), data)


def build(folder: Path, corpus: Path, size_mb: int) -> int:
    sources = [(p, p.read_bytes()) for p in text_sources(corpus)]
    if not sources:
        raise SystemExit(f"no text files under {corpus}")
    total, k = 0, 0
    target = size_mb * 1024 * 1024
    while total < target:
        # node_NNNN: the copies are parts of one run (forensics.runs), the case this
        # benchmark is about: one big run, one diagnosis headline
        replica = folder / f"node_{k:04d}"
        for src, data in sources:
            rel = src.relative_to(corpus)
            out = replica / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            body = vary(data, k)
            out.write_bytes(body)
            total += len(body)
            if total >= target:
                break
        k += 1
    return total


LARGEST: list[int] = [0]  # peak RSS of the largest single process of the last run_measured


def run_measured(cmd: list[str]) -> tuple[float, int, subprocess.CompletedProcess]:
    """Wall time and peak RSS (sum over the process tree, sampled every 50 ms); the peak
    of the largest single process goes to LARGEST[0]."""
    t0 = time.perf_counter()
    # output to files, not pipes: a pipe nobody reads while the command runs fills at
    # 64 KB and blocks it (the --json of a big ingest is longer)
    out_f, err_f = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    proc = psutil.Popen(cmd, stdout=out_f, stderr=err_f)
    peak = largest = 0
    while proc.poll() is None:
        try:
            procs = [proc] + proc.children(recursive=True)
            each = [p.memory_info().rss for p in procs if p.is_running()]
            peak = max(peak, sum(each))
            largest = max([largest, *each])
        except psutil.Error:
            pass
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    proc.wait()
    out_f.seek(0)
    err_f.seek(0)
    out, err = out_f.read(), err_f.read()
    LARGEST[0] = largest
    return wall, peak, subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def smaller_run(folder: Path, fraction: float, workers: int) -> None:
    """Ingest the first ``fraction`` of the copies (node_NNNN folders), hard-linked into a
    folder of their own (one run, as the whole), into a database of its own and print its
    MB/s and peak RSS: next to the full run, it shows whether memory grows with the folder."""
    runs = sorted(p for p in folder.iterdir() if p.is_dir())
    part = runs[: max(1, round(len(runs) * fraction))]
    nbytes = sum(f.stat().st_size for r in part for f in r.rglob("*") if f.is_file())
    linked = folder.with_name(folder.name + f"-part{len(part)}")
    shutil.rmtree(linked, ignore_errors=True)
    for r in part:
        shutil.copytree(r, linked / r.name, copy_function=os.link)
    db = folder.with_name(folder.name + f"-part{len(part)}.duckdb")
    for p in (db, Path(str(db) + ".wal")):
        if p.exists():
            p.unlink()
    cmd = [sys.executable, "-m", "forensics", "ingest", str(linked), "--db", str(db), "--json"]
    if workers:
        cmd += ["--workers", str(workers)]
    try:
        wall, peak, proc = run_measured(cmd)
        if proc.returncode != 0:
            print(proc.stderr.decode()[-3000:])
            raise SystemExit("ingest of the smaller folder failed")
        load_s = json.loads(proc.stdout)["seconds"]
        print(f"the first {len(part)} of {len(runs)} copies ({nbytes / 1e6:.0f} MB): whole command {wall:.2f} s, "
              f"{nbytes / 1e6 / wall:.1f} MB/s; ingest itself {load_s:.2f} s, {nbytes / 1e6 / load_s:.1f} MB/s; "
              f"peak RSS {peak / 2**20:.0f} MiB (process tree), largest process {LARGEST[0] / 2**20:.0f} MiB")
    finally:
        shutil.rmtree(linked, ignore_errors=True)
        for p in (db, Path(str(db) + ".wal")):
            if p.exists():
                p.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--corpus", type=Path, default=REPO.parent / "shared" / "corpus")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--folder", type=Path, help="ingest this folder (built by an earlier --keep run) instead of building one")
    ap.add_argument("--fraction", type=float, default=0.25,
                    help="also ingest this share of the copies on its own, to compare peak RSS (0: skip)")
    args = ap.parse_args()
    data_root = REPO / "bench" / "data"
    data_root.mkdir(parents=True, exist_ok=True)
    folder = args.folder.resolve() if args.folder else Path(tempfile.mkdtemp(prefix="text-", dir=data_root))
    db = folder.with_suffix(".duckdb")
    for p in (db, Path(str(db) + ".wal")):
        if p.exists():
            p.unlink()
    try:
        t0 = time.perf_counter()
        if args.folder:
            files = [p for p in folder.rglob("*") if p.is_file()]
            nbytes, nfiles = sum(p.stat().st_size for p in files), len(files)
            print(f"reusing {nbytes / 1e6:.0f} MB in {nfiles} files ({folder})")
        else:
            nbytes = build(folder, args.corpus, args.size_mb)
            nfiles = sum(1 for _ in folder.rglob("*") if _.is_file())
            print(f"built {nbytes / 1e6:.0f} MB in {nfiles} files in {time.perf_counter() - t0:.1f} s ({folder})")
        cmd = [sys.executable, "-m", "forensics", "ingest", str(folder), "--db", str(db), "--json"]
        if args.workers:
            cmd += ["--workers", str(args.workers)]
        wall, peak, proc = run_measured(cmd)
        if proc.returncode != 0:
            print(proc.stderr.decode()[-3000:])
            raise SystemExit("ingest failed")
        import duckdb

        report = json.loads(proc.stdout)
        load_s = report["seconds"]

        con = duckdb.connect(str(db), read_only=True)
        lines_db, files_lines = con.execute("SELECT (SELECT count(*) FROM lines), (SELECT sum(lines) FROM files WHERE kind='text')").fetchone()
        con.close()
        physical = sum(_count_lines(p) for p in folder.rglob("*") if p.is_file())
        print(f"load avg {os.getloadavg()[0]:.1f}; forensics ingest, whole command: {wall:.2f} s, {nbytes / 1e6 / wall:.1f} MB/s; "
              f"of which the ingest itself (walk, parse, load: `seconds` of --json) {load_s:.2f} s, {nbytes / 1e6 / load_s:.1f} MB/s; "
              f"the rest is start-up and the diagnosis headline")
        print(f"peak RSS {peak / 2**20:.0f} MiB (process tree), largest process {LARGEST[0] / 2**20:.0f} MiB; "
              f"{lines_db:,} rows in lines; files.lines {files_lines:,}; physical lines {physical:,} "
              f"({'accounting OK' if lines_db == files_lines == physical else 'ACCOUNTING MISMATCH'})")
        grep = ["grep", "-rcE", "|".join(GREP_PATTERNS), str(folder)]
        t0 = time.perf_counter()
        subprocess.run(grep, stdout=subprocess.DEVNULL, check=False)
        g = time.perf_counter() - t0
        print(f"grep -rcE floor: {g:.2f} s, {nbytes / 1e6 / g:.1f} MB/s; forensics/grep time ratio {wall / g:.1f}x")
        print(f"database size {db.stat().st_size / 1e6:.0f} MB; runs found: {len(report.get('runs') or [])}; "
              f"headline: {report.get('diagnosis')}")
        if 0 < args.fraction < 1:
            smaller_run(folder, args.fraction, args.workers)
    finally:
        if not args.keep:
            if not args.folder:
                shutil.rmtree(folder, ignore_errors=True)
            for p in (db, Path(str(db) + ".wal")):
                if p.exists():
                    p.unlink()


def _count_lines(p: Path) -> int:
    n, last = 0, b"\n"
    with open(p, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (0 if last == b"\n" else 1)


if __name__ == "__main__":
    main()
