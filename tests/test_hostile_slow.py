"""Hostile input, the slow part (``pytest -m slow``): 20,000 files through the command
line, kills at arbitrary moments of real work (not at a chosen pause, as in
test_hostile.py), and the memory bound of one big file."""
from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from .test_hostile import assert_accounting, assert_complete, folder_contents, interruptible, log_lines, ours, run_cli
from .test_ingest import rows

pytestmark = pytest.mark.slow


def test_20000_small_files_through_the_cli(tmp_path):
    root = tmp_path / "ray"
    for i in range(20_000):
        d = root / f"node-{i % 16}" / "logs"
        d.mkdir(parents=True, exist_ok=True)
        name = f"worker-{i:040x}-01000000-{10_000 + i}"
        if i % 10 == 0:
            (d / f"{name}.err").write_bytes(b"")  # Ray leaves many empty .err files
        elif i % 97 == 0:
            (d / f"core.{i}").write_bytes(b"\x7fELF" + os.urandom(64))
        else:
            (d / f"{name}.out").write_bytes(b":job_id:01000000\n:actor_name:Worker\n(pid=%d) step %d done\n" % (10_000 + i, i))
    db = tmp_path / "many.duckdb"
    t0 = time.perf_counter()
    p = run_cli("ingest", str(root), "--db", str(db), "-q", timeout=1200)
    first = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert "2000 empty file(s) skipped" in p.stderr
    assert rows(db, "SELECT count(*), count(DISTINCT path) FROM files") == [(20_000, 20_000)]
    assert assert_accounting(db, folder_contents(root)) == 20_000 - 2000 - len([i for i in range(20_000) if i % 97 == 0 and i % 10])
    t0 = time.perf_counter()
    p = run_cli("ingest", str(root), "--db", str(db), "-q", timeout=1200)
    again = time.perf_counter() - t0
    assert p.returncode == 0 and "0 file(s) loaded, 20000 unchanged" in p.stdout
    print(f"20,000 files: first ingest {first:.1f} s, unchanged re-run {again:.1f} s (command line, imports and headline included)")


@pytest.fixture(scope="module")
def work_folder(tmp_path_factory) -> Path:
    """Real work for a few seconds or more: big text files (loaded in pieces), gzip logs,
    many small logs."""
    root = tmp_path_factory.mktemp("work") / "run"
    (root / "big").mkdir(parents=True)
    for i in range(3):
        with open(root / "big" / f"driver{i}.log", "wb") as fh:
            for k in range(8):
                fh.write(log_lines(50_000, f"big{i}", start=k * 50_000))
    for i in range(40):
        (root / "gz").mkdir(exist_ok=True)
        (root / "gz" / f"rank{i}.log.gz").write_bytes(gzip.compress(log_lines(5000, f"gz{i}"), compresslevel=1))
    for i in range(600):
        d = root / "small" / f"node-{i % 5}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"w{i}.log").write_bytes(log_lines(50 + i % 30, f"s{i}"))
    return root


def _orphans_are_noted(db: Path) -> None:
    """Rows without a `files` row exist only for files noted as loading in pieces."""
    noted = {int(v.split(" ", 1)[0]) for (v,) in rows(db, "SELECT value FROM meta WHERE key = 'loading_file'")}
    orphans = {r[0] for r in rows(db, "SELECT DISTINCT file_id FROM lines WHERE file_id NOT IN (SELECT file_id FROM files)")}
    assert orphans <= noted, (orphans, noted)


def _start(folder: Path, db: Path, tmpdir: Path) -> psutil.Popen:
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    return psutil.Popen([sys.executable, "-m", "forensics", "ingest", str(folder), "--db", str(db), "--workers", "2", "-q"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, preexec_fn=interruptible)


def _wait_for_work(proc: psutil.Popen, db: Path, seconds: float) -> bool:
    """Wait until the parsers run and the database was written, then ``seconds`` more;
    False when the ingest ended first."""
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if len(proc.children(recursive=True)) >= 3 and Path(str(db) + ".wal").exists():
            break
        time.sleep(0.05)
    end = time.time() + seconds
    while time.time() < end and proc.poll() is None:
        time.sleep(0.05)
    return proc.poll() is None


def test_repeated_kills_during_real_work(tmp_path, work_folder):
    db, tmpdir = tmp_path / "k.duckdb", tmp_path / "tmp"
    tmpdir.mkdir()
    kills = 0
    for delay in (0.5, 2.0, 4.0, 7.0):
        proc = _start(work_folder, db, tmpdir)
        if not _wait_for_work(proc, db, delay):
            break  # it finished: nothing left to interrupt
        workers = proc.children(recursive=True)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=120)
        kills += 1
        gone, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive, "parser processes outlived their ingest"
        # the database opens; what is committed is whole; partial big files are noted
        assert rows(db, "SELECT count(*) - count(DISTINCT (file_id, line_no)) FROM lines") == [(0,)]
        assert_accounting(db, folder_contents(work_folder))
        _orphans_are_noted(db)
    assert kills >= 2, "the ingest was too fast to be interrupted: make the folder bigger"
    p = run_cli("ingest", str(work_folder), "--db", str(db), "-q", tmpdir=tmpdir, timeout=1200)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert ours(tmpdir) == []
    n_files = sum(1 for _ in folder_contents(work_folder))
    assert_complete(db, work_folder, n_files)
    assert rows(db, "SELECT count(*) FROM meta WHERE key = 'loading_file'") == [(0,)]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_polite_interrupt_during_real_work(tmp_path, work_folder, sig):
    db, tmpdir = tmp_path / "p.duckdb", tmp_path / "tmp"
    tmpdir.mkdir()
    proc = _start(work_folder, db, tmpdir)
    assert _wait_for_work(proc, db, 3.0), "the ingest was too fast to be interrupted"
    t0 = time.perf_counter()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    took = time.perf_counter() - t0
    err = err.decode()
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err
    assert ours(tmpdir) == []
    assert took < 60, f"stopping took {took:.0f} s"
    assert rows(db, "SELECT count(*) FROM meta WHERE key = 'loading_file'") in ([(0,)], [(1,)])
    p = run_cli("ingest", str(work_folder), "--db", str(db), "-q", tmpdir=tmpdir, timeout=1200)
    assert p.returncode == 0, p.stderr[-2000:]
    assert_complete(db, work_folder, sum(1 for _ in folder_contents(work_folder)))


def test_memory_of_one_big_file_is_bounded(tmp_path):
    """A 600 MB log: the ingest's processes stay far below the file's size times the
    several copies a parse makes (the rows are committed in pieces, DuckDB's cache is
    limited, the chunker streams)."""
    root = tmp_path / "one"
    root.mkdir()
    with open(root / "train.log", "wb") as fh:
        for k in range(60):
            fh.write(log_lines(100_000, "train", start=k * 100_000)[: 10 << 20])
    size = (root / "train.log").stat().st_size
    proc = psutil.Popen([sys.executable, "-m", "forensics", "ingest", str(root), "--db", str(tmp_path / "m.duckdb"),
                         "--workers", "2", "-q"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak_tree = peak_one = 0
    while proc.poll() is None:
        try:
            rss = [p.memory_info().rss for p in [proc, *proc.children(recursive=True)]]
        except psutil.Error:
            rss = []
        if rss:
            peak_tree, peak_one = max(peak_tree, sum(rss)), max(peak_one, max(rss))
        time.sleep(0.05)
    out, err = proc.communicate()
    assert proc.returncode == 0, err.decode()[-2000:]
    print(f"{size / 2**20:.0f} MiB file: peak RSS {peak_one / 2**20:.0f} MiB (largest process), {peak_tree / 2**20:.0f} MiB (tree)")
    assert peak_one < 1.6 * 2**30
    assert peak_tree < 3 * 2**30
    assert_accounting(tmp_path / "m.duckdb", folder_contents(root))
