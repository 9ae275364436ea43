"""Ingest: walk inputs, detect formats, parse (in a process pool), load DuckDB.

Parsing happens in worker processes that write each table's rows as Arrow IPC
parts into a spool folder; the main process is the only writer of the database and
loads each file's parts in one transaction (a big file's in several: see
forensics.store). Memory stays bounded by the parsers' chunk size, the rows per
transaction and DuckDB's memory limit, not by the size of a file or of the input.

Input is what a dying system wrote: a read that fails ends the file where it failed
(what came before is kept), a file that changes or vanishes between planning and
parsing is taken as it is when read, and no input problem stops the ingest.
"""
from __future__ import annotations

import fnmatch
import hashlib
import multiprocessing
import os
import re
import shutil
import signal
import stat
import tarfile
import tempfile
import threading
import time
import traceback
import zipfile
import zlib
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa

from . import parsers
from .parsers.base import DECOMPRESS_ERRORS, FileContext, JsonArrayRows, Stopped

from . import detect as det
from .gunzip import GunzipReader
from .store import FILES, PROBLEMS, JsonRowsRefused, SettingError, Store, apply_setting, set_memory_limit, write_part

BUNDLE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")
HASH_BLOCK = 1 << 20
TMP_PREFIX = "forensics-"  # the ingest's temporary folder: forensics-<pid>-<random>
DB_THREADS = 1  # DuckDB threads while ingesting (env FORENSICS_DB_THREADS)
DB_CHECKPOINT = "256MB"  # WAL size that triggers a checkpoint while ingesting (env FORENSICS_DB_CHECKPOINT)


class IngestError(RuntimeError):
    """The ingest cannot go on (e.g. its temporary folder cannot be written); the
    message says why, in words. Files committed before it stay in the database."""


class NothingToIngest(IngestError):
    """The PATHs given hold no file (missing, empty, everything excluded)."""


class RunsApart(IngestError):
    """The database holds the runs of other PATHs and the call did not ask to add to it."""


@dataclass
class FileTask:
    file_id: int
    root: str
    rel: str
    abs_path: str
    size: int
    mtime: float
    detected: det.Detected
    start_line: int = 1
    start_offset: int = 0
    replace_from_line: int | None = None  # None: full (re)load
    is_new: bool = True  # no rows of this file_id in the database yet
    prefix: str = ""  # the PATH's name when the database holds several PATHs (files.path starts with it)

    @property
    def stored_path(self) -> str:
        return f"{self.prefix}/{self.rel}" if self.prefix else self.rel


@dataclass
class FileResult:
    task: FileTask
    parts: dict[str, list[str]]
    problems: list[dict]
    lines: int
    unparsed: int
    truncated: bool
    sha256: str
    ends_with_newline: bool
    error: str | None = None
    debug: str | None = None
    bytes_read: int | None = None  # bytes of the file read (and hashed); None: the planned size
    unreadable: str | None = None  # the file could not be opened when it was to be parsed
    handed: list = field(default_factory=list)  # JsonArrayRows the parser left for the store to read


@dataclass
class IngestSummary:
    files_by_format: dict[str, int] = field(default_factory=dict)
    rows_added: dict[str, int] = field(default_factory=dict)
    rows_total: dict[str, int] = field(default_factory=dict)
    unparsed_lines: int = 0
    files_seen: int = 0
    files_loaded: int = 0
    files_unchanged: int = 0
    files_grown: int = 0
    bytes_read: int = 0
    messages: list[str] = field(default_factory=list)  # per-file problems, in words
    runs: list[str] = field(default_factory=list)  # the runs of the PATHs ingested (names, `runs.name`)
    seconds: float = 0.0
    db: str = ""

    def count_rows(self, table: str, n: int) -> None:
        """``n`` more rows added to ``table``."""
        self.rows_added[table] = self.rows_added.get(table, 0) + n

    def add(self, other: "IngestSummary") -> None:
        """Count what ``other`` (one file's accounting) counted, too."""
        for k, v in other.files_by_format.items():
            self.files_by_format[k] = self.files_by_format.get(k, 0) + v
        for k, v in other.rows_added.items():
            self.count_rows(k, v)
        for name in ("unparsed_lines", "files_seen", "files_loaded", "files_unchanged", "files_grown", "bytes_read"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.messages.extend(other.messages)


# -- walking -----------------------------------------------------------------------

def _is_bundle(path: str) -> bool:
    return path.lower().endswith(BUNDLE_SUFFIXES)


def _safe_member_path(dest: Path, name: str) -> Path | None:
    if not name or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return None
    target = (dest / name).resolve()
    try:
        target.relative_to(dest.resolve())
    except ValueError:
        return None
    return target


def _int_setting(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise IngestError(f"{name} must be a whole number, not {raw!r}") from None


MAX_EXTRACT_BYTES = 64 << 30  # one bundle's extracted bytes at most (env FORENSICS_MAX_EXTRACT_BYTES)
MAX_EXTRACT_RATIO = 1000  # extracted bytes per byte of the bundle at most (env FORENSICS_MAX_EXTRACT_RATIO) ...
RATIO_FLOOR = 64 << 20  # ... once it has given this much (a small archive of a repetitive log is no bomb)
MAX_EXTRACT_MEMBERS = 200_000  # members of one bundle at most (env FORENSICS_MAX_EXTRACT_MEMBERS)
EXTRACT_FREE_MARGIN = 1 << 30  # extraction stops before the disk has less than this free
MAX_NESTING = 3  # archives inside archives inside an ingested folder: read this deep


class _ExtractBudget:
    """Bytes a bundle may still write: the configured maximum, at most
    ``MAX_EXTRACT_RATIO`` times the bundle's own size (beyond ``RATIO_FLOOR``), and never
    so much that the temporary folder's disk would fall below ``EXTRACT_FREE_MARGIN`` (a
    compression bomb, or a real bundle too big for the disk, must not fill it)."""

    def __init__(self, dest: Path, bundle_bytes: int | None = None):
        limit = _int_setting("FORENSICS_MAX_EXTRACT_BYTES", MAX_EXTRACT_BYTES)
        free = shutil.disk_usage(dest).free - EXTRACT_FREE_MARGIN
        ratio = _int_setting("FORENSICS_MAX_EXTRACT_RATIO", MAX_EXTRACT_RATIO)
        by_ratio = max(RATIO_FLOOR, ratio * bundle_bytes) if bundle_bytes is not None else limit
        self.left = max(0, min(limit, free, by_ratio))
        if self.left == limit:
            self.why = "the limit FORENSICS_MAX_EXTRACT_BYTES"
        elif self.left == by_ratio:
            self.why = f"{ratio} times its own size (FORENSICS_MAX_EXTRACT_RATIO: a compression bomb?)"
        else:
            self.why = "the free disk space"
        self.members_left = _int_setting("FORENSICS_MAX_EXTRACT_MEMBERS", MAX_EXTRACT_MEMBERS)

    def member(self) -> bool:
        """One more member; False once the bundle has more than allowed."""
        self.members_left -= 1
        return self.members_left >= 0

    def copy(self, src, target: Path) -> bool:
        """Copy ``src`` into ``target``; False (and no file) when the budget runs out."""
        with open(target, "wb") as out:
            while True:
                block = src.read(1 << 20)
                if not block:
                    return True
                if len(block) > self.left:
                    break
                self.left -= len(block)
                out.write(block)
        target.unlink()
        self.left = 0
        return False


def extract_bundle(bundle: str, dest: Path, messages: list[str], shown: str | None = None) -> None:
    """Extract a tar/zip bundle into ``dest``; members that would land outside it
    (absolute paths, ``..``, links pointing out, devices) are skipped and reported.
    Extraction stops, and says so, when it would exceed :class:`_ExtractBudget` (bytes,
    ratio to the bundle's size, members). ``shown``: the bundle's name in messages."""
    name = shown or storable(os.path.basename(bundle))
    budget = _ExtractBudget(dest, os.path.getsize(bundle))

    def stopped(member: str) -> None:
        messages.append(f"{name}: extraction stopped at member {member!r}: the bundle expands beyond {budget.why}; "
                        "that member and the ones after it are not ingested (extract the bundle yourself to read it whole)")

    def too_many(member: str) -> None:
        messages.append(f"{name}: extraction stopped at member {member!r}: the bundle has more than "
                        f"{_int_setting('FORENSICS_MAX_EXTRACT_MEMBERS', MAX_EXTRACT_MEMBERS):,} members "
                        "(FORENSICS_MAX_EXTRACT_MEMBERS); the ones after it are not ingested")
    if bundle.lower().endswith(".zip"):
        with zipfile.ZipFile(bundle) as zf:
            for info in zf.infolist():
                if not budget.member():
                    too_many(info.filename)
                    return
                mode = info.external_attr >> 16
                if stat.S_ISLNK(mode):
                    messages.append(f"{name}: skipped symlink member {info.filename!r}")
                    continue
                target = _safe_member_path(dest, info.filename)
                if target is None:
                    messages.append(f"{name}: skipped member with unsafe path {info.filename!r}")
                    continue
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src:
                    if not budget.copy(src, target):
                        stopped(info.filename)
                        return
        return
    with tarfile.open(bundle, "r:*") as tf:
        for member in tf:
            if not budget.member():
                too_many(member.name)
                return
            try:
                safe = tarfile.data_filter(member, str(dest))
            except tarfile.FilterError as exc:
                messages.append(f"{name}: skipped member {member.name!r} ({exc.__class__.__name__}: {exc})")
                continue
            if safe is None or not (safe.isfile() or safe.isdir()):
                if safe is not None and (safe.issym() or safe.islnk()):
                    messages.append(f"{name}: skipped link member {member.name!r}")
                continue
            target = _safe_member_path(dest, safe.name)
            if target is None:
                messages.append(f"{name}: skipped member with unsafe path {member.name!r}")
                continue
            if safe.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tf.extractfile(safe)
            if src is None:
                continue
            with src:
                if not budget.copy(src, target):
                    stopped(member.name)
                    return


BUNDLE_ERRORS = (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError, zlib.error)


def _is_archive(path: str) -> bool:
    """Whether the file is a tar or zip archive (a ``.tar.gz`` name alone does not say)."""
    try:
        return zipfile.is_zipfile(path) if path.lower().endswith(".zip") else tarfile.is_tarfile(path)
    except (OSError, EOFError, zlib.error, tarfile.TarError):
        return False


def expand_archives(files: Iterator[tuple[str, str]], tmp_root: str, messages: list[str], skip: set[str],
                    depth: int = 0) -> Iterator[tuple[str, str]]:
    """The files of a walk, with each tar/zip archive among them replaced by its members
    (extracted into ``tmp_root`` within :class:`_ExtractBudget`), whose paths start with
    the archive's own (``node2_logs.tar.gz/worker.log``); archives inside those too, up to
    ``MAX_NESTING`` deep. A file named like an archive that is none is read as a file."""
    for abs_path, rel in files:
        if not (_is_bundle(rel) and _is_archive(abs_path)):
            yield abs_path, rel
            continue
        if depth >= MAX_NESTING:
            messages.append(f"{rel}: an archive {depth} archives deep, not extracted")
            continue
        dest = Path(tempfile.mkdtemp(prefix="bundle-", dir=tmp_root))
        try:
            extract_bundle(abs_path, dest, messages, shown=rel)
        except BUNDLE_ERRORS as exc:
            messages.append(f"{rel}: cannot open archive ({exc.__class__.__name__}: {exc}); extracted what could be read")
        inner = ((a, f"{rel}/{r}") for a, r in walk(str(dest), messages, skip))
        yield from expand_archives(inner, tmp_root, messages, skip, depth + 1)


def storable(path: str) -> str:
    """A path as stored and shown: a file name that is not UTF-8 (its bytes come to
    Python as surrogates) gets U+FFFD for the bytes that do not decode."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        return path.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def walk(root: str, messages: list[str], skip: set[str]) -> Iterator[tuple[str, str]]:
    """Yield (absolute path, relative path) of the regular files under ``root``; the
    relative path is :func:`storable`, the absolute one opens the file."""
    root_p = os.path.abspath(root)
    if os.path.isfile(root_p):
        yield root_p, storable(os.path.basename(root_p))
        return
    for dirpath, dirnames, filenames in os.walk(root_p, followlinks=False, onerror=lambda e: messages.append(f"cannot list {storable(e.filename)}: {e.strerror}")):
        dirnames.sort()
        for d in list(dirnames):
            full = os.path.join(dirpath, d)
            if os.path.abspath(full) in skip:  # the database's and the ingest's own temporary folders
                dirnames.remove(d)
            elif os.path.islink(full):
                messages.append(f"{storable(os.path.relpath(full, root_p))}: symlinked folder not followed")
                dirnames.remove(d)
        for fname in sorted(filenames):
            full = os.path.join(dirpath, fname)
            rel = storable(os.path.relpath(full, root_p).replace(os.sep, "/"))
            if os.path.abspath(full) in skip:
                continue
            try:
                st = os.stat(full)  # follows a file symlink
            except OSError as exc:
                messages.append(f"{rel}: cannot read ({exc.strerror or exc})")
                continue
            if not stat.S_ISREG(st.st_mode):
                messages.append(f"{rel}: not a regular file (fifo, socket or device), skipped")
                continue
            yield full, rel


# -- parsing (runs in worker processes) --------------------------------------------

# What the ingest's progress shows while big files are being parsed: the bytes the parsers
# have read so far, counted in a counter the parser processes share with the ingest process
# (a multiprocessing Value, or None when no progress is asked for); in the ingest process a
# hook is called after each read (a file parsed there, in the main thread, is not waited on).
_READ_METER = None
_READ_HOOK: Callable[[], None] | None = None
TICK_S = 0.2  # seconds between two progress reports


def _count_read(n: int) -> None:
    if _READ_METER is not None:
        with _READ_METER.get_lock():
            _READ_METER.value += n
    if _READ_HOOK is not None:
        _READ_HOOK()


class _HashingReader:
    """Wrap a raw file: hash every byte read, remember the last one, count it (_READ_METER).

    A block is counted when the next one is read, i.e. once the parser has moved on from
    it; the last block is never counted here, the file's loading counts the whole file.
    So the progress never reaches the total before the last file is loaded, and two
    parser processes that read their files at the same moment cannot make it jump from 0
    to the end between two reports: files of one block move it as each is loaded, bigger
    ones with every block too."""

    def __init__(self, fh, hasher):
        self.fh, self.hasher, self.last, self.count = fh, hasher, b"", 0
        self.uncounted = 0  # the bytes of the block read last, for the meter

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        if data:
            self.hasher.update(data)
            self.last = data[-1:]
            self.count += len(data)
            if self.uncounted:
                _count_read(self.uncounted)
            self.uncounted = len(data)
        return data

    def readinto(self, b):  # for gzip / io wrappers
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.fh.close()


class _ReadGuard:
    """The stream a parser reads. A read that fails (compressed data cut off or corrupt,
    an I/O error of a dying disk) ends the stream instead of raising, after everything
    decoded before the failure was handed out; the failure becomes a ``truncated``
    problem of the file at once, so the parser sees a clean end of data."""

    def __init__(self, inner, ctx: FileContext):
        self.inner, self.ctx, self.error = inner, ctx, None
        # read1 returns what one decompression step gives; a read(n) that fails midway
        # would drop what it had decoded before the failure
        self._step = getattr(inner, "read1", None) or inner.read
        self.pos = 0

    def read(self, n: int | None = -1) -> bytes:
        if self.error is not None:
            return b""
        if n is None or n < 0:
            return b"".join(iter(lambda: self.read(HASH_BLOCK), b""))
        parts, got = [], 0
        while got < n:
            try:
                block = self._step(n - got)
            except (OSError, *DECOMPRESS_ERRORS) as exc:  # a read error of the file too
                self.error = exc
                self.ctx.truncated = True
                self.ctx.problem(f"stopped reading after {self.pos + got:,} byte(s): {exc.__class__.__name__}: {exc}; "
                                 "what was read before was loaded", None, "truncated")
                break
            if not block:
                break
            parts.append(block)
            got += len(block)
        self.pos += got
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def readable(self) -> bool:
        return True


def parse_one(task: FileTask, spool: str, debug: bool = False, direct: bool = False,
              stopping: Callable[[], bool] | None = None) -> FileResult:
    """Parse one file into Arrow IPC parts under ``spool``; ``direct``: the parser may also
    hand rows over as :class:`JsonArrayRows` (files in ``spool`` too). Never raises, except
    :class:`IngestError` (the spool cannot be written) and :class:`parsers.base.Stopped`
    (``stopping()`` became true during a long read)."""
    d = task.detected
    ctx = FileContext(
        file_id=task.file_id, path=task.rel, size=task.size, fmt=d.format,
        start_line=task.start_line, start_offset=task.start_offset,
        node=d.node, pid=d.pid, rank=d.rank, actor=d.actor, scratch=spool if direct else None, stopping=stopping,
    )
    parts: dict[str, list[str]] = {}
    handed: list[JsonArrayRows] = []
    hasher = hashlib.sha256()
    try:
        raw = open(task.abs_path, "rb")
    except OSError as exc:  # vanished or made unreadable since it was planned
        return FileResult(task, {}, [], 0, 0, False, "", False, unreadable=f"cannot read ({exc.strerror or exc})")
    sha, ends_nl, error, dbg = "", False, None, None
    with raw:
        reader = _HashingReader(raw, hasher)
        try:
            parse = parsers.parser_for(d.format)
            if parse is None:
                raise LookupError(f"no parser for format {d.format}")
            if task.start_offset and not d.compressed:
                # a grown file: hash the old prefix too (the store compares it)
                while reader.count < task.start_offset and reader.read(min(HASH_BLOCK, task.start_offset - reader.count)):
                    pass
                if reader.count < task.start_offset:  # it shrank since it was planned: read it all again
                    raw.seek(0)
                    hasher = reader.hasher = hashlib.sha256()
                    reader.count = 0
                    task.start_line, task.start_offset, task.replace_from_line = 1, 0, None
                    ctx.start_line, ctx.start_offset = 1, 0
            inner = GunzipReader(reader) if d.compressed else reader
            stream = _ReadGuard(inner, ctx)
            _spool(parse(stream, ctx), spool, f"{task.file_id}", parts, handed)
            # read what the parser left, so the hash covers the whole file
            while reader.read(HASH_BLOCK):
                pass
            ends_nl = reader.last == b"\n" if not d.compressed else True
            sha = hasher.hexdigest()
        except IngestError:
            raise
        except OSError as exc:  # the raw file failed while reading the rest for the hash
            ctx.truncated = True
            ctx.problem(f"stopped reading: {exc.__class__.__name__}: {exc}", None, "truncated")
        except Exception as exc:  # a parser bug: report it for this file, go on with the others
            error = f"{exc.__class__.__name__}: {exc}"
            dbg = traceback.format_exc()
            sha = _file_sha_or_empty(task.abs_path)
    problems = [
        {"file_id": task.file_id, "line_no": p.line_no, "kind": p.kind, "message": p.message}
        for p in ctx.problems
    ]
    if error:
        _drop_handed(handed)
        handed = []
    return FileResult(task, parts, problems, ctx.lines, ctx.unparsed_lines, ctx.truncated, sha, ends_nl, error, dbg,
                      bytes_read=reader.count, handed=handed)


def _spool(frames, spool: str, prefix: str, parts: dict[str, list[str]], handed: list | None = None) -> None:
    """Write each (table, frame) a parser yields as an Arrow IPC part under ``spool``;
    rows handed over as :class:`JsonArrayRows` go to ``handed``."""
    from .store import all_tables

    tables = {t.name: t for t in all_tables()}
    for name, frame in frames:
        if isinstance(frame, JsonArrayRows):
            if handed is None:
                raise TypeError(f"{name}: rows handed over as JSON where no scratch folder was given")
            handed.append(frame)
            continue
        table = tables.get(name)
        if table is None:
            raise KeyError(f"parser produced rows for unknown table {name!r}")
        arrow = table.conform(frame)
        if arrow.num_rows == 0:
            continue
        path = os.path.join(spool, f"{prefix}-{sum(map(len, parts.values())):06d}-{name}.arrow")
        try:
            write_part(path, arrow)
        except OSError as exc:  # disk full, temporary folder removed: no file can be loaded
            raise IngestError(f"cannot write the temporary file {path}: {exc.strerror or exc}") from None
        parts.setdefault(name, []).append(path)


def _remove(paths) -> None:
    """Remove spooled files (one already gone is fine)."""
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _drop_handed(handed: list) -> None:
    _remove(p for h in handed for p in (h.array_path, h.lines_path))


@dataclass
class JobResult:
    """Parsed files and the parts holding their rows (shared when files were batched).
    ``loaded``: the accounting of a direct file that is in the database already."""

    results: list[FileResult]
    parts: dict[str, list[str]]
    loaded: IngestSummary | None = None


def direct(task: FileTask) -> bool:
    """Parse ``task`` in a thread of the ingest and let DuckDB read its rows (a new file of
    a format whose parser can hand them over, ``Format.direct``, only: its rows go in a
    transaction of their own, with its ``files`` row). Env FORENSICS_DIRECT=0: never."""
    fmt = parsers.format_named(task.detected.format)
    return (fmt is not None and fmt.direct and task.is_new and task.start_offset == 0
            and os.environ.get("FORENSICS_DIRECT", "1") != "0")


def run_direct(job: list[FileTask], spool: str, debug: bool, store: Store, cur,
               stopping: Callable[[], bool] | None = None) -> JobResult:
    """Parse a direct file (in a thread of the ingest) and load it on ``cur``, a cursor of
    ``store`` (which the caller closes): the rows its parser handed over, its other rows,
    problems and ``files`` row, in one transaction. When DuckDB does not give exactly the
    rows the parser would (see :meth:`Store.insert_json_rows`), the transaction is
    rolled back and the file parsed the usual way, here, for ``finish`` to load.

    Once ``stopping()`` is true (the ingest is being interrupted), it raises
    :class:`parsers.base.Stopped` at the next step instead of going on: the copy stops,
    no insert starts (an insert already running is interrupted by the caller), and nothing
    is committed; the caller rolls back what the transaction holds."""
    def check() -> None:
        if stopping is not None and stopping():
            raise Stopped(f"{task.rel}: the ingest is being stopped")

    (task,) = job
    res = parse_one(task, spool, debug, direct=True, stopping=stopping)
    if not res.handed:  # the parser decoded it itself (cut off, unusual layout) or failed
        return JobResult([res], _kept_parts([res]))
    loaded = IngestSummary()
    try:
        check()
        cur.execute("BEGIN TRANSACTION")
        for h in res.handed:
            loaded.count_rows(h.table, store.insert_json_rows(h, cur))
    except JsonRowsRefused as exc:
        cur.execute("ROLLBACK")
        _drop_parts(res.parts)
        again = parse_one(task, spool, debug)
        if debug:
            again.problems.append({"file_id": task.file_id, "line_no": None, "kind": "warning",
                                   "message": f"(--debug) DuckDB's JSON reader did not take it ({exc}); parsed the usual way"})
        return JobResult([again], _kept_parts([again]))
    except BaseException:  # stopped, interrupted, failed: its other rows go too
        _drop_parts(res.parts)
        raise
    finally:
        _drop_handed(res.handed)
    try:
        check()
        row, problem_rows = _load(store, res, loaded, debug)
        for name, n in store.insert_parts(res.parts, con=cur).items():
            loaded.count_rows(name, n)
        store.insert_rows(PROBLEMS, problem_rows, con=cur)
        store.insert_rows(FILES, [row], con=cur)
        cur.execute("COMMIT")
    finally:
        _drop_parts(res.parts)
    for name, n in ((PROBLEMS.name, len(problem_rows)), (FILES.name, 1)):
        loaded.count_rows(name, n)
    return JobResult([res], {}, loaded=loaded)


SMALL_FILE = 1 << 20  # text files up to this size are parsed in batches
BATCH_BYTES = 8 << 20
BATCH_FILES = 2000


def batchable(task: FileTask) -> bool:
    d = task.detected
    # a text format is read by the splitter, which takes many small files in one frame
    return d.kind == "text" and not d.compressed and task.size <= SMALL_FILE and task.start_offset == 0


def make_jobs(tasks: list[FileTask]) -> list[list[FileTask]]:
    """Big or special files alone; small text files grouped into batches."""
    jobs: list[list[FileTask]] = []
    current: list[FileTask] = []
    size = 0
    for task in sorted(tasks, key=lambda t: -t.size):
        if not batchable(task):
            jobs.append([task])
            continue
        current.append(task)
        size += task.size
        if size >= BATCH_BYTES or len(current) >= BATCH_FILES:
            jobs.append(current)
            current, size = [], 0
    if current:
        jobs.append(current)
    return jobs


BATCH_READ_LIMIT = 2 * SMALL_FILE  # a batched file read bigger than this grew since it was planned


def parse_job(job: list[FileTask], spool: str, debug: bool = False) -> JobResult:
    """Parse one job (runs in a worker process). Never raises, except :class:`IngestError`."""
    if len(job) == 1:
        res = parse_one(job[0], spool, debug)
        return JobResult([res], _kept_parts([res]))
    from .parsers.text import parse_text_batch

    sources, results, alone = [], [], []
    for task in job:
        try:
            with open(task.abs_path, "rb") as fh:
                data = fh.read(BATCH_READ_LIMIT + 1)  # not metered: read before any is parsed, counted when loaded
        except OSError:
            alone.append(task)  # vanished or unreadable: parse_one reports it
            continue
        if len(data) > BATCH_READ_LIMIT:
            alone.append(task)  # grew a lot since it was planned: streamed on its own
            continue
        d = task.detected
        ctx = FileContext(file_id=task.file_id, path=task.rel, size=task.size, fmt=d.format,
                          node=d.node, pid=d.pid, rank=d.rank, actor=d.actor)
        sources.append((data, ctx))
        results.append(FileResult(task, {}, [], 0, 0, False, hashlib.sha256(data).hexdigest(), data.endswith(b"\n"),
                                  bytes_read=len(data)))
    parts: dict[str, list[str]] = {}
    try:
        _spool(parse_text_batch(sources), spool, f"b{job[0].file_id}", parts)
    except IngestError:
        raise
    except Exception:
        # a parser bug on some file of the batch: parse each file on its own so that it
        # only fails itself
        for paths in parts.values():
            for p in paths:
                os.unlink(p)
        parts, results, alone = {}, [], list(job)
    for res, (_, ctx) in zip(results, sources):
        res.lines, res.unparsed = ctx.lines, ctx.unparsed_lines
        res.problems = [{"file_id": ctx.file_id, "line_no": p.line_no, "kind": p.kind, "message": p.message} for p in ctx.problems]
    singles = [parse_one(t, spool, debug) for t in alone]
    for name, paths in _kept_parts(singles).items():
        parts.setdefault(name, []).extend(paths)
    return JobResult(results + singles, parts)


def _drop_parts(parts: dict[str, list[str]]) -> None:
    _remove(p for paths in parts.values() for p in paths)


def _kept_parts(results: list[FileResult]) -> dict[str, list[str]]:
    """The parts of the files that parsed; a file whose parser failed loads no rows
    (its part files are removed)."""
    merged: dict[str, list[str]] = {}
    for r in results:
        for k, v in r.parts.items():
            if r.error:
                for p in v:
                    os.unlink(p)
            else:
                merged.setdefault(k, []).extend(v)
    return merged


# -- orchestration -----------------------------------------------------------------

def _prefix_sha(path: str, nbytes: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        remaining = nbytes
        while remaining > 0:
            block = fh.read(min(HASH_BLOCK, remaining))
            if not block:
                break
            h.update(block)
            remaining -= len(block)
    return h.hexdigest()


def _file_sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(HASH_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def _file_sha_or_empty(path: str) -> str:
    """Hash of the whole file after a failed parse (so an unchanged file is not retried)."""
    try:
        return _file_sha(path)
    except OSError:
        return ""


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=timezone.utc).replace(tzinfo=None)


def plan(store: Store, root: str, abs_path: str, rel: str, next_id: Callable[[], int], summary: IngestSummary,
         known_files: dict, prefix: str = "") -> FileTask | dict | None:
    """Decide what to do with one file: a FileTask to parse, a skipped-file row, or
    None when it is already in the database unchanged."""
    try:
        st = os.stat(abs_path)
        d = det.detect(abs_path, rel, st.st_size)
    except OSError as exc:
        summary.messages.append(f"{rel}: cannot read ({exc.strerror or exc})")
        d = det.Detected("unreadable", "skipped", reason=f"cannot read: {exc.strerror or exc}")
        st = None
    known = known_files.get(rel)
    if d.kind == "skipped":
        if known and known.format == d.format and st is not None and known.bytes == st.st_size:
            return None
        if d.format not in ("empty",):
            summary.messages.append(f"{rel}: skipped, {d.reason}")
        return {
            "file_id": known.file_id if known else next_id(), "root": root, "path": f"{prefix}/{rel}" if prefix else rel, "format": d.format,
            "kind": "skipped", "compressed": d.compressed, "bytes": st.st_size if st else None, "lines": 0,
            "ends_with_newline": None, "unparsed_lines": 0, "parse_errors": 0 if d.format == "empty" else 1,
            "truncated": False, "sha256": None, "mtime": _utc(st.st_mtime) if st else None, "node": d.node,
            "pid": d.pid, "rank": d.rank, "actor": d.actor, "status": "skipped", "message": d.reason,
            "ingested_at": _utc(time.time()),
        }
    task = FileTask(next_id() if known is None else known.file_id, root, rel, abs_path, st.st_size, st.st_mtime, d,
                    is_new=known is None, prefix=prefix)
    if known is None:
        return task
    if known.bytes == st.st_size and known.sha256 and _file_sha(abs_path) == known.sha256:
        return None
    if (
        d.kind == "text" and not d.compressed and known.kind == "text" and known.sha256
        and st.st_size > known.bytes and _prefix_sha(abs_path, known.bytes) == known.sha256
    ):
        # grown log: parse only the new part (re-read the last line if it was unterminated)
        if known.ends_with_newline or known.lines == 0:
            task.start_line, task.start_offset = known.lines + 1, known.bytes
        else:
            off = store.last_line_offset(known.file_id, known.lines)
            task.start_line, task.start_offset = known.lines, off if off is not None else 0
            if off is None:
                task.start_line = 1
        task.replace_from_line = task.start_line if task.start_line > 1 else None
        summary.files_grown += 1
        return task
    return task


def excluded(rel: str, exclude: list[str] | None) -> bool:
    """Whether ``rel`` (or its name) matches one of the ``exclude`` globs."""
    return bool(exclude) and any(fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(rel.rsplit("/", 1)[-1], pat) for pat in exclude)


def plan_files(store, root: str, files: Iterator[tuple[str, str]], known_files: dict, next_id: Callable[[], int],
               summary: IngestSummary, exclude: list[str] | None, tasks: list[FileTask], skipped_rows: list[dict],
               prefix: str = "") -> None:
    """:func:`plan` each (absolute path, relative path) of ``files`` under ``root``: files to
    parse go to ``tasks``, files not parsed (empty, binary, unreadable) to ``skipped_rows``.
    ``store`` is only asked for :meth:`Store.last_line_offset` (a grown file whose last line
    was cut): an engine that plans where no database is open passes an object that has it."""
    for abs_path, rel in files:
        if excluded(rel, exclude):
            continue
        summary.files_seen += 1
        decision = plan(store, root, abs_path, rel, next_id, summary, known_files, prefix)
        if decision is None:
            summary.files_unchanged += 1
        elif isinstance(decision, dict):
            skipped_rows.append(decision)
            summary.files_by_format[decision["format"]] = summary.files_by_format.get(decision["format"], 0) + 1
        else:
            tasks.append(decision)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def make_tmp_root() -> str:
    """The ingest's temporary folder (extracted bundles, spooled parts). Folders left by
    ingests that were killed before they could clean up (SIGKILL, power loss) are
    removed first: their name carries the pid of their ingest, which is gone."""
    base = tempfile.gettempdir()
    try:
        names = os.listdir(base)
    except OSError:
        names = []
    for name in names:
        m = re.fullmatch(re.escape(TMP_PREFIX) + r"(\d+)-\w+", name)
        full = os.path.join(base, name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-", dir=base)


def open_writer(db: str, defer_views: bool = True) -> Store:
    """The database opened as the ingest's single writer, with the ingest's DuckDB settings
    (``defer_views``: the views are made at :meth:`Store.finish_schema`, while the parsers
    start). A setting DuckDB refuses is an :class:`IngestError`."""
    settings = [
        # one writer thread: the parser processes need the cores, and DuckDB writes each
        # insert as full row groups instead of one partial group per thread (measured on
        # 105 MB of logs: 1.5 s instead of 2.5-4.4 s, and a database half the size)
        ("threads", "FORENSICS_DB_THREADS", _int_setting("FORENSICS_DB_THREADS", DB_THREADS)),
        # checkpoint (compress the WAL into the table) every 256 MB of WAL, not DuckDB's 16 MB
        ("checkpoint_threshold", "FORENSICS_DB_CHECKPOINT", os.environ.get("FORENSICS_DB_CHECKPOINT", DB_CHECKPOINT)),
    ]
    store = Store(db, defer_views=defer_views)
    try:
        set_memory_limit(store.con)
        for key, env, value in settings:
            apply_setting(store.con, key, env, value)
    except SettingError as exc:
        store.close()
        raise IngestError(str(exc)) from None
    except BaseException:
        store.close()
        raise
    return store


def ingest(
    paths: list[str],
    db: str = "forensics.duckdb",
    workers: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    debug: bool = False,
    exclude: list[str] | None = None,
    add: bool = False,
) -> IngestSummary:
    """Ingest folders, files and bundles into the DuckDB database ``db``.

    ``exclude``: glob patterns; a file whose relative path or name matches one is not read.
    ``add``: a database that holds the runs of other PATHs takes these PATHs beside them
    (without it that raises :class:`RunsApart`; the same PATHs again are always fine).
    Raises :class:`NothingToIngest` when the PATHs hold no file to read; a database made
    for the call is then removed.
    """
    t0 = time.perf_counter()
    if not any(os.path.exists(p) for p in paths):
        raise NothingToIngest("nothing to ingest: " + "; ".join(f"{storable(p)}: no such file or folder" for p in paths))
    db_existed = os.path.exists(db)
    summary = IngestSummary(db=str(db))
    summary.messages.extend(parsers.problems())  # format packages left out, and why
    store = open_writer(db)
    workers = workers or os.cpu_count() or 1
    db_abs = os.path.abspath(db)
    tmp_root = make_tmp_root()
    skip = {db_abs, db_abs + ".wal", db_abs + ".tmp", os.path.abspath(tmp_root)}
    try:
        for rel in store.drop_unfinished_files():
            summary.messages.append(f"{rel}: its load was interrupted last time; it is read again")
        id_counter = [store.next_file_id()]
        first_new_id = id_counter[0]

        def next_id() -> int:
            v = id_counter[0]
            id_counter[0] += 1
            return v

        tasks: list[FileTask] = []
        skipped_rows: list[dict] = []
        given_roots = _given_roots(paths, summary)
        held = store.path_runs()
        new_roots = [r for r in given_roots if r not in held]
        if held and new_roots and not add:
            raise RunsApart(_refusal(db, held, new_roots))

        def excluded(rel: str) -> bool:
            return bool(exclude) and any(fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(rel.rsplit("/", 1)[-1], pat) for pat in exclude)

        found: dict[str, list[tuple[str, str]]] = {}  # root -> its files (absolute, relative)
        for root, walk_root in given_roots.items():
            if os.path.isfile(walk_root) and _is_bundle(walk_root):
                dest = Path(tempfile.mkdtemp(prefix="bundle-", dir=tmp_root))
                try:
                    extract_bundle(walk_root, dest, summary.messages)
                except BUNDLE_ERRORS as exc:
                    summary.messages.append(f"{root}: cannot open bundle ({exc.__class__.__name__}: {exc}); extracted what could be read")
                walk_root = str(dest)
            walked = [0]

            def counted(pairs):
                for pair in pairs:
                    walked[0] += 1
                    yield pair
            outer = ((a, r) for a, r in counted(walk(walk_root, summary.messages, skip)) if not excluded(r))
            files = [(a, r) for a, r in expand_archives(outer, tmp_root, summary.messages, skip) if not excluded(r)]
            if files:
                found[root] = files
            else:
                summary.messages.append(f"{root}: no file to read in it" + (" (every file excluded)" if walked[0] else ""))
        if not found:
            said = [m for m in summary.messages if m.endswith(("no such file or folder", "no file to read in it", "(every file excluded)"))]
            raise NothingToIngest("nothing to ingest: " + "; ".join(said))
        with store.transaction():
            for root in found:
                if root not in held:
                    store.add_path_run(root)
            if len(store.path_runs()) > 1:
                store.ensure_prefixes()
        for root, files in found.items():
            prefix = store.path_prefix(root) or ""
            known_files = store.known_files(root)
            plan_files(store, root, files, known_files, next_id, summary, None, tasks, skipped_rows, prefix)
        empties = sum(1 for row in skipped_rows if row["format"] == "empty")
        if empties:  # common (Ray writes many empty .err files): one line for all of them
            summary.messages.append(f"{empties} empty file(s) skipped (status 'skipped', message 'empty file' in `files`)")
        if skipped_rows:
            with store.transaction():
                for row in skipped_rows:
                    if row["file_id"] < first_new_id:  # known, now empty/binary/unreadable: its old rows go
                        store.delete_file_rows(row["file_id"], None)
                    store.record_skipped(row)
            summary.count_rows(FILES.name, sum(1 for row in skipped_rows if row["file_id"] >= first_new_id))
        spool = tempfile.mkdtemp(prefix="spool-", dir=tmp_root)
        batch = _Batch(store)
        total = sum(t.size for t in tasks)  # progress is in bytes: one big file moves the bar too
        done = 0
        last_rel = [""]
        jobs = make_jobs(tasks)  # biggest first keeps the pool busy
        meter = multiprocessing.get_context("forkserver").Value("q", 0) if progress else None
        ticked = [0.0]

        def tick(rel: str | None = None, force: bool = False) -> None:
            """Report the bytes read so far (by the parsers, or of the files loaded)."""
            now = time.monotonic()
            if not force and now - ticked[0] < TICK_S:
                return
            ticked[0] = now
            last_rel[0] = rel or last_rel[0]
            progress(min(total, max(done, meter.value)), total, last_rel[0])

        if progress:
            progress(0, total, "")  # the size is known before the first file is read

        def finish(job: JobResult) -> None:
            nonlocal done
            done += sum(res.task.size for res in job.results)
            load_job(store, batch, job, summary, debug)
            if progress:
                tick(job.results[-1].task.rel, force=True)

        is_direct = [len(job) == 1 and direct(job[0]) for job in jobs]
        direct_jobs = [job for job, d in zip(jobs, is_direct) if d]
        jobs = [job for job, d in zip(jobs, is_direct) if not d]
        try:
            _run_jobs(jobs, spool, workers, debug, finish, idle=store.finish_schema, direct_jobs=direct_jobs,
                      run_direct=lambda job, cur, stopping: run_direct(job, spool, debug, store, cur, stopping),
                      cursor=store.con.cursor, meter=meter, tick=tick if progress else None)
            batch.close()
            store.finish_schema()  # when there was nothing to parse
        except BaseException:
            batch.abort()
            raise
        with store.transaction():
            for root in found:
                store.assign_runs(root)
        summary.runs = store.run_names(list(found))
        store.fix_yearless_timestamps()
        summary.rows_total = store.table_counts()
        # the parsers are done: the closing checkpoint (rows still in the WAL compressed
        # into the tables) may use the cores they had (measured on 315 MB of logs: 2.0-2.7 s
        # of wall time instead of 2.6-3.3)
        (threads_now,) = store.con.execute("SELECT current_setting('threads')").fetchone()
        store.con.execute(f"SET threads = {max(workers, int(threads_now))}")
    except NothingToIngest:
        store.close()
        if not db_existed:  # made for this call: nothing is left behind
            for leftover in (db, f"{db}.wal"):
                if os.path.exists(leftover):
                    os.unlink(leftover)
        raise
    finally:
        store.close()
        shutil.rmtree(tmp_root, ignore_errors=True)
    summary.seconds = time.perf_counter() - t0
    return summary


def _given_roots(paths: list[str], summary: IngestSummary) -> dict[str, str]:
    """The PATHs that exist: root as stored in ``files.root`` -> absolute path; the others
    are said in the summary."""
    roots: dict[str, str] = {}
    for given in paths:
        if not os.path.exists(given):
            summary.messages.append(f"{storable(given)}: no such file or folder")
            continue
        walk_root = os.path.abspath(given)
        roots.setdefault(storable(walk_root), walk_root)
    return roots


def _refusal(db: str, held: dict[str, tuple[int, str, str | None]], new_roots: list[str]) -> str:
    (first_root, (_, first_name, _)), *more = held.items()
    also = f" (and {len(more)} other run(s))" if more else ""
    return (f"{os.path.basename(db) or db} already holds run {first_name!r} from {first_root}{also}; "
            f"pass --db FILE to keep runs apart, or --add to ingest {new_roots[0]} beside it "
            "(then `diagnose`/`report` --run picks one)")


def part_size(part) -> int:
    """Bytes of one part: an Arrow IPC file spooled here (a path), or what another engine
    hands over: an Arrow table in memory, or an object with ``nbytes`` and ``read()`` that
    reads its table when it is loaded (a Parquet part elsewhere)."""
    return os.path.getsize(part) if isinstance(part, str) else part.nbytes


def load_job(store: Store, batch: "_Batch", job: JobResult, summary: IngestSummary, debug: bool = False) -> None:
    """Load one parsed job into ``store`` (the single writer), in ``batch``'s open
    transaction; a big file's rows in several (see :meth:`Store.mark_loading`). Its parts
    are spooled Arrow IPC files (removed once loaded) or Arrow tables."""
    if job.loaded is not None:  # a direct file, committed by its thread
        summary.add(job.loaded)
        return
    batch.ensure()
    file_rows, problem_rows = [], []
    for res in job.results:
        row, probs = _load(store, res, summary, debug)
        file_rows.append(row)
        problem_rows.extend(probs)
    pieces = _pieces(job.parts, PIECE_BYTES)
    if len(pieces) > 1:  # a big file: its rows go in several transactions
        store.mark_loading(job.results[0].task.file_id, job.results[0].task.rel)
    counts: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        if i:
            batch.close()
            batch.ensure()
        for k, v in store.insert_parts(piece).items():
            counts[k] = counts.get(k, 0) + v
    if len(pieces) > 1:
        store.finish_loading(job.results[0].task.file_id)
    store.insert_rows(PROBLEMS, problem_rows)  # with the last rows: the file is whole
    store.insert_rows(FILES, file_rows)
    counts[PROBLEMS.name] = counts.get(PROBLEMS.name, 0) + len(problem_rows)
    # a changed or grown file's row is replaced, not added
    counts[FILES.name] = counts.get(FILES.name, 0) + sum(1 for res in job.results if res.task.is_new)
    for k, v in counts.items():
        summary.count_rows(k, v)
    batch.add(len(job.results), sum(counts.values()), sum(part_size(p) for paths_ in pieces[-1].values() for p in paths_))
    for paths_ in job.parts.values():
        for p in paths_:
            if isinstance(p, str):
                try:
                    os.unlink(p)
                except OSError:
                    pass


PIECE_BYTES = 64 << 20  # spooled rows per transaction: DuckDB holds them in memory until the commit


def _pieces(parts: dict[str, list], limit: int) -> list[dict[str, list]]:
    """``parts`` cut into groups of about ``limit`` bytes of spooled rows (at least one)."""
    pieces: list[dict[str, list]] = [{}]
    held = 0
    for name, paths in parts.items():
        for p in paths:
            size = part_size(p)
            if held and held + size > limit:
                pieces.append({})
                held = 0
            pieces[-1].setdefault(name, []).append(p)
            held += size
    return pieces


class _Batch:
    """Group small files into one transaction (commit every few files / rows /
    spooled bytes / seconds): each commit is atomic, so an interrupted ingest loses
    at most the uncommitted group, and a re-run redoes exactly those files. (A big
    file is committed in pieces: see Store.mark_loading.)"""

    # Few big commits: a small one makes DuckDB log its rows to the WAL and checkpoint
    # often, which cost 3x the CPU of the insert itself on 105 MB of small files.
    MAX_FILES, MAX_ROWS, MAX_SECONDS = 2000, 500_000, 10.0

    def __init__(self, store: Store):
        self.store = store
        self.open = False
        self.files = self.rows = self.nbytes = 0
        self.t0 = 0.0

    def ensure(self) -> None:
        if not self.open:
            self.store.begin()
            self.open, self.files, self.rows, self.nbytes, self.t0 = True, 0, 0, 0, time.perf_counter()

    def add(self, files: int, rows: int, nbytes: int = 0) -> None:
        self.files += files
        self.rows += rows
        self.nbytes += nbytes
        if (self.files >= self.MAX_FILES or self.rows >= self.MAX_ROWS or self.nbytes >= PIECE_BYTES
                or time.perf_counter() - self.t0 > self.MAX_SECONDS):
            self.close()

    def close(self) -> None:
        if self.open:
            self.store.commit()
            self.open = False

    def abort(self) -> None:
        if self.open:
            self.open = False
            self.store.rollback()


def _run_jobs(jobs: list[list[FileTask]], spool: str, workers: int, debug: bool, finish: Callable[[JobResult], None],
              idle: Callable[[], None] = lambda: None, direct_jobs: list[list[FileTask]] = (),
              run_direct: Callable | None = None, cursor: Callable | None = None,
              meter=None, tick: Callable[[], None] | None = None) -> None:
    """Parse ``jobs`` (in a process pool when there is more than one worker and job) and
    hand each result to ``finish`` in the main process, the only database writer. ``idle``
    is run once in the main process before the first ``finish``: in the pool case while
    the first jobs are being parsed.

    ``direct_jobs`` are run by ``run_direct(job, cursor(), stopping)`` in up to ``workers``
    threads of this process, side by side: they load their rows themselves, each on a
    cursor of its own (made and closed here, in the main thread); ``stopping()`` turns true
    when the jobs are being stopped. Jobs that would have run in this process run in those
    threads too.

    ``meter`` (a shared counter) counts the bytes the parsers read, here and in the parser
    processes; ``tick()`` is called every :data:`TICK_S` while they work, to report it."""
    global _READ_METER, _READ_HOOK
    direct_jobs = list(direct_jobs)
    use_pool = workers > 1 and len(jobs) > 1
    _READ_METER = meter
    try:
        if not direct_jobs and not use_pool:
            idle()
            _READ_HOOK = tick  # parsed in this thread: the reads report
            try:
                for job in jobs:
                    finish(parse_job(job, spool, debug))
            finally:
                _READ_HOOK = None
            return
        _run_in_parallel(jobs, spool, workers, debug, finish, idle, direct_jobs, run_direct, cursor, use_pool, meter, tick)
    finally:
        _READ_METER = None


def _run_in_parallel(jobs, spool, workers, debug, finish, idle, direct_jobs, run_direct, cursor, use_pool, meter, tick) -> None:
    """:func:`_run_jobs` with a process pool and/or threads."""
    pool = threads = None
    in_flight: dict[Future, object] = {}  # a direct job's future -> the cursor it uses
    # kind -> (its jobs, how many may run at once)
    queues = {"direct": (iter(direct_jobs), max(1, min(workers, len(direct_jobs)))),
              "pool" if use_pool else "thread": (iter(jobs), workers * 2 if use_pool else 1)}
    kinds: dict[Future, str] = {}
    stop = threading.Event()  # set on an interrupt or failure: direct jobs stop at their next step

    def submit(kind: str) -> None:
        it, limit = queues[kind]
        if list(kinds.values()).count(kind) >= limit:
            return
        job = next(it, None)
        if job is None:
            return
        if kind == "direct":
            cur = cursor()
            fut = threads.submit(run_direct, job, cur, stop.is_set)
            in_flight[fut] = cur
        elif kind == "pool":
            fut = pool.submit(parse_job, job, spool, debug)
        else:
            fut = threads.submit(parse_job, job, spool, debug)
        kinds[fut] = kind

    alive_r = alive_w = None
    try:
        if direct_jobs or not use_pool:
            threads = ThreadPoolExecutor(max_workers=max(1, min(workers, len(direct_jobs))) + (0 if use_pool else 1),
                                         thread_name_prefix="forensics-parse")
        if use_pool:
            # forkserver, not fork: a process that already ran polars (a notebook, a test run)
            # has its thread pool, and a forked copy of it can deadlock in the first query
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["forensics.pipeline"])
            # the parsers watch the read end: it reaches end-of-file when this process is gone
            alive_r, alive_w = ctx.Pipe(duplex=False)
            pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init, initargs=(alive_r, meter))
        for kind, (_, limit) in queues.items():
            for _ in range(limit):
                submit(kind)
        idle()
        while kinds:
            # never an endless wait: polars, once imported, handles SIGINT itself with SA_RESTART, and
            # a blocking wait in this thread then sleeps through Ctrl-C until a job ends (tests/
            # test_hostile.py: a big file's parse); waking up runs Python's handler
            finished, _ = wait(list(kinds), timeout=TICK_S, return_when=FIRST_COMPLETED)
            if tick:
                tick()
            for fut in finished:
                kind = kinds.pop(fut)
                cur = in_flight.pop(fut, None)
                if cur is not None:
                    cur.close()  # rolls back what its job did not commit (it failed)
                finish(fut.result())
                submit(kind)
    except BaseException:
        # interrupted or failed: stop DuckDB's reads, drop the jobs not started; the running ones end soon
        stop.set()
        for cur in in_flight.values():
            cur.interrupt()
        if alive_w is not None:  # the parser processes see it and exit: a big file's parse is not waited for
            alive_w.close()
        for executor in (pool, threads):
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)
        for cur in in_flight.values():  # their open transactions roll back
            cur.close()
        raise
    else:
        for executor in (pool, threads):
            if executor is not None:
                executor.shutdown(wait=True)
    finally:
        for end in (alive_r, alive_w):
            if end is not None and not end.closed:
                end.close()


def _worker_init(ingest_alive, meter=None) -> None:
    """Parser processes leave interrupts to the main process, which stops the pool and
    rolls back the open transaction (a Ctrl-C reaches the whole process group); and
    they end when the ingest process is gone (killed: ``ingest_alive``, the read end of
    a pipe only it writes to, reaches end-of-file), instead of waiting forever for work
    that will not come (they hold the fork server and the queues open themselves)."""
    global _READ_METER
    _READ_METER = meter  # the bytes read, for the ingest's progress
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def watch() -> None:
        ingest_alive.poll(None)
        os._exit(1)

    threading.Thread(target=watch, name="forensics-parent-watch", daemon=True).start()


def _load(store: Store, res: FileResult, summary: IngestSummary, debug: bool) -> tuple[dict, list[dict]]:
    """Prepare one parsed file's ``files`` row and problems (the caller inserts them with
    the job's parts, in the open transaction), after removing its old rows."""
    task = res.task
    prev = None
    if task.replace_from_line is not None:
        prev = store.con.execute("SELECT unparsed_lines, parse_errors FROM files WHERE file_id = ?", [task.file_id]).fetchone()
    row, problems = file_row(res, summary, debug, prev)
    if not task.is_new:
        store.delete_file_rows(task.file_id, task.replace_from_line)
    return row, problems


def file_row(res: FileResult, summary: IngestSummary, debug: bool, prev: tuple | None = None) -> tuple[dict, list[dict]]:
    """One parsed file's ``files`` row and problems, counted in ``summary``; ``prev``: the
    (unparsed_lines, parse_errors) of the rows a grown file keeps. Needs no database (an
    engine that writes parts where the data is builds them there)."""
    task, d = res.task, res.task.detected
    lines_total = res.lines + (task.start_line - 1)
    status = "ok"
    message = None
    kind = d.kind
    if res.unreadable:
        status, kind, message, lines_total = "skipped", "skipped", res.unreadable, 0
        summary.messages.append(f"{task.rel}: {message}")
        res.problems.append({"file_id": task.file_id, "line_no": None, "kind": "error", "message": message})
    elif res.error:
        status = "error"
        message = f"parser failed: {res.error}" + (" (partial rows dropped)" if res.parts else "")
        summary.messages.append(f"{task.rel}: {message}" + (f"\n{res.debug}" if debug and res.debug else ""))
        res.parts = {}
        res.problems.append({"file_id": task.file_id, "line_no": None, "kind": "error", "message": message})
        lines_total = 0
    elif res.problems:
        status = "partial" if any(p["kind"] in ("error", "truncated") for p in res.problems) else "ok"
        worst = [p for p in res.problems if p["kind"] in ("error", "truncated")] or res.problems
        message = worst[0]["message"]
        extra = f" (+{len(res.problems) - 1} more)" if len(res.problems) > 1 else ""
        summary.messages.append(f"{task.rel}: {message}{extra}")
    row = {
        "file_id": task.file_id, "root": task.root, "path": task.stored_path, "format": d.format, "kind": kind,
        "compressed": d.compressed, "bytes": task.size if res.bytes_read is None else res.bytes_read, "lines": lines_total, "ends_with_newline": res.ends_with_newline,
        "unparsed_lines": res.unparsed, "parse_errors": len(res.problems), "truncated": res.truncated,
        "sha256": res.sha256, "mtime": _utc(task.mtime), "node": d.node, "pid": d.pid, "rank": d.rank,
        "actor": d.actor, "status": status, "message": message, "ingested_at": _utc(time.time()),
    }
    if prev:
        row["unparsed_lines"] += int(prev[0] or 0)
        row["parse_errors"] += int(prev[1] or 0)
    summary.files_loaded += 1
    summary.bytes_read += (task.size if res.bytes_read is None else res.bytes_read) - task.start_offset
    summary.unparsed_lines += res.unparsed
    summary.files_by_format[d.format] = summary.files_by_format.get(d.format, 0) + 1
    return row, res.problems
