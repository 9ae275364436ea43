"""Hostile and broken input (issue 8): what a dying system wrote. Ingest never crashes,
never loses a line, never runs what the logs contain.

One folder holds every kind of bad input at once (cut and corrupt gzip, cut and broken
Kineto traces, core dumps and shared objects, mixed encodings, NUL bytes, a 50 MB line,
CR and CRLF line ends, ANSI storms, empty files, symlink loops, a FIFO, file names
with terminal escapes, malicious pickles) next to good logs, plus tar/zip bundles that
try to write outside their folder. It goes through the real command line once
(``python -m forensics ingest``); the tests then check, input by input, what the
database holds and what the user was told. Changing files, unreadable files, many
small files, interrupted and concurrent ingests and the read-only query follow, then
property tests (hypothesis) of the shared mechanisms: the line splitter, format
detection, the Kineto reader and the restricted unpickler. The slow part (20,000
files, repeated kills during real work) is in test_hostile_slow.py.
"""
from __future__ import annotations

import copyreg
import gzip
import hashlib
import io
import json
import os
import pickle
import random
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import time
import uuid
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import forensics.parsers.text as text_mod
from forensics import detect as det
from forensics import pipeline
from forensics.parsers import flight_recorder as fr
from forensics.parsers import kineto
from forensics.parsers.base import FileContext

from .conftest import FIXTURES
from .test_batch_parse import check_same
from .test_ingest import rows

FOUNDATION = FIXTURES / "foundation"
MB = 1 << 20


def rel_rows(db: Path, sql: str, params=None):
    """``rows``, with ``files.path`` relative to its PATH again: a database of several PATHs
    stores each path behind its PATH's name (tests/test_runs.py checks that), and these
    tests name the files by where they lie under their PATH."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        name = con.execute("SELECT current_database()").fetchone()[0]
        con.execute(f"""CREATE TEMP VIEW files AS SELECT f.* REPLACE (
                            CASE WHEN r.path_prefix IS NULL THEN f.path ELSE substr(f.path, length(r.path_prefix) + 2) END AS path)
                        FROM "{name}".main.files f LEFT JOIN "{name}".main.runs r ON r.parent_id IS NULL AND r.root = f.root""")
        return con.execute(sql, params or []).fetchall()
    finally:
        con.close()


# -- helpers ------------------------------------------------------------------------------

def physical(data: bytes) -> int:
    """Physical lines as the `lines` table counts them: `\\n` ends a line, a last line
    without one still counts."""
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def gunzip_prefix(raw: bytes) -> bytes:
    """What a gzip file holds up to where it is cut off or stops being gzip."""
    out = []
    while raw[:2] == b"\x1f\x8b":
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            out.append(d.decompress(raw))
        except zlib.error:
            break
        if not d.eof:
            break
        raw = d.unused_data
    return b"".join(out)


def run_cli(*args: str, tmpdir: Path | None = None, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("FORENSICS_DEBUG", None)
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.run([sys.executable, "-m", "forensics", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout, errors="backslashreplace")


def snapshot(root: Path, skip: tuple[Path, ...] = ()) -> dict[str, tuple]:
    """Every entry under ``root`` (symlinks not followed) with its type, size and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if any(Path(dirpath) == s or s in Path(dirpath).parents for s in skip):
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            if Path(p) in skip:
                continue
            st_ = os.lstat(p)
            out[os.path.relpath(p, root)] = (stat.S_IFMT(st_.st_mode), st_.st_size, st_.st_mtime_ns)
    return out


def assert_accounting(db: Path, contents: dict[tuple[str, str], bytes | None]) -> int:
    """files.lines == physical lines == rows in `lines` for every text file, and line
    numbers run 1..N. ``contents``: (root, path) -> the bytes the file held (None:
    unknown from outside, e.g. a cut member of a cut bundle: only the database's own
    consistency is checked)."""
    checked = 0
    for root, path, lines, n_rows, top in rel_rows(db, """
            SELECT f.root, f.path, f.lines, count(l.line_no), coalesce(max(l.line_no), 0)
            FROM files f LEFT JOIN lines l USING (file_id) WHERE f.kind = 'text' GROUP BY ALL"""):
        assert lines == n_rows == top, f"{path}: files.lines={lines}, rows={n_rows}, max(line_no)={top}"
        assert (root, path) in contents, f"unexpected text file {root} {path}"
        data = contents[(root, path)]
        if data is not None:
            assert lines == physical(data), f"{path}: {lines} lines stored, the file has {physical(data)}"
        checked += 1
    assert not rows(db, """SELECT file_id FROM lines GROUP BY file_id
                           HAVING min(line_no) <> 1 OR count(DISTINCT line_no) <> count(*)""")
    return checked


def folder_contents(root: Path) -> dict[tuple[str, str], bytes]:
    """(root, path) -> content of every regular file under ``root`` (gzip decompressed,
    as far as it goes), keyed the way `files` stores them."""
    out = {}
    for abs_path, rel in pipeline.walk(str(root), [], set()):
        raw = Path(abs_path).read_bytes()
        out[(str(root), rel)] = gunzip_prefix(raw) if raw[:2] == b"\x1f\x8b" else raw
    return out


# -- building the hostile folder ------------------------------------------------------------

def log_lines(n: int, tag: str = "x", start: int = 0) -> bytes:
    return b"".join(b"2025-03-14 10:%02d:%02d,000 INFO %s - event %d payload %s\n"
                    % ((i // 60) % 60, i % 60, tag.encode(), i, hashlib.md5(b"%d" % i).hexdigest().encode())
                    for i in range(start, start + n))


def kineto_trace(n: int = 400, rank: int = 0) -> bytes:
    events = [{"ph": "X", "cat": "kernel", "name": f"ampere_gemm_{i % 7}", "pid": 0, "tid": 7,
               "ts": 1_700_000_000_000 + i * 10, "dur": 5, "args": {"stream": 7, "correlation": i}} for i in range(n)]
    return json.dumps({"schemaVersion": 1, "distributedInfo": {"rank": rank, "world_size": 8},
                       "traceEvents": events, "traceName": "hostile"}, indent=1).encode()


class _Evil:
    """Pickles into a call of ``func(*args)``; unpickling it must never run it."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def canary_path(base: Path) -> Path:
    return base / "PWNED"


def evil_pickles(canary: Path) -> dict[str, bytes]:
    import builtins

    touch = f"touch {canary}"
    write = f"open({str(canary)!r}, 'w').write('pwned')"
    return {
        "reduce_os_system_p2": pickle.dumps({"entries": [_Evil(os.system, touch)]}, protocol=2),
        "stack_global_exec_p4": pickle.dumps(_Evil(builtins.exec, write), protocol=4),
        "eval_p5": pickle.dumps([1, 2, _Evil(builtins.eval, write)], protocol=5),
        "ext1_p2": b"\x80\x02\x82\xf0)R.",  # EXT1 code 240, empty tuple, REDUCE
        "persid_p2": b"\x80\x02X\x03\x00\x00\x00abcQ.",  # BINPERSID
        "inst_after_proto": b"\x80\x02(cos\nsystem\nX\x04\x00\x00\x00trueo.",  # MARK GLOBAL ... OBJ
        "protocol0_text": f"cos\nsystem\n(V{touch}\ntR.".encode(),  # no \x80: a text file
    }


@dataclass
class Expect:
    statuses: set[str] | None  # None: the file gets no `files` row (it could not be walked)
    kind: str | None = None
    needle: str | None = None  # what the user is told about it (stderr), None: nothing
    exact: bool = True  # its physical lines are known from outside


def build_hostile(base: Path) -> tuple[Path, dict[str, Expect]]:
    """The folder of bad inputs; returns it and the expectations by stored path."""
    logs = base / "logs"
    shutil.copytree(FOUNDATION, logs / "good")
    outside = base / "outside"
    outside.mkdir()
    (outside / "secret_outside.log").write_bytes(b"outside line 1\noutside line 2\n")
    exp: dict[str, Expect] = {}

    def put(rel: str, data: bytes, e: Expect) -> Path:
        p = logs / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        exp[rel] = e
        return p

    text_ok = Expect({"ok"}, "text")
    body = log_lines(3000, "gz")
    whole = gzip.compress(body)
    put("gz/trunc.log.gz", whole[: len(whole) // 2], Expect({"partial"}, "text", "stopped reading"))
    put("gz/zero.log.gz", b"", Expect({"skipped"}, "skipped", "empty file"))
    put("gz/header_only.log.gz", whole[:10], Expect({"skipped"}, "skipped", "does not decompress"))
    put("gz/garbage_tail.log.gz", whole + b"garbage after the gzip member\n", Expect({"partial"}, "text", "stopped reading"))
    # fixed bytes: what a damaged deflate stream yields before zlib gives up depends on
    # them (random ones sometimes decoded to a few extra garbage lines)
    rnd = random.Random(8000)
    noisy = b"".join(b"%d %s\n" % (i, rnd.randbytes(24).hex().encode()) for i in range(8000))
    gz = bytearray(gzip.compress(noisy))
    cut = int(len(gz) * 0.75)
    gz[cut: cut + 64] = bytes(64)  # a zeroed block inside the deflate stream
    put("gz/corrupt_middle.log.gz", bytes(gz), Expect({"partial"}, "text", "stopped reading", exact=False))

    trace = kineto_trace()
    put("profiler/rank0.cut.pt.trace.json", trace[: len(trace) // 2], Expect({"partial"}, "structured", "cut off"))
    broken = trace.replace(b'"dur": 5', b'"dur": 5,,', 3).replace(b'"name": "ampere_gemm_3"', b'"name": "ampere_gemm_3', 2)
    put("profiler/rank1.syntax.pt.trace.json", broken, Expect({"ok", "partial"}, "structured", "event"))
    bad_events = [{"ph": "X"}, {"ph": "X", "name": 5, "ts": "soon", "dur": None}, {"ph": "X", "name": "a", "ts": [1], "dur": {"x": 1}},
                  7, None, "text", [], {"ph": "X", "name": "ok", "ts": 1, "dur": 2, "pid": "p", "tid": 1.5},
                  {"ph": "X", "name": "huge", "ts": 10 ** 30, "dur": -1e308, "pid": 2 ** 70, "tid": True}]
    put("profiler/rank2.types.pt.trace.json", json.dumps({"schemaVersion": 1, "traceEvents": bad_events}).encode(),
        Expect({"ok", "partial"}, "structured", "event"))
    gz_trace = gzip.compress(trace)
    put("profiler/rank3.cut.pt.trace.json.gz", gz_trace[: len(gz_trace) * 2 // 3], Expect({"partial"}, "structured", "stopped reading"))
    put("profiler/rank4.garbage.pt.trace.json", b'{"schemaVersion": 1, "traceEvents": [' + os.urandom(20000),
        Expect({"ok", "partial"}, "structured", None))

    put("bin/core.4242", b"\x7fELF\x02\x01\x01\x00" + bytes(8) + b"\x04\x00\x3e\x00" + os.urandom(200_000),
        Expect({"skipped"}, "skipped", "binary"))
    put("bin/libnccl-net.so", b"\x7fELF\x02\x01\x01\x00" + bytes(8) + b"\x03\x00\x3e\x00" + os.urandom(30_000),
        Expect({"skipped"}, "skipped", "binary"))
    put("bin/zeros.log", bytes(16384), Expect({"skipped"}, "skipped", "only NUL bytes"))
    put("bin/utf16.log", "\ufeffINFO started\r\nERROR failed\r\n".encode("utf-16-le"), Expect({"skipped"}, "skipped", "UTF-16"))

    put("enc/latin1.log", "caf\u00e9 ol\u00e9\n".encode("latin-1") + b"plain ascii\n", Expect({"ok"}, "text", "not UTF-8"))
    mixed = (
        "utf-8: na\u00efve \u65e5\u672c\u8a9e \U0001f525\n".encode()
        + "latin-1: caf\u00e9\n".encode("latin-1")
        + b"cp1252: \x93quoted\x94 \x80\n"
        + b"invalid: \xff\xfe\xfd\n"
        + b"overlong: \xc0\xaf \xe0\x80\xaf\n"
        + b"surrogate: \xed\xa0\x80\n"
        + b"replacement char already: \xef\xbf\xbd\n"
        + b"cut multibyte at the end: \xe2\x82"
    )
    put("enc/mixed.log", mixed, Expect({"ok"}, "text", "not UTF-8"))
    put("enc/nul_inside.log", b"before\nhello\x00world\x00\x00\nafter\n", text_ok)
    put("enc/zero_tail.log", log_lines(50, "zt") + bytes(4096), text_ok)

    put("ends/crlf.log", b"first\r\nsecond\r\n\r\nlast without newline\r", text_ok)
    put("ends/cr_only.log", b"".join(b"\rTraining:  %3d%%|####| %d/100" % (i, i) for i in range(101)) + b"\n", text_ok)
    put("ends/no_final_newline.log", b"one\ntwo\nthree", text_ok)
    put("ends/only_newlines.log", b"\n" * 1000, text_ok)
    storm = b"".join(b"\x1b[%d;1m\x1b[2K\x1b]0;title %d\x07\x1b[?25l\x1b[0m" % (30 + i % 8, i) for i in range(3000))
    put("ansi/storm.log", (storm + b"ERROR real message %d\x1b[0m\n") * 3 % (1, 2, 3) + b"\x1b[31mincomplete \x1b[\x1b]unterminated osc\n", text_ok)
    put("empty.log", b"", Expect({"skipped"}, "skipped", "empty file"))

    links = logs / "links"
    links.mkdir()
    os.symlink("loop_b", links / "loop_a")
    os.symlink("loop_a", links / "loop_b")
    os.symlink("does/not/exist.log", links / "dangling.log")
    os.symlink("../../outside", links / "outside_dir")
    os.symlink("../../outside/secret_outside.log", links / "outside_file.log")
    exp["links/loop_a"] = exp["links/loop_b"] = Expect(None, None, "Too many levels of symbolic links")
    exp["links/dangling.log"] = Expect(None, None, "No such file")
    exp["links/outside_dir"] = Expect(None, None, "symlinked folder not followed")
    exp["links/outside_file.log"] = text_ok

    (logs / "special").mkdir()
    os.mkfifo(logs / "special" / "pipe.log")
    exp["special/pipe.log"] = Expect(None, None, "not a regular file")

    put("names/[/yellow]evil[bold].bin", b"\x7fELF" + os.urandom(100), Expect({"skipped"}, "skipped", "binary"))
    put("names/esc\x1b]0;pwned\x07.bin", b"\x7fELF" + os.urandom(100), Expect({"skipped"}, "skipped", "binary"))
    put("names/\u00fcn\u00ef c\u00f8d\u00e9.log", b"accented name\n", text_ok)
    raw_name = os.path.join(os.fsencode(logs / "names"), b"latin1-\xe9t\xe9.log")
    with open(raw_name, "wb") as fh:
        fh.write(b"a file whose name is not UTF-8\nsecond\n")
    exp["names/latin1-\ufffdt\ufffd.log"] = text_ok

    huge = b"start of the run\n" + b"HEAD-OF-THE-LONG-LINE " + b"x" * (50 * MB) + b" END-OF-THE-LONG-LINE\nafter the long line\n"
    put("big/one_line.log", huge, Expect({"ok"}, "text", "bytes long"))

    canary = canary_path(base)
    for name, data in evil_pickles(canary).items():
        if name == "protocol0_text":
            put(f"pickles/{name}/nccl_trace_rank_0", data, text_ok)
        else:
            put(f"pickles/{name}/nccl_trace_rank_0", data, Expect({"partial"}, "structured", "pickle"))
    return logs, exp


def build_bundles(base: Path) -> tuple[list[Path], dict[str, list[str]], dict[tuple[str, str], bytes | None], list[str]]:
    """Bundles that try to escape; returns (paths, member names each must report as
    skipped, (root, path) -> content of the members that must load, absolute paths
    members name)."""
    sentinel = "../../../../sentinel.txt"
    abs_target = f"/tmp/forensics-hostile-{uuid.uuid4().hex}.txt"
    good = log_lines(40, "bundle")
    contents: dict[tuple[str, str], bytes | None] = {}
    evil_tar = base / "evil.tar.gz"
    with tarfile.open(evil_tar, "w:gz") as tf:
        def add(name: str, data: bytes = b"escaped\n", **kw) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            for k, v in kw.items():
                setattr(info, k, v)
            tf.addfile(info, io.BytesIO(data) if info.isfile() else None)

        add("run/ok.log", good)
        add("../../../../escaped_dotdot.txt")
        add(abs_target)
        add("run/sub/../../../../../escaped_normalised.txt")
        add("run/link_passwd", type=tarfile.SYMTYPE, linkname="/etc/passwd", size=0)
        add("run/link_up", type=tarfile.SYMTYPE, linkname=sentinel, size=0)
        add("run/hard_up", type=tarfile.LNKTYPE, linkname=sentinel, size=0)
        add("run/dev_null", type=tarfile.CHRTYPE, devmajor=1, devminor=3, size=0)
        add("run/fifo", type=tarfile.FIFOTYPE, size=0)
    contents[(str(evil_tar), "run/ok.log")] = good
    contents[(str(evil_tar), abs_target.lstrip("/"))] = b"escaped\n"  # the filter makes it relative: inside

    evil_zip = base / "evil.zip"
    with zipfile.ZipFile(evil_zip, "w") as zf:
        zf.writestr("zrun/ok.log", good)
        zf.writestr("../../../../zip_dotdot.txt", b"escaped\n")
        zf.writestr(abs_target + ".zip", b"escaped\n")
        link = zipfile.ZipInfo("zrun/link_up")
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(link, sentinel)
        zf.writestr("..\\..\\..\\win_style.txt", b"a name with backslashes is just a name on POSIX\n")
    contents[(str(evil_zip), "zrun/ok.log")] = good
    contents[(str(evil_zip), "..\\..\\..\\win_style.txt")] = b"a name with backslashes is just a name on POSIX\n"

    cut_tar = base / "cut.tar.gz"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for i in range(6):
            data = b"".join(b"%d %s\n" % (j, os.urandom(20).hex().encode()) for j in range(3000))
            info = tarfile.TarInfo(f"part/file{i}.log")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
            contents[(str(cut_tar), f"part/file{i}.log")] = None  # which ones survive the cut is the point
    cut_tar.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])

    not_zip = base / "notazip.zip"
    not_zip.write_bytes(b"this is not a zip archive\n")
    skipped = {
        "evil.tar.gz": ["escaped_dotdot.txt", "escaped_normalised.txt", "link_passwd", "link_up", "hard_up", "dev_null", "run/fifo"],
        "evil.zip": ["zip_dotdot.txt", abs_target + ".zip", "link_up"],
        "cut.tar.gz": ["cannot open bundle"],
        "notazip.zip": ["cannot open bundle"],
    }
    return [evil_tar, evil_zip, cut_tar, not_zip], skipped, contents, [abs_target, abs_target + ".zip"]


@dataclass
class HostileRun:
    base: Path
    logs: Path
    db: Path
    tmpdir: Path
    cwd: Path
    proc: subprocess.CompletedProcess
    expect: dict[str, Expect]
    bundles: list[Path]
    bundle_skips: dict[str, list[str]]
    contents: dict[tuple[str, str], bytes | None]
    before: dict[str, tuple]
    abs_targets: list[str]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> HostileRun:
    base = tmp_path_factory.mktemp("hostile")
    logs, expect = build_hostile(base)
    bundles, skips, bundle_contents, abs_targets = build_bundles(base)
    (base / "sentinel.txt").write_bytes(b"sentinel: must stay as it is\n")
    out, tmpdir, cwd = base / "out", base / "tmp", base / "cwd"
    for d in (out, tmpdir, cwd):
        d.mkdir()
    before = snapshot(base, skip=(out, tmpdir))
    db = out / "hostile.duckdb"
    proc = run_cli("ingest", str(logs), *map(str, bundles), "--db", str(db), "--workers", "2", tmpdir=tmpdir, cwd=cwd)
    contents = {**folder_contents(logs), **bundle_contents}
    for rel, e in expect.items():
        if not e.exact:
            contents[(str(logs), rel)] = None
    return HostileRun(base, logs, db, tmpdir, cwd, proc, expect, bundles, skips, contents, before, abs_targets)


# -- the hostile folder through the command line ------------------------------------------------

def test_cli_survives_and_prints_no_traceback(hostile):
    p = hostile.proc
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout
    assert "internal error" not in p.stderr
    # terminal escapes in file names are shown, not sent to the terminal
    assert "\x1b" not in p.stderr and "\x07" not in p.stderr
    assert "esc\\x1b]0;pwned\\x07.bin" in p.stderr
    assert "[/yellow]evil[bold].bin" in p.stderr  # markup in a name is printed as written


HOSTILE_INPUTS = [
    "gz/trunc.log.gz", "gz/zero.log.gz", "gz/header_only.log.gz", "gz/garbage_tail.log.gz", "gz/corrupt_middle.log.gz",
    "profiler/rank0.cut.pt.trace.json", "profiler/rank1.syntax.pt.trace.json", "profiler/rank2.types.pt.trace.json",
    "profiler/rank3.cut.pt.trace.json.gz", "profiler/rank4.garbage.pt.trace.json",
    "bin/core.4242", "bin/libnccl-net.so", "bin/zeros.log", "bin/utf16.log",
    "enc/latin1.log", "enc/mixed.log", "enc/nul_inside.log", "enc/zero_tail.log",
    "ends/crlf.log", "ends/cr_only.log", "ends/no_final_newline.log", "ends/only_newlines.log", "ansi/storm.log",
    "empty.log", "links/loop_a", "links/loop_b", "links/dangling.log", "links/outside_dir", "links/outside_file.log",
    "special/pipe.log", "names/[/yellow]evil[bold].bin", "names/esc\x1b]0;pwned\x07.bin",
    "names/\u00fcn\u00ef c\u00f8d\u00e9.log", "names/latin1-\ufffdt\ufffd.log", "big/one_line.log",
    "pickles/reduce_os_system_p2/nccl_trace_rank_0", "pickles/stack_global_exec_p4/nccl_trace_rank_0",
    "pickles/eval_p5/nccl_trace_rank_0", "pickles/ext1_p2/nccl_trace_rank_0", "pickles/persid_p2/nccl_trace_rank_0",
    "pickles/inst_after_proto/nccl_trace_rank_0", "pickles/protocol0_text/nccl_trace_rank_0",
]


def _stderr_lines(hostile, rel: str) -> list[str]:
    from forensics.cli import _UNPRINTABLE

    shown = _UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}", rel)
    return [ln for ln in hostile.proc.stderr.splitlines() if ln.startswith(f"! {shown}:")]


@pytest.mark.parametrize("rel", HOSTILE_INPUTS, ids=ascii)
def test_each_bad_input(hostile, rel):
    """Its `files` row (status, kind) and the message the user got about it."""
    e = hostile.expect[rel]
    got = rel_rows(hostile.db, "SELECT status, kind, message FROM files WHERE root = ? AND path = ?", [str(hostile.logs), rel])
    if e.statuses is None:
        assert got == [], got
    else:
        assert len(got) == 1, got
        status, kind, message = got[0]
        assert status in e.statuses, (status, message)
        assert kind == e.kind, (kind, message)
    said = _stderr_lines(hostile, rel)
    if e.needle is None:
        return
    if e.needle == "empty file":  # empty files are counted in one line, not one line each
        assert any("empty file(s)" in ln for ln in hostile.proc.stderr.splitlines())
        assert got[0][2] == "empty file"
        return
    assert said, f"nothing said about {rel!r}"
    assert any(e.needle in ln for ln in said), said


def test_line_accounting_of_every_text_file(hostile):
    checked = assert_accounting(hostile.db, hostile.contents)
    assert checked >= 30
    # the ones where the content decides: gzip cut off, a zero-filled tail, NULs inside
    got = dict(rel_rows(hostile.db, "SELECT path, lines FROM files WHERE root = ?", [str(hostile.logs)]))
    assert got["gz/trunc.log.gz"] == physical(gunzip_prefix((hostile.logs / "gz/trunc.log.gz").read_bytes())) > 1000
    assert got["gz/garbage_tail.log.gz"] == 3000
    assert 0 < got["gz/corrupt_middle.log.gz"] <= 8000
    assert got["enc/zero_tail.log"] == 51 and got["ends/cr_only.log"] == 1 and got["ends/only_newlines.log"] == 1000


def test_text_content_survives(hostile):
    def lines_of(rel: str) -> list[tuple]:
        return rel_rows(hostile.db, """SELECT line_no, text, l.message FROM lines l JOIN files f USING (file_id)
                                   WHERE f.root = ? AND f.path = ? ORDER BY line_no""", [str(hostile.logs), rel])

    assert [r[1] for r in lines_of("enc/nul_inside.log")] == ["before", "hello\x00world\x00\x00", "after"]
    crlf = lines_of("ends/crlf.log")
    assert [r[1] for r in crlf] == ["first\r", "second\r", "\r", "last without newline\r"]
    assert [r[2] for r in crlf][:2] == ["first", "second"]
    assert lines_of("ends/cr_only.log")[0][2] == "Training:  100%|####| 100/100"  # the bar's last state
    storm = lines_of("ansi/storm.log")
    assert [r[2][-14:] for r in storm[:3]] == ["real message 1", "real message 2", "real message 3"]
    assert not any("\x1b[0m" in r[2] or "title" in r[2] for r in storm[:3])
    mixed = lines_of("enc/mixed.log")
    assert len(mixed) == 8 and mixed[0][1].startswith("utf-8: na\u00efve \u65e5\u672c\u8a9e")
    assert "\ufffd" in mixed[3][1] and mixed[6][1] == "replacement char already: \ufffd"
    assert lines_of("names/latin1-\ufffdt\ufffd.log")[0][1] == "a file whose name is not UTF-8"


def test_50mb_line_is_one_shortened_row(hostile):
    got = rel_rows(hostile.db, """SELECT line_no, byte_offset, octet_length(encode(text)), text[:22], text[-21:]
                              FROM lines l JOIN files f USING (file_id) WHERE f.path = 'big/one_line.log' ORDER BY line_no""")
    assert [r[0] for r in got] == [1, 2, 3]
    assert got[1][2] <= text_mod.MAX_LINE_BYTES
    assert got[1][3] == "HEAD-OF-THE-LONG-LINE " and got[1][4] == " END-OF-THE-LONG-LINE"
    assert got[2][1] == len(b"start of the run\n") + len(b"HEAD-OF-THE-LONG-LINE ") + 50 * MB + len(b" END-OF-THE-LONG-LINE\n")
    problems = rel_rows(hostile.db, "SELECT p.line_no, p.kind, p.message FROM problems p JOIN files f USING (file_id) WHERE f.path = 'big/one_line.log'")
    assert problems == [(2, "warning", f"line 2 is {22 + 50 * MB + 21:,} bytes long: stored its first and last "
                                       f"{text_mod.KEEP_BYTES:,} bytes only")]


def test_nothing_written_outside_the_database(hostile):
    assert hostile.proc.returncode == 0
    after = snapshot(hostile.base, skip=(hostile.base / "out", hostile.tmpdir))
    assert after == hostile.before  # inputs untouched, nothing new next to them (sentinel included)
    assert (hostile.base / "sentinel.txt").read_bytes() == b"sentinel: must stay as it is\n"
    assert list(hostile.tmpdir.iterdir()) == []  # the temporary folder is gone
    assert list(hostile.cwd.iterdir()) == []
    out = {p.name for p in (hostile.base / "out").iterdir()}
    assert out <= {"hostile.duckdb", "hostile.duckdb.wal", "hostile.duckdb.tmp"}, out
    for target in hostile.abs_targets:
        assert not os.path.exists(target), target
    assert not canary_path(hostile.base).exists()


def test_pickles_are_never_run(hostile):
    assert not canary_path(hostile.base).exists()
    got = dict(rel_rows(hostile.db, """SELECT f.path, d.status FROM fr_dumps d JOIN files f USING (file_id)"""))
    assert got["pickles/reduce_os_system_p2/nccl_trace_rank_0"] == "refused"
    assert got["pickles/stack_global_exec_p4/nccl_trace_rank_0"] == "refused"
    assert got["pickles/eval_p5/nccl_trace_rank_0"] == "refused"
    assert got["pickles/inst_after_proto/nccl_trace_rank_0"] == "refused"
    assert got["pickles/persid_p2/nccl_trace_rank_0"] == "refused"
    assert got["pickles/ext1_p2/nccl_trace_rank_0"] in ("refused", "corrupt")
    # nothing of a refused dump is loaded
    assert rel_rows(hostile.db, "SELECT count(*) FROM fr_entries")[0][0] == 0


def test_bundles_keep_their_members_inside(hostile):
    stderr = hostile.proc.stderr
    for bundle, names in hostile.bundle_skips.items():
        said = [ln for ln in stderr.splitlines() if bundle in ln]
        for name in names:
            assert any(name in ln for ln in said), (bundle, name, said)
    got = {(r, p) for r, p in rel_rows(hostile.db, "SELECT root, path FROM files WHERE root <> ?", [str(hostile.logs)])}
    assert (str(hostile.bundles[0]), "run/ok.log") in got and (str(hostile.bundles[1]), "zrun/ok.log") in got
    assert not {p for _, p in got if "escaped" in p or "passwd" in p or "link" in p or "dotdot" in p}
    assert any(r == str(hostile.bundles[2]) for r, _ in got)  # members before the cut were read
    assert rel_rows(hostile.db, "SELECT count(*) FROM lines WHERE text LIKE 'root:%:0:0:%'")[0][0] == 0


def test_query_is_read_only_without_write(hostile, tmp_path):
    db = tmp_path / "copy.duckdb"
    shutil.copy(hostile.db, db)
    before = rows(db, "SELECT count(*) FROM meta")[0][0]
    p = run_cli("query", "INSERT INTO meta VALUES ('owned', 'yes')", "--db", str(db))
    assert p.returncode != 0
    assert "read-only" in p.stderr and "Traceback" not in p.stderr
    assert rows(db, "SELECT count(*) FROM meta")[0][0] == before
    p = run_cli("query", "INSERT INTO meta VALUES ('owned', 'yes')", "--db", str(db), "--write")
    assert p.returncode == 0, p.stderr
    assert rows(db, "SELECT value FROM meta WHERE key = 'owned'") == [("yes",)]


# -- files that are unreadable, change or vanish ---------------------------------------------------

def _small_folder(root: Path, n: int = 6) -> Path:
    root.mkdir(parents=True)
    for i in range(n):
        (root / f"w{i}.log").write_bytes(log_lines(20 + i, f"w{i}"))
    (root / "big.log").write_bytes(log_lines(20000, "big"))  # > 1 MiB: parsed on its own, not batched
    return root


def test_unreadable_files(tmp_path, monkeypatch):
    """As root, mode bits do not stop reads: the failure is simulated where each read
    happens (sniffing at planning, the batch reader, the single-file reader)."""
    root = _small_folder(tmp_path / "logs")
    (root / "at_plan.log").write_text("cannot even sniff me\n")
    denied = {"at_plan.log", "w1.log", "big.log"}
    real_head, real_open = det.read_head, open

    def read_head(path):
        if os.path.basename(path) == "at_plan.log":
            raise PermissionError(13, "Permission denied", path)
        return real_head(path)

    def guarded_open(path, *args, **kwargs):
        if os.path.basename(str(path)) in denied:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(det, "read_head", read_head)
    monkeypatch.setattr(pipeline, "open", guarded_open, raising=False)
    db = tmp_path / "u.duckdb"
    s = pipeline.ingest([str(root)], str(db), workers=1)
    said = "\n".join(s.messages)
    for name in denied:
        assert f"{name}: cannot read (Permission denied)" in said
    got = {p: (st_, k) for p, st_, k in rows(db, "SELECT path, status, kind FROM files")}
    assert all(got[name] == ("skipped", "skipped") for name in denied)
    assert got["w0.log"] == ("ok", "text") and got["w2.log"] == ("ok", "text")
    assert assert_accounting(db, folder_contents(root)) == 5


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode (simulated in test_unreadable_files)")
def test_unreadable_files_real_chmod(tmp_path):
    root = _small_folder(tmp_path / "logs")
    secret = root / "secret.log"
    secret.write_text("no\n")
    secret.chmod(0)
    locked = root / "locked"
    locked.mkdir()
    (locked / "inside.log").write_text("x\n")
    locked.chmod(0)
    try:
        p = run_cli("ingest", str(root), "--db", str(tmp_path / "c.duckdb"), "-q")
    finally:
        locked.chmod(0o755)
    assert p.returncode == 0 and "Traceback" not in p.stderr
    assert "secret.log: cannot read" in p.stderr and "cannot list" in p.stderr


def _wrap_parse_job(monkeypatch, before_parse):
    """Run ``before_parse(job)`` between planning and parsing (workers=1 parses in-process)."""
    real = pipeline.parse_job

    def parse_job(job, spool, debug=False):
        before_parse(job)
        return real(job, spool, debug)

    monkeypatch.setattr(pipeline, "parse_job", parse_job)


def _once(action):
    done = []

    def run(job):
        if not done:
            done.append(action(job))

    return run


def _changed_before_parsing(tmp_path, monkeypatch, target: str, change) -> tuple[Path, Path, Path]:
    """Ingest a folder where ``change(path)`` happens to ``target`` after planning, before
    parsing; the accounting must hold for the file as it was read."""
    root = _small_folder(tmp_path / "logs")
    path = root / target
    _wrap_parse_job(monkeypatch, _once(lambda job: change(path)))
    db = tmp_path / "c.duckdb"
    pipeline.ingest([str(root)], str(db), workers=1)
    monkeypatch.undo()
    assert assert_accounting(db, folder_contents(root)) == 7
    return root, path, db


@pytest.mark.parametrize("target", ["w3.log", "big.log"])
def test_file_appended_between_detection_and_parsing(tmp_path, monkeypatch, target):
    root, path, db = _changed_before_parsing(tmp_path, monkeypatch, target,
                                             lambda p: p.open("ab").write(b"appended after planning\npartial"))
    size, = rows(db, "SELECT bytes FROM files WHERE path = ?", [target])[0]
    assert size == path.stat().st_size  # what was read, not what was planned
    s = pipeline.ingest([str(root)], str(db), workers=1)
    assert s.files_loaded == 0 and s.files_unchanged == 7  # nothing re-read
    path.open("ab").write(b" line done\nnew line\n")
    s = pipeline.ingest([str(root)], str(db), workers=1)
    assert s.files_grown == 1 and s.files_loaded == 1
    assert assert_accounting(db, folder_contents(root)) == 7


@pytest.mark.parametrize("target", ["w3.log", "big.log"])
def test_file_truncated_between_detection_and_parsing(tmp_path, monkeypatch, target):
    root, path, db = _changed_before_parsing(tmp_path, monkeypatch, target, lambda p: p.write_bytes(b"rotated: only this\n"))
    assert rows(db, "SELECT lines, bytes FROM files WHERE path = ?", [target]) == [(1, 19)]
    assert pipeline.ingest([str(root)], str(db), workers=1).files_unchanged == 7


def test_file_changes_while_it_is_read(tmp_path, monkeypatch):
    """A writer appends while the parser streams the file, then truncates it."""
    root = _small_folder(tmp_path / "logs")
    path = root / "big.log"
    real_read = pipeline._ReadGuard.read
    calls = []

    def read(self, n=-1):
        data = real_read(self, n)
        if not calls:
            calls.append(1)
            with open(path, "ab") as fh:  # lands after what was read so far: the parser reads it too
                fh.write(log_lines(500, "late"))
        return data

    monkeypatch.setattr(pipeline._ReadGuard, "read", read)
    db = tmp_path / "w.duckdb"
    pipeline.ingest([str(root)], str(db), workers=1)
    monkeypatch.undo()
    assert assert_accounting(db, folder_contents(root)) == 7
    assert rows(db, "SELECT lines FROM files WHERE path = 'big.log'") == [(20500,)]
    path.write_bytes(log_lines(10, "after rotation"))  # now shorter than what was loaded
    s = pipeline.ingest([str(root)], str(db), workers=1)
    assert s.files_loaded == 1 and s.files_grown == 0
    assert assert_accounting(db, folder_contents(root)) == 7


@pytest.mark.parametrize("target", ["w2.log", "big.log"])
def test_file_vanishes_between_detection_and_parsing(tmp_path, monkeypatch, target):
    root = _small_folder(tmp_path / "logs")
    _wrap_parse_job(monkeypatch, lambda job: (root / target).unlink(missing_ok=True))
    db = tmp_path / "v.duckdb"
    s = pipeline.ingest([str(root)], str(db), workers=1)
    assert any(m.startswith(f"{target}: cannot read (No such file") for m in s.messages), s.messages
    assert rows(db, "SELECT status, kind, lines FROM files WHERE path = ?", [target]) == [("skipped", "skipped", 0)]
    assert assert_accounting(db, folder_contents(root)) == 6


def test_grown_file_that_shrank_before_parsing_is_read_whole(tmp_path, monkeypatch):
    root = _small_folder(tmp_path / "logs", n=1)
    path = root / "big.log"
    db = tmp_path / "s.duckdb"
    pipeline.ingest([str(root)], str(db), workers=1)
    path.open("ab").write(b"grown\n")
    _wrap_parse_job(monkeypatch, lambda job: path.write_bytes(b"replaced\nby a short file\n"))
    pipeline.ingest([str(root)], str(db), workers=1)
    monkeypatch.undo()
    assert rows(db, "SELECT line_no, text FROM lines JOIN files USING (file_id) WHERE path = 'big.log' ORDER BY 1") == [
        (1, "replaced"), (2, "by a short file")]
    assert assert_accounting(db, folder_contents(root)) == 2


@pytest.mark.parametrize("grown", [False, True], ids=["new", "grown"])
def test_big_file_committed_in_pieces_survives_an_interrupt(tmp_path, monkeypatch, grown):
    """A big file's rows go in several transactions (DuckDB holds a transaction's rows
    in memory): an interrupt between two leaves rows without a `files` row, which the
    next ingest must remove before it reads the file again."""
    import functools

    from forensics import parsers
    from forensics.store import Store

    root = _small_folder(tmp_path / "logs", n=2)
    db = tmp_path / "p.duckdb"
    if grown:
        pipeline.ingest([str(root)], str(db), workers=1)
        (root / "big.log").open("ab").write(log_lines(3000, "more"))
    real_parser_for, real_insert = parsers.parser_for, Store.insert_parts
    monkeypatch.setattr(parsers, "parser_for", lambda fmt: functools.partial(text_mod.parse_text, chunk_bytes=64 << 10)
                        if fmt == "text" else real_parser_for(fmt))
    monkeypatch.setattr(pipeline, "PIECE_BYTES", 1)  # every spooled part in its own transaction
    calls = []

    def insert_parts(self, parts):  # big.log comes first (biggest first): its third piece
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_insert(self, parts)

    monkeypatch.setattr(Store, "insert_parts", insert_parts)
    monkeypatch.setattr(pipeline, "make_jobs", lambda tasks: [[t] for t in sorted(tasks, key=lambda t: -t.size)])
    with pytest.raises(KeyboardInterrupt):
        pipeline.ingest([str(root)], str(db), workers=1)
    monkeypatch.undo()
    assert rows(db, "SELECT count(*) FROM files WHERE path = 'big.log'") == [(0,)]
    assert rows(db, "SELECT count(*) FROM lines WHERE file_id NOT IN (SELECT file_id FROM files)")[0][0] > 0
    s = pipeline.ingest([str(root)], str(db), workers=1)
    assert "big.log: its load was interrupted last time; it is read again" in s.messages
    assert rows(db, "SELECT count(*) FROM lines WHERE file_id NOT IN (SELECT file_id FROM files)") == [(0,)]
    assert rows(db, "SELECT count(*) FROM meta WHERE key = 'loading_file'") == [(0,)]
    assert_complete(db, root, 3)


def test_known_file_that_became_empty_or_binary_drops_its_rows(tmp_path):
    """copytruncate log rotation empties a log that was ingested before: its old lines
    must not stay in the database under its name."""
    root = _small_folder(tmp_path / "logs", n=3)
    db = tmp_path / "r.duckdb"
    pipeline.ingest([str(root)], str(db), workers=1)
    (root / "w0.log").write_bytes(b"")
    (root / "w1.log").write_bytes(b"\x7fELF" + bytes(100))
    pipeline.ingest([str(root)], str(db), workers=1)
    got = rows(db, "SELECT f.path, f.status, count(l.line_no) FROM files f LEFT JOIN lines l USING (file_id) GROUP BY ALL")
    assert {(p, s, n) for p, s, n in got if p in ("w0.log", "w1.log")} == {("w0.log", "skipped", 0), ("w1.log", "skipped", 0)}
    assert assert_accounting(db, folder_contents(root)) == 2


def test_database_and_temporary_folders_inside_the_input(tmp_path, monkeypatch):
    """`forensics ingest . --db ./x.duckdb` with TMPDIR inside the folder too: neither the
    database nor the ingest's own temporary files (an extracted bundle) are read."""
    root = _small_folder(tmp_path / "logs", n=2)
    monkeypatch.setattr(pipeline.tempfile, "tempdir", str(root))
    bundle = tmp_path / "b.tar.gz"
    with tarfile.open(bundle, "w:gz") as tf:
        tf.add(root / "w0.log", arcname="inside/w0.log")
    db = root / "x.duckdb"
    pipeline.ingest([str(bundle), str(root)], str(db), workers=1)
    paths = {p for (p,) in rows(db, "SELECT path FROM files WHERE root = ?", [str(root)])}
    assert paths == {"logs/w0.log", "logs/w1.log", "logs/big.log"}  # two PATHs: each path starts with its PATH's name
    assert pipeline.ingest([str(root)], str(db), workers=1).files_unchanged == 3


def test_many_small_files(tmp_path):
    root = tmp_path / "many"
    for i in range(1000):
        d = root / f"node-{i % 7}" / f"session_{i // 250}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"worker-{i:08x}-01000000-{1000 + i}.out").write_bytes(b":job_id:01000000\nline %d\n" % i if i % 3 else b"")
    db = tmp_path / "m.duckdb"
    s = pipeline.ingest([str(root)], str(db), workers=2)
    assert s.files_seen == 1000
    assert rows(db, "SELECT count(*), count(DISTINCT path) FROM files") == [(1000, 1000)]
    assert assert_accounting(db, folder_contents(root)) == 666


# -- failures of the environment and of the code --------------------------------------------------

def test_spool_write_failure_stops_with_a_clear_message(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from forensics import cli

    root = _small_folder(tmp_path / "logs")
    db = tmp_path / "f.duckdb"

    def full(path, table):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pipeline, "write_part", full)
    with pytest.raises(pipeline.IngestError, match="No space left on device"):
        pipeline.ingest([str(root)], str(db), workers=1)
    res = CliRunner().invoke(cli.app, ["ingest", str(root), "--db", str(db), "-j", "1"])
    assert res.exit_code == 2 and "cannot write the temporary file" in res.output
    monkeypatch.undo()
    pipeline.ingest([str(root)], str(db), workers=1)  # the database was left usable
    assert assert_accounting(db, folder_contents(root)) == 7


def test_parser_bug_is_reported_without_traceback_unless_debug(tmp_path, monkeypatch):
    root = _small_folder(tmp_path / "logs", n=2)
    from forensics import parsers

    real = parsers.parser_for

    def parser_for(fmt):
        if fmt == "text":
            def broken(stream, ctx):
                stream.read(10)
                raise ZeroDivisionError("bug in a parser")
                yield  # pragma: no cover

            return broken
        return real(fmt)

    monkeypatch.setattr(parsers, "parser_for", parser_for)
    monkeypatch.setattr(pipeline, "SMALL_FILE", 0)  # every file alone, through parse_one
    s = pipeline.ingest([str(root)], str(tmp_path / "b1.duckdb"), workers=1)
    bug = [m for m in s.messages if "ZeroDivisionError" in m]
    assert bug and not any("Traceback" in m for m in s.messages)
    s = pipeline.ingest([str(root)], str(tmp_path / "b2.duckdb"), workers=1, debug=True)
    assert any("Traceback" in m and "ZeroDivisionError" in m for m in s.messages)


def test_database_that_is_not_a_database(tmp_path):
    from typer.testing import CliRunner

    from forensics import cli

    fake = tmp_path / "notes.duckdb"
    fake.write_text("my notes, not a database\n")
    root = _small_folder(tmp_path / "logs", n=1)
    res = CliRunner().invoke(cli.app, ["ingest", str(root), "--db", str(fake)])
    assert res.exit_code == 2 and "cannot open database" in res.output and "not a valid DuckDB" in res.output
    assert fake.read_text() == "my notes, not a database\n"
    res = CliRunner().invoke(cli.app, ["query", "SELECT 1", "--db", str(fake)])
    assert res.exit_code == 2 and "cannot open database" in res.output


def test_stale_temporary_folders_of_killed_ingests_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline.tempfile, "tempdir", str(tmp_path))
    dead = psutil.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"forensics-{dead.pid}-abc123"
    (stale / "spool-x").mkdir(parents=True)
    (stale / "spool-x" / "part.arrow").write_bytes(b"x" * 1000)
    alive = tmp_path / f"forensics-{os.getppid()}-def456"  # a live process: not touched
    alive.mkdir()
    other = tmp_path / "forensics-notapid"
    other.mkdir()
    root = _small_folder(tmp_path / "logs", n=1)
    pipeline.ingest([str(root)], str(tmp_path / "x.duckdb"), workers=1)
    assert not stale.exists() and alive.exists() and other.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f"forensics-{os.getpid()}-")]


# -- interrupted and concurrent ingests ------------------------------------------------------------

# Runs the real command line, but the progress callback stops mid-way (after ``after``
# files were loaded) and waits for ``go`` to appear: the test interrupts it there or
# lets it go on, whatever the speed of the machine.
PAUSING_CLI = r"""
import faulthandler, os, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung ingest shows where it waits
from forensics import pipeline
marker, go, after = sys.argv[1], sys.argv[2], int(sys.argv[3])
real = pipeline.ingest
def ingest(*args, **kwargs):
    def progress(done, total, rel):
        if done >= after and not os.path.exists(marker):
            with open(marker, "w") as fh:
                fh.write(str(done))
            while not os.path.exists(go):
                time.sleep(0.05)
    kwargs["progress"] = progress
    return real(*args, **kwargs)
pipeline.ingest = ingest
sys.argv = ["forensics"] + sys.argv[4:]
from forensics.cli import main
main()
"""


GZ_FILES = 100


@pytest.fixture(scope="module")
def gz_folder(tmp_path_factory) -> Path:
    """100 gzip logs (each parsed on its own: one job, one progress call per file)."""
    root = tmp_path_factory.mktemp("gzlogs") / "run"
    for i in range(GZ_FILES):
        d = root / f"node-{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"rank{i}.log.gz").write_bytes(gzip.compress(log_lines(400 + i, f"r{i}"), compresslevel=1))
    return root


def interruptible() -> None:
    """``preexec_fn`` of an ingest the test interrupts: SIGINT as a terminal would send it.
    A shell starts background commands with SIGINT ignored, and Python then keeps it
    ignored: a suite run as ``pytest &`` would see the ingest not stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_paused(tmp_path: Path, folder: Path, db: Path, after: int) -> tuple[psutil.Popen, Path, Path, Path]:
    marker, go, tmpdir = tmp_path / "paused", tmp_path / "go", tmp_path / "tmp"
    tmpdir.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    proc = psutil.Popen([sys.executable, "-c", PAUSING_CLI, str(marker), str(go), str(after),
                         "ingest", str(folder), "--db", str(db), "--workers", "2", "-q"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, preexec_fn=interruptible)
    deadline = time.time() + 240
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        assert time.time() < deadline, "the ingest did not get mid-way"
        time.sleep(0.05)
    return proc, go, tmpdir, marker


def ours(tmpdir: Path) -> list[Path]:
    """The ingest's temporary folders in ``tmpdir`` (multiprocessing's own ``pymp-*``
    folder, a socket for the fork server, is left out: Python removes it at exit, and
    a SIGKILL leaves it, empty of data, as it does for any program using forkserver)."""
    return [p for p in tmpdir.iterdir() if not p.name.startswith("pymp-")]


def assert_complete(db: Path, folder: Path, n_files: int) -> None:
    assert rows(db, "SELECT count(*), count(DISTINCT (root, path)), count(DISTINCT file_id) FROM files") == [(n_files,) * 3]
    assert rows(db, "SELECT count(*) - count(DISTINCT (file_id, line_no)) FROM lines") == [(0,)]
    assert assert_accounting(db, folder_contents(folder)) == n_files


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_interrupted_ingest_resumes_without_duplicates(tmp_path, monkeypatch, gz_folder, sig):
    db = tmp_path / "i.duckdb"
    proc, go, tmpdir, marker = start_paused(tmp_path, gz_folder, db, after=70)
    workers = proc.children(recursive=True)
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        status = Path(f"/proc/{proc.pid}/status")
        masks = [ln for ln in status.read_text().splitlines() if ln.startswith(("SigIgn", "SigCgt"))] if status.exists() else []
        proc.send_signal(signal.SIGUSR1)  # its threads' stacks, then end it
        time.sleep(2)
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the interrupted ingest did not end within 120 s ({masks}); its threads:\n" + err.decode()[-6000:])
    err = err.decode()
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err[-2000:]
        assert list(tmpdir.iterdir()) == []  # cleaned up
    else:
        assert proc.returncode == -signal.SIGKILL
        assert [p.name.split("-")[1] for p in ours(tmpdir)] == [str(proc.pid)]  # a killed ingest cannot clean up ...
    gone, alive = psutil.wait_procs(workers, timeout=15)
    assert not alive, "parser processes outlived their ingest"
    committed = rows(db, "SELECT count(*) FROM files")[0][0]  # the database opens
    assert max(0, 70 - pipeline._Batch.MAX_FILES) <= committed <= 70  # whole batches are committed
    assert_accounting(db, folder_contents(gz_folder))  # what was committed is whole
    monkeypatch.setattr(pipeline.tempfile, "tempdir", str(tmpdir))
    s = pipeline.ingest([str(gz_folder)], str(db), workers=1)
    assert s.files_unchanged == committed and s.files_loaded == GZ_FILES - committed
    assert ours(tmpdir) == []  # ... the next one removes its leftovers
    assert_complete(db, gz_folder, GZ_FILES)


def test_interrupt_does_not_wait_for_a_big_files_parse(tmp_path):
    """Ctrl-C while a parser process is in the middle of a big log: the ingest ends at once
    (the parser processes are told to exit), not when that file's parse is done."""
    folder = tmp_path / "big"
    folder.mkdir()
    block = b"".join(f"(TaskRunner pid=4242) step:{i} - actor/loss:0.{i:04d} - actor/lr:1e-06 - perf/mfu:0.41\n"
                     f"(WorkerDict pid=77, ip=10.0.0.2) [rank{i % 8}]:[W312 10:00:{i % 60:02d}.5 ProcessGroupNCCL.cpp:1500] NCCL INFO step {i}\n".encode()
                     for i in range(5_000))
    with open(folder / "driver.log", "wb") as fh:
        for _ in range(80 << 20 // len(block)):  # ~80 MB: several CPU seconds of parsing (4 s left to wait before)
            fh.write(block)
    (folder / "small.log").write_bytes(block[:10_000])
    db = tmp_path / "b.duckdb"
    proc = psutil.Popen([sys.executable, "-m", "forensics", "ingest", str(folder), "--db", str(db), "-q"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=interruptible)
    deadline = time.time() + 120
    busy = 0.0
    while busy < 1.0:  # a parser process has been at it for a second
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        assert time.time() < deadline, "no parser process got busy"
        time.sleep(0.1)
        busy = 0.0
        for child in proc.children(recursive=True):
            try:
                busy = max(busy, child.cpu_times().user)
            except psutil.Error:
                pass
    workers = proc.children(recursive=True)
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    took = time.time() - t0
    assert proc.returncode == 130 and "interrupted" in err.decode(), err.decode()[-2000:]
    assert took < 3.0, f"the interrupted ingest took {took:.1f} s to end"
    gone, alive = psutil.wait_procs(workers, timeout=15)
    assert not alive, "parser processes outlived their ingest"


def interrupt_when(proc, ready, what: str, timeout: float, within: float = 60) -> str:
    """Send SIGINT to ``proc`` once ``ready()``; it must end as interrupted (130), within
    ``within`` seconds of the signal: its stderr."""
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        assert time.time() < deadline, what
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    t0 = time.time()
    try:
        err = proc.communicate(timeout=within)[1].decode()
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"still running {within} s after Ctrl-C") from None
    assert proc.returncode == 130, err[-2000:]
    assert time.time() - t0 < within
    return err


@pytest.mark.parametrize("command", ["query", "diagnose"])
def test_interrupting_a_long_query_is_an_interrupt_not_an_internal_error(tmp_path, command):
    """DuckDB turns Ctrl-C during a query (in the main thread or another) into an error of
    its own: the command must still end as interrupted (130), not as an internal error;
    and at once, not when the statement is done (DuckDB's binding lets it run to its end
    unless the connection is interrupted: ~40 s for this one)."""
    db = tmp_path / "q.duckdb"
    pipeline.ingest([str(FOUNDATION)], str(db), workers=1)
    slow = "SELECT count(*) FROM range(10000000000) t(i) WHERE i % 7 = 3"
    if command == "query":
        argv = ["-m", "forensics", "query", slow, "--db", str(db)]
    else:  # a diagnosis made slow, on its own connection: DuckDB's error reaches the command's caller
        argv = ["-c", "import sys; from forensics import cli; from forensics.diagnosis import matching; "
                f"matching.line_hits = lambda con, cat: con.execute({slow!r}).fetchall(); "
                "sys.argv = ['forensics', 'diagnose', '--db', sys.argv[1]]; cli.main()", str(db)]
    proc = psutil.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=interruptible)
    # started (~1 CPU s) and well into the query (~50 CPU s)
    err = interrupt_when(proc, lambda: sum(proc.cpu_times()[:2]) >= 3.0, "the command did not get into its query", 120,
                         within=15)
    assert "interrupted" in err and "internal error" not in err and "Traceback" not in err, err[-2000:]


def test_interrupting_the_python_api_stops_its_statement_at_once(tmp_path):
    """A notebook's interrupt (SIGINT, Python's default handler) during Run.sql ends the
    call with KeyboardInterrupt at once, not when DuckDB has finished the statement."""
    db = tmp_path / "n.duckdb"
    pipeline.ingest([str(FOUNDATION)], str(db), workers=1)
    slow = "SELECT count(*) FROM range(10000000000) t(i) WHERE i % 7 = 3"
    code = ("import sys, forensics\nrun = forensics.open(sys.argv[1])\n"
            f"try:\n    run.sql({slow!r})\nexcept KeyboardInterrupt:\n    print('interrupted')\n    sys.exit(130)\n")
    proc = psutil.Popen([sys.executable, "-c", code, str(db)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        preexec_fn=interruptible)
    interrupt_when(proc, lambda: sum(proc.cpu_times()[:2]) >= 3.0, "the call did not get into its query", 120, within=15)


def test_interrupt_all_stops_the_statements_of_connections_and_cursors():
    """database.interrupt_all stops what a cursor runs in another thread (DuckDB interrupts
    a cursor apart from its connection), forgets closed connections and leaves idle ones
    usable."""
    import threading

    import duckdb

    from forensics import database

    con = database.connect()
    cur = database.interruptible(con.cursor())
    closed = database.connect()
    closed.close()
    failed: list[BaseException] = []

    def long_query():
        try:
            cur.execute("SELECT count(*) FROM range(10000000000) t(i) WHERE i % 7 = 3").fetchall()
        except duckdb.Error as exc:
            failed.append(exc)

    worker = threading.Thread(target=long_query)
    worker.start()
    time.sleep(0.5)
    t0 = time.time()
    database.interrupt_all()
    worker.join(20)
    assert not worker.is_alive() and time.time() - t0 < 5
    assert failed and "nterrupt" in str(failed[0])
    assert closed not in database._LIVE
    assert con.execute("SELECT 42").fetchall() == [(42,)]


def test_two_ingests_into_one_database(tmp_path, gz_folder):
    db = tmp_path / "c.duckdb"
    first, go, tmpdir, _ = start_paused(tmp_path, gz_folder, db, after=10)
    try:
        second = run_cli("ingest", str(FOUNDATION), "--db", str(db), tmpdir=tmpdir)
        assert second.returncode == 2, second.stderr
        assert "in use by another process" in second.stderr and "Traceback" not in second.stderr
        q = run_cli("query", "SELECT count(*) FROM files", "--db", str(db))
        assert q.returncode == 2 and "in use by another process" in q.stderr and "Traceback" not in q.stderr
    finally:
        go.write_text("go")
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err.decode()[-2000:]
    assert_complete(db, gz_folder, GZ_FILES)


# -- properties of the shared mechanisms (hypothesis) -------------------------------------------------

LINE_BYTES = st.lists(
    st.one_of(
        st.binary(max_size=40),
        st.sampled_from([b"\r", b"\r\n", b"\x00", b"\xff", b"\xe2\x82", b"\xc3\xa9", b"\x1b[31m", b"\xf0\x9f\x94\xa5"]),
        st.builds(lambda c, n: c * n, st.sampled_from([b"a", b"\xc3\xa9", b"\x00"]), st.integers(0, 300)),
    ),
    max_size=30,
).map(lambda parts: b"".join(parts))


def _expected_texts(data: bytes, max_line: int, keep: int) -> list[bytes]:
    body = data[:-1] if data.endswith(b"\n") else data
    if not data:
        return []
    out = []
    for line in body.split(b"\n"):
        out.append(text_mod.shorten_line(line[: keep + 4], line[-keep:], len(line)) if len(line) > max_line else line)
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.lists(LINE_BYTES, max_size=12).map(lambda ls: b"\n".join(ls)), chunk=st.integers(1, 90),
       max_line=st.integers(70, 200))
def test_chunker_counts_every_line_once(data, chunk, max_line):
    """Whatever the chunk size and however long the lines: one row per physical line,
    each at its byte offset, stored whole or (longer than the limit) shortened the
    same way whether the chunker or the splitter met it."""
    keep = (max_line - 64) // 2  # the marker fits in the rest, as with the real limits
    with mock.patch.object(text_mod, "MAX_LINE_BYTES", max_line), mock.patch.object(text_mod, "KEEP_BYTES", keep):
        stream = io.BytesIO(data)
        got, offsets, line_no, offset = [], [], 1, 0
        for piece, size in text_mod.iter_chunks(stream, chunk):
            assert size >= len(piece) > 0
            df, _, _ = text_mod.split_lines(piece, line_no, offset, size)
            got.extend(df["text"].to_list())
            offsets.extend(df["byte_offset"].to_list())
            line_no += df.height
            offset += size
        expected = _expected_texts(data, max_line, keep)
    assert offset == len(data)
    assert len(got) == physical(data)
    assert got == [e.decode("utf-8", "replace") for e in expected]
    starts = ([0] + [i + 1 for i, b in enumerate(data) if b == 0x0A])[: len(got)]
    assert offsets == starts


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.lists(st.one_of(LINE_BYTES, st.sampled_from([
    b"2025-03-14 10:02:11,123 ERROR trainer.py:42 - boom", b"(WorkerDict pid=5300, ip=10.0.0.2) [rank0]: x",
    b"node-a:4101:4101 [0] NCCL WARN oops", b"Traceback (most recent call last):", b'  File "x.py", line 1, in <module>',
    b"step:3 - actor/loss:nan - timing_s/gen:1e400", b'{"step": 1, "actor/loss": NaN}', b"[2025-03-14 10:02:11] kernel: Xid 79",
    b"INFO 03-14 10:02:11 [engine.py:1] stats", b"\x1b[36m(TaskRunner pid=1)\x1b[0m \r50%\r100%"])), max_size=25)
       .map(lambda ls: b"\n".join(ls)), fmt=st.sampled_from(["text", "driver", "nccl_debug", "vllm", "kernel", "metrics_jsonl", "ray_raylet"]))
def test_text_parser_never_raises_and_keeps_every_line(data, fmt):
    """The whole line-format pipeline on hostile bytes: every physical line becomes one
    row, whatever a module recognises or fails to."""
    ctx = FileContext(file_id=1, path=f"x/{fmt}.log", size=len(data), fmt=fmt)
    n = 0
    for name, frame in text_mod.parse_text(io.BytesIO(data), ctx, chunk_bytes=64):
        if name == "lines":
            n += frame.height
    assert n == ctx.lines == physical(data)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(files=st.lists(LINE_BYTES.filter(bool), min_size=2, max_size=6))
def test_batch_equals_single_on_hostile_files(tmp_path_factory, files):
    root = tmp_path_factory.mktemp("batch")
    for i, data in enumerate(files):
        (root / f"f{i}.log").write_bytes(data)
    check_same(root)


@settings(max_examples=300, deadline=None)
@given(head=st.binary(max_size=3000), name=st.sampled_from(["x.log", "a/b/rank3.json", "core", "t.json.gz", "w.jsonl"]))
def test_sniff_never_raises(head, name):
    d = det.sniff(name, head, False, len(head))
    assert d.kind in ("text", "structured", "skipped")
    if d.kind == "skipped":
        assert d.reason


def _parse_trace(data: bytes) -> tuple[int, FileContext]:
    ctx = FileContext(file_id=1, path="rank0.pt.trace.json", size=len(data), fmt="kineto_trace")
    n = 0
    for name, frame in kineto.parse_trace(pipeline._ReadGuard(io.BytesIO(data), ctx), ctx):
        if name == "trace_events":
            n += frame.num_rows if hasattr(frame, "num_rows") else frame.height
    return n, ctx


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut=st.integers(0, 100), flips=st.lists(st.tuples(st.integers(0, 10 ** 6), st.binary(min_size=1, max_size=3)), max_size=4))
def test_kineto_reader_on_cut_and_corrupted_traces(cut, flips):
    trace = bytearray(kineto_trace(60))
    for pos, junk in flips:
        pos %= len(trace)
        trace[pos: pos + len(junk)] = junk
    data = bytes(trace[: len(trace) * cut // 100])
    n, ctx = _parse_trace(data)
    assert 0 <= n <= 60 + 3 * len(flips)  # junk may split an event
    if cut < 100 and not flips:
        assert ctx.truncated


PLAIN = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8), st.binary(max_size=8)),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
                     | st.tuples(inner, inner), max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(value=PLAIN, protocol=st.integers(2, 5), cut=st.integers(0, 100), junk=st.binary(max_size=6))
def test_restricted_unpickler_builds_only_plain_data(value, protocol, cut, junk):
    data = pickle.dumps(value, protocol=protocol)
    data = data[: max(1, len(data) * cut // 100)] + junk
    try:
        obj, _ = fr.load_plain(data)
    except fr.RefusedGlobal:
        return
    except fr._LOAD_ERRORS:
        obj, _, _ = fr.salvage(data)
    _assert_plain(obj)


def _assert_plain(obj, seen: set[int] | None = None) -> None:
    """Only plain values, however nested (a container may hold itself: memo references)."""
    seen = set() if seen is None else seen
    if isinstance(obj, (list, tuple, set, frozenset, dict)):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for v in (obj if not isinstance(obj, dict) else [x for kv in obj.items() for x in kv]):
            _assert_plain(v, seen)
    else:
        assert obj is None or isinstance(obj, (bool, int, float, str, bytes, bytearray)), type(obj)


@pytest.mark.parametrize("name", [n for n in evil_pickles(Path("/nonexistent")) if n != "protocol0_text"])
def test_restricted_unpickler_refuses_every_call(tmp_path, name):
    canary = canary_path(tmp_path)
    data = evil_pickles(canary)[name]
    with pytest.raises((fr.RefusedGlobal, *fr._LOAD_ERRORS)):
        fr.load_plain(data)
    for cut in range(1, len(data)):  # and the reader of cut dumps never runs anything either
        obj, _, _ = fr.salvage(data[:cut])
        _assert_plain(obj)
    assert not canary.exists()


def test_restricted_unpickler_refuses_registered_extensions(tmp_path):
    """EXT opcodes name a global through copyreg's registry: still refused."""
    canary = canary_path(tmp_path)
    copyreg.add_extension("os", "system", 0xF0)
    try:
        data = b"\x80\x02\x82\xf0X" + len(f"touch {canary}").to_bytes(4, "little") + f"touch {canary}".encode() + b"\x85R."
        with pytest.raises(fr.RefusedGlobal, match="os.system"):
            fr.load_plain(data)
    finally:
        copyreg.remove_extension("os", "system", 0xF0)
    assert not canary.exists()


def test_restricted_unpickler_refuses_cached_extensions():
    """An extension code that an ordinary unpickler in the same process already resolved
    sits in copyreg's cache, which pickle reads without asking find_class: refused too."""
    copyreg.add_extension("builtins", "print", 0xF1)
    try:
        assert pickle.loads(b"\x80\x02\x82\xf1.") is print  # fills copyreg._extension_cache
        assert copyreg._extension_cache
        with pytest.raises(fr.RefusedGlobal, match="extension code 241"):
            fr.load_plain(b"\x80\x02\x82\xf1X\x02\x00\x00\x00hi\x85R.")
        fr.load_plain(pickle.dumps({"entries": []}, protocol=2))  # plain dumps still load
    finally:
        copyreg.remove_extension("builtins", "print", 0xF1)


SLOW_IMPORT = """
import pathlib, runpy, sys, time
marker = pathlib.Path(sys.argv[1])

class SlowDuckDB:  # the command's imports, held up where they take the longest
    def find_spec(self, name, path=None, target=None):
        if name == "duckdb":
            marker.write_text("importing")
            time.sleep(60)
        return None

sys.meta_path.insert(0, SlowDuckDB())
sys.argv = ["forensics", "diagnose", "--db", sys.argv[2]]
runpy.run_module("forensics", run_name="__main__")
"""


def test_interrupt_during_the_commands_imports_is_an_interrupt(tmp_path):
    marker = tmp_path / "importing"
    proc = psutil.Popen([sys.executable, "-c", SLOW_IMPORT, str(marker), str(tmp_path / "x.duckdb")],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=interruptible)
    err = interrupt_when(proc, marker.exists, "the command did not get to its imports", 60)
    assert err.strip() == "interrupted", err[-2000:]


def test_the_package_imports_its_api_on_first_use():
    script = ("import sys, forensics; light = 'duckdb' not in sys.modules; "
              "assert callable(forensics.open) and 'duckdb' in sys.modules; print(light)")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr[-2000:]
