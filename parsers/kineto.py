"""PyTorch profiler (Kineto) Chrome traces: ``*.pt.trace.json`` / ``.json.gz``.

Kineto's ``ChromeTraceLogger`` writes one JSON object::

    {"schemaVersion": 1, "deviceProperties": [...], "distributedInfo": {"rank": 0, ...},
     "baseTimeNanoseconds": 1790857026000000000, ...,
     "traceEvents": [ {"ph": "X", "cat": "kernel", "name": ..., "pid": 0, "tid": 7,
                       "ts": 5141866816411.18, "dur": 1159.5, "args": {...}}, ... ],
     "traceName": "..."}

Event ``ts`` is in microseconds; since 2023 Kineto writes it relative to
``baseTimeNanoseconds`` (older traces: since the epoch). ``pid``/``tid`` are the OS
process/thread for CPU events, the device/stream for GPU events, and strings
(``"Spans"``, ``"Traces"``) for Kineto's own markers. NCCL kernels and
``record_param_comms`` operators carry the collective in their ``args``
(``"Collective name"``, ``"In msg nelems"``, ...).

Traces reach several GB, so a file is never loaded whole. :class:`ArrayStream` cuts
the event array into batches of complete events (``BATCH_BYTES`` of text each). A batch
is decoded in bulk by msgspec into typed structs and turned into columns with no
per-event Python code (:func:`frame_from_text`); a batch that does not fit that mould
(a field of an unexpected type, an element that is not an object, ``NaN``, a cut that
fell inside a string) is decoded element by element with orjson instead
(:func:`frame_from_values`), keeping what converts and counting the rest.
Memory is bounded by the batch size, not the file size. A trace cut off mid-write
yields every complete event before the cut.

When the pipeline gives a scratch folder (``ctx.scratch``), a trace is not decoded here
at all: :func:`spool_events` copies its event array to a file, finds the line of every
event on the way, and hands both to the store as :class:`~parsers.base.JsonArrayRows`
with the SELECT of :func:`events_select`, which derives the same columns with DuckDB's
JSON reader (measured: about twice as fast, at half the memory). That SELECT marks every
event whose fields the decoder here would have read differently; the store then has the
file parsed again the usual way, as it does for a trace that is cut off, empty, or laid
out so that the events cannot be found without decoding it.

:mod:`parsers.ray_timeline` reuses the splitter and the row builder for Ray timelines.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Annotated, BinaryIO, Callable, Iterator

import msgspec
import numpy as np
import orjson
import polars as pl
import pyarrow as pa
import re2

from .base import DECOMPRESS_ERRORS, FILE_ID, SNIFF_BYTES, FileContext, Format, JsonArrayRows, LINE_NO, ParseOutput, Sniff, Stopped, Table, col

TRACE_EVENTS = Table(
    "trace_events",
    "One row per event of a PyTorch profiler (Kineto) trace or a Ray timeline, in file "
    "order: CPU operators, user annotations (`ProfilerStep#N`, verl's `gen`, `reward`, "
    "`update_actor`, ...), CUDA runtime calls, GPU kernels, memcpy/memset, flows, "
    "metadata, Ray task spans. The number of rows of a file equals the length of its "
    "event array (see `trace_meta.event_count`).",
    (
        FILE_ID,
        LINE_NO,
        col("source", pa.string(), "`kineto` (PyTorch profiler) or `ray` (Ray timeline)."),
        col("seq", pa.int64(), "0-based index of the event in the file's event array."),
        col("rank", pa.int32(), "Global rank of the traced process: `distributedInfo.rank`, else the file name (`rank1.*`, `prof_rank-1.json.gz`), else the path; null for Ray timelines."),
        col("pid", pa.string(), "`pid` as written: OS process id for CPU events, device index for GPU events, Ray node IP, or Kineto's labels (`Spans`, `Traces`)."),
        col("tid", pa.string(), "`tid` as written: OS thread id, CUDA stream for GPU events, Ray `worker:<id>` / `driver:<id>`."),
        col("ph", pa.string(), "Chrome trace phase: `X` complete span, `i` instant, `s`/`f` flow start/end, `M` metadata, `B`/`E`, `C` counter, ..."),
        col("category", pa.string(), "The event's `cat` (`cpu_op`, `user_annotation`, `gpu_user_annotation`, `kernel`, `gpu_memcpy`, `gpu_memset`, `cuda_runtime`, `cuda_driver`, `ac2g`, `fwdbwd`, `python_function`, `overhead`, Ray `task::Class.method`, `task:execute`, `submit_task`, ...); `metadata` for `ph = 'M'` events; `uncategorized` for other events without a `cat`; `invalid` for an array element that is not a JSON object."),
        col("name", pa.string(), "Event name: operator, kernel, annotation (`ProfilerStep#3`, `update_actor`), Ray task name."),
        col("ts_us", pa.float64(), "`ts` as in the file, microseconds (Kineto: since `baseTimeNanoseconds`, or since the epoch in old traces; Ray: since the epoch)."),
        col("dur_us", pa.float64(), "`dur` in microseconds (`X` events)."),
        col("ts", pa.timestamp("us"), "Wall clock of the event start, UTC-naive: `baseTimeNanoseconds` + `ts` for Kineto traces that have it, `ts` itself when it is epoch microseconds (Ray, old Kineto); null otherwise."),
        col("device", pa.int32(), "GPU index for device events: `args.device`, else `pid` of GPU categories."),
        col("stream", pa.int64(), "CUDA stream for device events: `args.stream`, else `tid` of GPU categories."),
        col("correlation", pa.int64(), "CUDA correlation id linking a runtime/driver launch to its kernel/memcpy (`args.correlation`; for `ac2g` flow events their `id`)."),
        col("external_id", pa.int64(), "`args[\"External id\"]`: links a CPU operator to the launches and kernels it caused."),
        col("args", pa.string(), "The event's `args` object as JSON text (null when it has none): compact as DuckDB writes it for traces its JSON reader loaded, as written (line breaks removed) otherwise; compare it as JSON (`args ->> 'Sequence number'`, `json(args)`), not as text."),
        col("coll_name", pa.string(), "Collective of an NCCL kernel or `record_param_comms` operator (`args[\"Collective name\"]`: `allreduce`, `_allgather_base`, `broadcast`, ...)."),
        col("coll_in_nelems", pa.int64(), "`args[\"In msg nelems\"]`: elements sent."),
        col("coll_out_nelems", pa.int64(), "`args[\"Out msg nelems\"]`: elements received."),
        col("coll_dtype", pa.string(), "`args[\"dtype\"]` of a collective (`Float`, `BFloat16`, ...)."),
        col("coll_group_size", pa.int32(), "`args[\"Group size\"]`: ranks in the process group."),
        col("pg_name", pa.string(), "`args[\"Process Group Name\"]` of a collective (`0` is the default group)."),
        col("pg_desc", pa.string(), "`args[\"Process Group Description\"]` (`default_pg`, a verl/vLLM group name, ...)."),
        col("flow_id", pa.int64(), "`id` of flow events (`s`/`f`/`t`) and async events."),
    ),
)

TRACE_META = Table(
    "trace_meta",
    "One row per PyTorch profiler trace or Ray timeline: the top-level keys around the "
    "event array, how many events it held and whether the file was cut off.",
    (
        FILE_ID,
        col("source", pa.string(), "`kineto` or `ray`."),
        col("rank", pa.int32(), "Rank of the trace (as in `trace_events.rank`)."),
        col("world_size", pa.int32(), "`distributedInfo.world_size`."),
        col("schema_version", pa.int64(), "`schemaVersion`."),
        col("base_time_ns", pa.int64(), "`baseTimeNanoseconds`: epoch nanoseconds that event `ts` values count from."),
        col("trace_name", pa.string(), "`traceName`: the path the profiler wrote."),
        col("device_properties", pa.string(), "`deviceProperties` as JSON text (GPU name, memory, SM count, ...)."),
        col("distributed_info", pa.string(), "`distributedInfo` as JSON text (backend, rank, world size, process groups, NCCL version)."),
        col("other", pa.string(), "Every other top-level key as one JSON object (CUDA/CUPTI versions, `displayTimeUnit`, `trace_id`, vLLM version, ...)."),
        col("event_count", pa.int64(), "Events read (= rows in `trace_events` for this file)."),
        col("bad_events", pa.int64(), "Events with a missing or mistyped field (kept, with nulls where the value could not be used)."),
        col("truncated", pa.bool_(), "The file ends before the event array / object is closed; every complete event before the cut was loaded."),
    ),
)

BATCH_BYTES = 8 << 20  # JSON text decoded per batch: memory is bounded by this (the decoded batch takes ~5x it)
READ_BYTES = 4 << 20
PART_ROWS = 1 << 16  # rows handed on at a time
MAX_ELEMENT_BYTES = 256 << 20  # an element (or unbalanced text) longer than this stops the read
MAX_META_BYTES = 64 << 20  # top-level keys around the event array are metadata: cap them

# A separator between two objects of an array: `}` `,` `{` with optional whitespace.
_SEP = re.compile(rb"\}[ \t\r\n]*,[ \t\r\n]*\{")
# Tokens of the exact scanner: a whole string, a quote that opens an unterminated one, structure.
_TOK = re.compile(rb'"(?:[^"\\]|\\.)*"|"|[\[\]{},]')
_EVENTS_KEY = re.compile(rb'"traceEvents"[ \t\r\n]*:[ \t\r\n]*\[')
_WS = b" \t\r\n"
_OPEN, _CLOSE = (0x7B, 0x5B), (0x7D, 0x5D)  # { [   } ]

# Device-side categories: pid is the device, tid the stream.
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "gpu_memory")
EPOCH_US_MIN = 1e15  # a ts_us at least this large is epoch microseconds (after 2001-09-09)
_WALL_US_MAX = 9e15  # ... and below this (year 2255); beyond, no wall clock

# Top-level event keys -> column, and the keys of `args` that get a column of their own.
_TOP = {"ph": ("ph", pl.String), "cat": ("cat", pl.String), "name": ("name", pl.String),
        "pid": ("pid", pl.String), "tid": ("tid", pl.String), "ts": ("ts_us", pl.Float64),
        "dur": ("dur_us", pl.Float64), "id": ("flow_id", pl.Int64)}
_ARGS = {"External id": ("external_id", pl.Int64), "external id": ("_external_id_old", pl.Int64),
         "correlation": ("correlation", pl.Int64), "device": ("device", pl.Int32),
         "stream": ("stream", pl.Int64), "Collective name": ("coll_name", pl.String),
         "In msg nelems": ("coll_in_nelems", pl.Int64), "Out msg nelems": ("coll_out_nelems", pl.Int64),
         "dtype": ("coll_dtype", pl.String), "Group size": ("coll_group_size", pl.Int32),
         "Process Group Name": ("pg_name", pl.String), "Process Group Description": ("pg_desc", pl.String)}
# Columns of a decoded batch, before the file-level ones are added.
_DECODED = {**{c: t for c, t in _TOP.values()}, "args": pl.String, **{c: t for c, t in _ARGS.values()},
            "line_no": pl.Int64, "_invalid": pl.Boolean}

_RANK_IN_NAME = re.compile(r"(?:^|[^a-z0-9])rank[-_]?(\d+)(?![0-9])", re.I)


def rank_from_name(path: str) -> int | None:
    """Rank printed in a trace's file name: ``rank1.<id>.pt.trace.json.gz``,
    ``prof_rank-1.json.gz``, ``trace_rank_3.json``."""
    m = _RANK_IN_NAME.search(path.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


# -- reading ----------------------------------------------------------------------------

def _newlines(data: bytes | bytearray, start: int, end: int) -> int:
    """Line feeds in ``data[start:end]`` (numpy counts them several times faster than
    ``bytes.count``)."""
    if end <= start:
        return 0
    return int(np.count_nonzero(np.frombuffer(data, dtype=np.uint8, count=end - start, offset=start) == 10))


class SafeReader:
    """Read a (possibly gunzipped) stream, counting lines. Compressed data that ends
    early or is corrupt counts as the end of the data and is reported as a truncation."""

    def __init__(self, stream: BinaryIO, ctx: FileContext):
        self.stream, self.ctx = stream, ctx
        # read1 returns what one step of decompression gives: a buffered read() of
        # a gzip stream that ends early would drop the data decoded before the error
        self._read = getattr(stream, "read1", None) or stream.read
        self.newlines = 0
        self.last = b""
        self.broken = False

    def read(self, n: int = READ_BYTES) -> bytes:
        if self.broken:
            return b""
        try:
            block = self._read(n)
        except DECOMPRESS_ERRORS as exc:
            self.broken = True
            self.ctx.truncated = True
            self.ctx.problem(f"compressed data ends early or is corrupt ({exc.__class__.__name__}: {exc}); "
                             "what was read before that point was loaded", None, "truncated")
            return b""
        if block:
            self.newlines += _newlines(block, 0, len(block))
            self.last = block[-1:]
        return block

    def physical_lines(self) -> int:
        return self.newlines + (1 if self.last not in (b"", b"\n") else 0)


class Invalid:
    """An array element whose text is not JSON."""

    __slots__ = ("text",)

    def __init__(self, text: bytes):
        self.text = text


@dataclass
class ArrayStream:
    """Cut a JSON array that is being read from ``reader`` into batches of complete
    elements and hand each batch to a decoder.

    ``buf[pos:]`` is the unread rest of the array body (``pos`` is just after the
    ``[`` or after a comma between elements); ``line`` is the line of ``buf[0]``.

    The usual way to a batch: take about ``batch_bytes``, cut after the last ``}, {``
    in it and give the text to ``on_text(text, line)``, which returns its decoded rows
    or None when the text is not exactly a run of complete, well-formed elements. Then
    ``orjson`` decodes the run in one call and ``on_values(values, lines)`` converts
    them; if even that fails (the cut fell inside a string or a nested object, an
    element is not JSON, the array ends here), an exact token scanner finds the
    element boundaries and each element is decoded on its own.

    After :meth:`batches` is exhausted: ``closed`` tells whether the closing ``]`` was
    seen, ``tail`` holds what follows it (up to ``MAX_META_BYTES``), ``cut_line`` is the
    line where an unclosed array stops and ``problems`` lists (message, line) of
    damage found on the way.
    """

    reader: SafeReader
    buf: bytearray
    pos: int
    on_text: Callable[[bytes, int], object | None]
    on_values: Callable[[list, np.ndarray | None], object]
    line: int = 1
    batch_bytes: int = BATCH_BYTES
    closed: bool = False
    tail: bytes = b""
    cut_line: int | None = None
    eof: bool = False
    problems: list = field(default_factory=list)
    _done: bool = False

    # -- buffer --
    def _fill(self, want: int) -> None:
        while not self.eof and len(self.buf) - self.pos < want:
            block = self.reader.read(READ_BYTES)
            if not block:
                self.eof = True
                return
            self.buf += block

    def _drop_consumed(self) -> None:
        if self.pos >= READ_BYTES:
            self.line += _newlines(self.buf, 0, self.pos)
            del self.buf[: self.pos]
            self.pos = 0

    def _line_at(self, i: int) -> int:
        return self.line + _newlines(self.buf, 0, i)

    def _lines_at(self, offsets: list[int], upto: int) -> np.ndarray:
        view = np.frombuffer(self.buf, dtype=np.uint8, count=upto)
        newlines = np.flatnonzero(view == 10)
        del view  # a live view would stop the bytearray from resizing
        return self.line + np.searchsorted(newlines, np.asarray(offsets, dtype=np.int64)).astype(np.int64)

    # -- batches --
    def batches(self) -> Iterator:
        while not self._done:
            self._drop_consumed()
            self._fill(self.batch_bytes)
            if self._at_array_end():
                return
            sep = self._last_separator()
            if sep is not None:
                end = sep.start() + 1
                out = self._decode_run(self.pos, end)
                if out is not None:
                    self.pos = self.buf.index(b",", end) + 1
                    yield out
                    continue
            before = self.pos
            yield from self._scan()
            if self._done or self.pos != before:
                continue
            # nothing complete from pos on
            if self.eof:
                self._stop_truncated(self.pos)
            elif self.batch_bytes >= MAX_ELEMENT_BYTES:
                self.problems.append((f"an event array element runs past {MAX_ELEMENT_BYTES >> 20} MB "
                                      "(unbalanced brackets?); reading stopped there", self._line_at(self.pos)))
                self._stop_truncated(self.pos)
            else:
                self.batch_bytes *= 2

    def _at_array_end(self) -> bool:
        i, n = self.pos, len(self.buf)
        while i < n and self.buf[i] in _WS:
            i += 1
        if i < n and self.buf[i] == 0x5D:
            self._close(i)
            return True
        if i == n and self.eof:
            self._stop_truncated(i)
            return True
        return False

    def _stop_truncated(self, i: int) -> None:
        self.cut_line = self._line_at(min(i, len(self.buf)))
        self._done = True

    def _close(self, bracket: int) -> None:
        self.closed = True
        self._done = True
        self.line = self._line_at(bracket)
        tail = bytearray(self.buf[bracket + 1:])
        while len(tail) <= MAX_META_BYTES:
            block = self.reader.read(READ_BYTES)
            if not block:
                break
            tail += block
        self.tail = bytes(tail)
        self.buf = bytearray()
        self.pos = 0

    def _last_separator(self) -> re.Match | None:
        lo, hi = self.pos, len(self.buf)
        window = 1 << 16
        while True:
            start = max(lo, hi - window)
            last = None
            for last in _SEP.finditer(self.buf, start, hi):
                pass
            if last is not None or start == lo:
                return last
            window *= 8

    def _decode_run(self, start: int, end: int):
        """Decode ``buf[start:end]``, elements separated by commas; None when it is not
        exactly a run of complete JSON values."""
        with memoryview(self.buf) as view:
            text = bytes(view[start:end])
        out = self.on_text(text, self._line_at(start))
        if out is not None:
            return out
        try:
            values = orjson.loads(b"[" + text + b"]")
        except orjson.JSONDecodeError:
            return None
        # element starts: the first one, then after every `}, {` (exact when the counts agree)
        i = start
        while self.buf[i] in _WS:
            i += 1
        offsets = [i]
        offsets.extend(m.end() - 1 for m in _SEP.finditer(self.buf, start, end))
        if len(offsets) != len(values):  # a `}, {` inside a string: count exactly
            offsets = _element_starts(self.buf, start, end)
        lines = self._lines_at(offsets, end) if len(offsets) == len(values) else None
        return self.on_values(values, lines)

    def _scan(self) -> Iterator:
        """Find element boundaries token by token (strings skipped whole) from ``pos``
        and decode each element on its own. Stops after about ``batch_bytes``, at the
        closing ``]``, or where the buffered data ends inside an element."""
        buf = self.buf
        spans: list[tuple[int, int]] = []
        depth = 0
        elem = -1  # start of the element being read; -1 between elements
        gap = self.pos  # where the text of a number / true / false / null may start
        resume = self.pos
        closed_at = -1
        limit = self.pos + self.batch_bytes
        container_done = False  # the element read so far is a complete object / array
        for m in _TOK.finditer(buf, self.pos):
            c = buf[m.start()]
            if c == 0x22:
                if m.end() - m.start() == 1:
                    container_done = False
                    break  # a string that does not end in the buffer
                if depth == 0 and elem < 0:
                    elem = m.start()
                continue
            if c in _OPEN:
                if depth == 0 and elem < 0:
                    elem = m.start()
                depth += 1
                container_done = False
                continue
            if depth > 0:
                if c in _CLOSE:
                    depth -= 1
                    container_done = depth == 0
                continue
            # depth 0: a comma between elements, the closing `]`, or a stray `}`
            if elem < 0:
                gap_text = bytes(buf[gap:m.start()])
                if gap_text.strip(_WS):
                    elem = gap + len(gap_text) - len(gap_text.lstrip(_WS))
                elif c == 0x2C:
                    self.problems.append(("an empty element (two commas) in the event array", self._line_at(m.start())))
            if elem >= 0:
                spans.append((elem, _rstrip(buf, elem, m.start())))
            elem = -1
            container_done = False
            gap = resume = m.end()
            if c in _CLOSE:
                if c == 0x7D:
                    self.problems.append(("a `}` where the event array should continue; read as its end", self._line_at(m.start())))
                closed_at = m.start()
                break
            if m.end() >= limit:
                break
        else:
            # the buffer ends between tokens; at the end of the data a last element
            # that is a complete object still counts
            if self.eof and elem >= 0 and depth == 0 and container_done:
                end = _rstrip(buf, elem, len(buf))
                spans.append((elem, end))
                resume = end
        if spans:
            values = [_decode_one(bytes(buf[s:e])) for s, e in spans]
            yield self.on_values(values, self._lines_at([s for s, _ in spans], spans[-1][1]))
        if closed_at >= 0:
            self._close(closed_at)
        else:
            self.pos = resume


def _element_starts(buf: bytearray, start: int, end: int) -> list[int]:
    """Offsets where the elements of the comma-separated run ``buf[start:end]`` begin."""
    starts: list[int] = []
    depth = 0
    expecting = True  # between a comma and the next element
    gap = start
    for m in _TOK.finditer(buf, start, end):
        c = buf[m.start()]
        if depth == 0 and expecting and (c == 0x22 or c in _OPEN):
            starts.append(m.start())
            expecting = False
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
        elif c == 0x2C and depth == 0:
            if expecting:  # a number / true / false / null element
                text = bytes(buf[gap:m.start()])
                starts.append(gap + len(text) - len(text.lstrip(_WS)))
            expecting = True
            gap = m.end()
    if expecting and bytes(buf[gap:end]).strip(_WS):
        text = bytes(buf[gap:end])
        starts.append(gap + len(text) - len(text.lstrip(_WS)))
    return starts


def _rstrip(buf: bytearray, start: int, end: int) -> int:
    while end > start and buf[end - 1] in _WS:
        end -= 1
    return end


def _decode_one(text: bytes):
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        pass
    try:  # NaN / Infinity literals, integers beyond 64 bits
        return json.loads(text, parse_constant=_constant)
    except (ValueError, RecursionError):
        return Invalid(text)


def _constant(name: str) -> float:
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[name]


# -- the object around the array ----------------------------------------------------------

def read_header(reader: SafeReader, ctx: FileContext) -> tuple[dict, bytearray, int, bool]:
    """Read up to the ``[`` of the top-level ``"traceEvents"``.

    Returns (the keys before it, the buffer, the offset just after ``[``, found)."""
    buf = bytearray()
    searched = 0
    while True:
        block = reader.read(READ_BYTES)
        buf += block
        for m in _EVENTS_KEY.finditer(buf, max(0, searched - 64)):
            meta = _object_prefix(bytes(buf[: m.start()]))
            if meta is not None:
                return meta, buf, m.end(), True
        searched = len(buf)
        if not block or len(buf) > MAX_META_BYTES:
            if block:
                ctx.problem(f"no \"traceEvents\" array in the first {MAX_META_BYTES >> 20} MB; not read further", None, "error")
            return _object_prefix(bytes(buf), partial=True) or {}, buf, len(buf), False


def _object_prefix(head: bytes, partial: bool = False) -> dict | None:
    """The keys of the text ``{ "k": v, ...,`` that precedes a key at the top level of an
    object; None when that point is not at the top level (inside a string or a nested
    value). ``partial``: the text is all there is (cut off); return the keys that decode."""
    body = head.strip(_WS)
    if not body.startswith(b"{"):
        return None
    inner = body[1:].rstrip(_WS)
    if inner.endswith(b","):
        inner = inner[:-1]
    elif inner and not partial:
        return None  # a key follows only after a comma
    value = _decode_one(b"{" + inner + b"}")
    if isinstance(value, dict):
        return value
    if partial:  # keep the complete keys before the cut
        cut = inner.rfind(b",")
        while cut > 0:
            value = _decode_one(b"{" + inner[:cut] + b"}")
            if isinstance(value, dict):
                return value
            cut = inner.rfind(b",", 0, cut)
    return None


def parse_trailer(tail: bytes) -> tuple[dict, bool]:
    """Keys after the event array (``, "traceName": "..." }``) and whether the object is closed."""
    body = tail.strip(_WS)
    if body == b"}":
        return {}, True
    if body.startswith(b","):
        value = _decode_one(b"{" + body[1:]) if body.endswith(b"}") else None
        if isinstance(value, dict):
            return value, True
    return {}, False


# -- decoding batches -----------------------------------------------------------------------

# Typed shapes of an event for the bulk decoder. A value of another type (a number as
# text, an integer beyond 64 bits, args that are not an object, ...) fails the whole
# batch, which then goes element by element through :func:`frame_from_values`, where
# it is kept as far as it converts and counted.
_I64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
_I32 = Annotated[int, msgspec.Meta(ge=-(1 << 31), le=(1 << 31) - 1)]
_NO_ARGS = msgspec.Raw(b" {}")  # stands for a missing `args`: a decoded Raw never starts with a space


class _Event(msgspec.Struct, gc=False):
    ph: str | None = None
    cat: str | None = None
    name: str | None = None
    pid: int | str | None = None
    tid: int | str | None = None
    ts: float | None = None
    dur: float | None = None
    id: _I64 | None = None
    args: msgspec.Raw = _NO_ARGS


class _Args(msgspec.Struct, gc=False):
    external_id: _I64 | None = msgspec.field(default=None, name="External id")
    _external_id_old: _I64 | None = msgspec.field(default=None, name="external id")
    correlation: _I64 | None = None
    device: _I32 | None = None
    stream: _I64 | None = None
    coll_name: str | None = msgspec.field(default=None, name="Collective name")
    coll_in_nelems: _I64 | None = msgspec.field(default=None, name="In msg nelems")
    coll_out_nelems: _I64 | None = msgspec.field(default=None, name="Out msg nelems")
    coll_dtype: str | None = msgspec.field(default=None, name="dtype")
    coll_group_size: _I32 | None = msgspec.field(default=None, name="Group size")
    pg_name: str | None = msgspec.field(default=None, name="Process Group Name")
    pg_desc: str | None = msgspec.field(default=None, name="Process Group Description")


_EVENTS = msgspec.json.Decoder(list[_Event])
_ARGS_LIST = msgspec.json.Decoder(list[_Args | None])
_NO_ARGS_VALUE = _Args()
# (attribute, column, type, the key as written: a column whose key the batch does not
# contain is all null without looking at the events)
_TOP_FIELDS = [(k, c, t, f'"{k}"'.encode()) for k, (c, t) in _TOP.items()]
_ARGS_FIELDS = [(c, c, t, f'"{k}"'.encode()) for k, (c, t) in _ARGS.items()]
_COMMON_ARGS = ("external_id", "correlation", "device", "stream")  # in most batches of a Kineto trace
_RARE_ARGS_KEYS = [key.decode() for attr, _, _, key in _ARGS_FIELDS if attr not in _COMMON_ARGS]
_NEWLINE_RUN = r"[ \t\r]*\n[ \t\r\n]*"


def frame_from_text(text: bytes, line: int, sep: bytes) -> pl.DataFrame | None:
    """Decode a run of comma-separated event objects in bulk: the decoded columns of
    every event (as :data:`_DECODED`), or None when the text is not exactly a run of
    well-formed event objects whose fields all have their usual types (the caller then
    decodes it element by element).

    msgspec decodes the run into typed structs (only the fields that have a column;
    ``args`` as its raw text, decoded again into the ``args`` fields that have a
    column); each column is built from them with one C-level pass. ``args`` is kept as
    written, without line breaks and the indentation around them. An event starts on
    the line of its ``{``: the events begin after each ``sep`` (the file's usual text
    between two events), which is checked by their count, else found token by token.
    """
    try:
        events = _EVENTS.decode(b"[" + text + b"]")
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    n = len(events)
    raws = list(map(attrgetter("args"), events))
    joined = b",".join(raws)
    if not joined.isascii():  # msgspec checks the strings it decodes, not those it skips
        try:
            joined.decode("utf-8")
        except UnicodeDecodeError:
            return None
    try:
        args = _ARGS_LIST.decode(b"[" + joined + b"]")
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if None in args:  # "args": null
        args = [_NO_ARGS_VALUE if a is None else a for a in args]
    # a key absent from the text is absent from every event, unless written with escapes
    plain = b"\\" not in text
    cols: list[pl.Series] = []
    for attr, column, type_, key in _TOP_FIELDS:
        if plain and key not in text:
            cols.append(pl.Series(column, dtype=type_).extend_constant(None, n))
        elif attr in ("pid", "tid"):
            cols.append(_text_column(column, list(map(attrgetter(attr), events))))
        else:
            cols.append(pl.Series(column, list(map(attrgetter(attr), events)), dtype=type_))
    del events
    cols.append(_args_text(raws, joined, n))
    del raws
    rare = not plain or cols[-1].str.contains_any(_RARE_ARGS_KEYS).any()  # one pass instead of one per key
    for attr, column, type_, key in _ARGS_FIELDS:
        if not plain or (rare or attr in _COMMON_ARGS) and key in joined:
            cols.append(pl.Series(column, list(map(attrgetter(attr), args)), dtype=type_))
        else:
            cols.append(pl.Series(column, dtype=type_).extend_constant(None, n))
    cols.append(pl.Series("line_no", _start_lines(text, line, sep, n), dtype=pl.Int64))
    cols.append(pl.Series("_invalid", dtype=pl.Boolean).extend_constant(False, n))
    return pl.DataFrame(cols)


def _text_column(name: str, values: list) -> pl.Series:
    """``pid`` / ``tid``: numbers as their decimal text, strings as they are."""
    try:
        return pl.Series(name, values, dtype=pl.Int64).cast(pl.String)
    except TypeError:  # some are text (or integers beyond 64 bits)
        return pl.Series(name, [v if v is None or v.__class__ is str else str(v) for v in values], dtype=pl.String)


def _args_text(raws: list, joined: bytes, n: int) -> pl.Series:
    """The text of each event's ``args`` (null when it has none or it is ``null``),
    without line breaks and the indentation around them."""
    lengths = np.fromiter(map(len, raws), dtype=np.int64, count=n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths + 1, out=offsets[1:])  # each raw is followed by the joining comma
    first = np.frombuffer(joined, dtype=np.uint8)[offsets[:-1]]  # no raw is empty
    missing = ((lengths == 3) & (first == 0x20)) | ((lengths == 4) & (first == 0x6E))  # " {}", null
    # one string per event, [offset, offset + length) of the joined text, and one per
    # joining comma in between, dropped
    bounds = np.empty(2 * n + 1, dtype=np.int64)
    bounds[0::2] = offsets
    bounds[1::2] = offsets[:-1] + lengths
    bounds[-1] = len(joined)
    strings = pa.LargeStringArray.from_buffers(2 * n, pa.py_buffer(bounds), pa.py_buffer(joined))
    text = pl.Series("args", strings).gather_every(2)
    if b"\n" in joined:
        text = text.str.replace_all(_NEWLINE_RUN, "")
    if missing.any():
        text = text.scatter(np.flatnonzero(missing), None)
    return text


def _sep_positions(view: np.ndarray, sep: bytes, newlines: np.ndarray) -> np.ndarray:
    """Offsets where ``sep`` starts, complete matches only, in the bytes of ``view``
    (whose line feeds are at ``newlines``)."""
    last = len(view) - len(sep)
    if last < 0:
        return np.zeros(0, dtype=np.int64)
    j = sep.find(b"\n")
    if j >= 0:  # candidates: the line feeds, as the separator's own
        found = newlines[(newlines >= j) & (newlines <= last + j)] - j
    else:
        found = np.flatnonzero(view[: last + 1] == sep[0])
        j = 0
    for k in sorted(range(len(sep)), key=lambda k: sep[k] in _WS):  # brackets first: they thin out the most
        if k != j and len(found):
            found = found[view[found + k] == sep[k]]
    return found.astype(np.int64)


def _start_lines(text: bytes, line: int, sep: bytes, n: int) -> np.ndarray:
    """The line of each event's ``{`` in ``text`` (which starts on ``line``)."""
    if b"\n" not in text:
        return np.full(n, line, dtype=np.int64)
    view = np.frombuffer(text, dtype=np.uint8)
    newlines = np.flatnonzero(view == 10)
    found = _sep_positions(view, sep, newlines)
    first = 0
    while text[first] in _WS:
        first += 1
    starts = np.concatenate(([first], found + len(sep) - 1))
    if len(starts) != n:  # a separator written otherwise, or one inside a nested value
        starts = np.asarray(_element_starts(bytearray(text), 0, len(text)), dtype=np.int64)
    return line + np.searchsorted(newlines, starts).astype(np.int64)


@dataclass
class Tally:
    """Events with fields that could not be used, across the batches of a file."""

    events: int = 0
    fields: dict = field(default_factory=dict)
    examples: list = field(default_factory=list)

    def note(self, seq: int, what: list[str]) -> None:
        self.events += 1
        for w in what:
            self.fields[w] = self.fields.get(w, 0) + 1
        if len(self.examples) < 3:
            self.examples.append((seq, ", ".join(what)))


def frame_from_values(values: list, lines: np.ndarray | None, tally: Tally, first_seq: int) -> pl.DataFrame:
    """Decoded elements to columns one by one: what converts is kept, the rest is
    null and counted in ``tally``. A value that is not an object becomes an ``invalid``
    row (its JSON in ``args``; null for ``null`` and for text that is not JSON)."""
    n = len(values)
    data: dict[str, list] = {c: [None] * n for c in _DECODED if c not in ("line_no", "_invalid")}
    invalid = [False] * n
    for i, e in enumerate(values):
        bad: list[str] = []
        if not isinstance(e, dict):
            invalid[i] = True
            bad.append("not a JSON object")
            if e is not None and not isinstance(e, Invalid):
                data["args"][i] = _json_text(e)
        else:
            for key, (column, type_) in _TOP.items():
                v = e.get(key)
                if v is not None:
                    data[column][i] = _convert(v, type_, key, bad, lenient_text=key in ("pid", "tid"))
            a = e.get("args")
            if a is not None:
                data["args"][i] = _json_text(a)
                if isinstance(a, dict):
                    for key, (column, type_) in _ARGS.items():
                        v = a.get(key)
                        if v is not None:
                            data[column][i] = _convert(v, type_, f"args.{key}", bad)
                else:
                    bad.append("args not an object")
        if bad:
            tally.note(first_seq + i, bad)
    df = pl.DataFrame({c: pl.Series(c, v, dtype=_DECODED[c]) for c, v in data.items()})
    return df.with_columns(
        pl.Series("line_no", lines if lines is not None else [None] * n, dtype=pl.Int64),
        pl.Series("_invalid", invalid, dtype=pl.Boolean),
    )


def _convert(v, type_, what: str, bad: list, lenient_text: bool = False):
    """``v`` as a value of polars type ``type_``; None, with ``what`` noted in ``bad``,
    when it is not one. ``lenient_text``: numbers are fine as text (pid, tid)."""
    if type_ == pl.String:
        if isinstance(v, str):
            return v
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if not lenient_text:
                bad.append(what)
            return str(v)
    elif isinstance(v, bool):
        pass
    elif type_ == pl.Float64:
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, str):
            bad.append(what)
            try:
                return float(v)
            except ValueError:
                return None
    else:  # integers
        bits = 31 if type_ == pl.Int32 else 63
        number = None
        if isinstance(v, int):
            number = v
        elif isinstance(v, float) and v.is_integer():
            number = int(v)
        elif isinstance(v, str):
            try:
                number = int(v.strip(), 0)
            except ValueError:
                number = None
        if number is not None and -(1 << bits) <= number < (1 << bits):
            if not isinstance(v, int):
                bad.append(what)
            return number
    bad.append(what)
    return None


def _json_text(v) -> str:
    try:
        return orjson.dumps(v).decode()
    except TypeError:  # integers beyond 64 bits (decoded by the stdlib fallback)
        return json.dumps(v)


# -- rows ------------------------------------------------------------------------------------

@dataclass
class FileState:
    """What the row builder needs about the file, and counts across batches."""

    file_id: int
    source: str
    rank: int | None
    base_us: float | None  # added to ts_us for the wall clock; None: epoch µs or nothing
    seq: int = 0
    tally: Tally = field(default_factory=Tally)


def wall_clock(ts_us: pl.Expr, base_us: float | None) -> pl.Expr:
    """``base_us + ts_us`` as a timestamp; without a base, ``ts_us`` itself when it is
    epoch microseconds. Null where there is no plausible wall clock."""
    wall = ts_us + base_us if base_us is not None else ts_us
    lo = 0.0 if base_us is not None else EPOCH_US_MIN
    return (pl.when((wall >= lo) & (wall < _WALL_US_MAX)).then(wall.floor()).otherwise(None)
            .cast(pl.Int64).cast(pl.Datetime("us")))


def finish(query: pl.LazyFrame, st: FileState, n: int) -> pl.LazyFrame:
    """Add the file-level columns and the derived ones to the ``n`` decoded events of
    ``query``: ``trace_events`` rows, numbered from ``st.seq``."""
    cat = pl.col("cat")
    category = (pl.when(pl.col("_invalid")).then(pl.lit("invalid"))
                .when(pl.col("ph") == "M").then(pl.lit("metadata"))
                .when(cat.is_null()).then(pl.lit("uncategorized"))
                .otherwise(cat))
    gpu = pl.col("category").is_in(GPU_CATEGORIES)
    return query.with_columns(
        category.alias("category"),
        pl.coalesce("external_id", "_external_id_old").alias("external_id"),
    ).with_columns(
        pl.lit(st.file_id, pl.Int32).alias("file_id"),
        pl.lit(st.source, pl.String).alias("source"),
        pl.int_range(st.seq, st.seq + n, dtype=pl.Int64).alias("seq"),
        pl.lit(st.rank, pl.Int32).alias("rank"),
        wall_clock(pl.col("ts_us"), st.base_us).alias("ts"),
        pl.coalesce("device", pl.when(gpu).then(pl.col("pid").cast(pl.Int32, strict=False))).alias("device"),
        pl.coalesce("stream", pl.when(gpu).then(pl.col("tid").cast(pl.Int64, strict=False))).alias("stream"),
        pl.coalesce("correlation", pl.when(pl.col("category") == "ac2g").then(pl.col("flow_id"))).alias("correlation"),
    )


def _rows(df: pl.DataFrame, st: FileState) -> pa.Table:
    st.seq += df.height
    return df.select([c.name for c in TRACE_EVENTS.columns]).to_arrow().cast(TRACE_EVENTS.arrow_schema)


def usual_separator(text: bytes) -> bytes:
    """The text found most often between two objects in the first 256 KB of ``text``."""
    counts = Counter(m.group() for m in _SEP.finditer(text, 0, 1 << 18))
    return counts.most_common(1)[0][0] if counts else b"},{"


def decoders(st: FileState) -> tuple[Callable, Callable]:
    """The (on_text, on_values) pair of :class:`ArrayStream` that yields finished rows."""
    seps: list[bytes] = []

    def on_text(text: bytes, line: int) -> pa.Table | None:
        if not seps:  # the file's usual separator, from its first batch
            seps.append(usual_separator(text))
        df = frame_from_text(text, line, seps[0])
        if df is None:
            return None
        return _rows(finish(df.lazy(), st, df.height).collect(), st)

    def on_values(values: list, lines: np.ndarray | None) -> pa.Table:
        df = frame_from_values(values, lines, st.tally, st.seq)
        return _rows(finish(df.lazy(), st, df.height).collect(), st)

    return on_text, on_values


def event_stream(reader: SafeReader, buf: bytearray, pos: int, st: FileState, batch_bytes: int) -> ArrayStream:
    """An :class:`ArrayStream` over the event array at ``buf[pos:]`` that yields
    finished ``trace_events`` frames."""
    on_text, on_values = decoders(st)
    return ArrayStream(reader, buf, pos, on_text, on_values, batch_bytes=batch_bytes)


def stream_rows(arr: ArrayStream, st: FileState, ctx: FileContext, what: str) -> ParseOutput:
    """Yield the rows of the batches, about ``PART_ROWS`` at a time (fewer, larger parts
    load faster); report an event array that ends without ``]``."""
    pending: list[pa.Table] = []
    rows = 0
    for table in arr.batches():
        pending.append(table)
        rows += table.num_rows
        if rows >= PART_ROWS:
            yield "trace_events", pa.concat_tables(pending)
            pending, rows = [], 0
    if pending:
        yield "trace_events", pa.concat_tables(pending)
    if not arr.closed:
        ctx.truncated = True
        ctx.problem(f"{what} cut off inside the event array; the {st.seq} complete event(s) before the cut were loaded",
                    arr.cut_line, "truncated")


def finish_file(reader: SafeReader, st: FileState, arr: ArrayStream | None, ctx: FileContext, meta: dict) -> pa.Table:
    """Read what is left (for the line count), report the file's problems, and return
    its ``trace_meta`` row."""
    while reader.read(READ_BYTES):
        pass
    ctx.lines = reader.physical_lines()
    report_events(st, arr, ctx)
    return meta_row(ctx, st, meta)


def report_events(st: FileState, arr: ArrayStream | None, ctx: FileContext) -> None:
    if arr is not None:
        for message, line in arr.problems:
            ctx.problem(message, line, "error")
    t = st.tally
    if t.events:
        fields = ", ".join(f"{k}: {v}" for k, v in sorted(t.fields.items(), key=lambda kv: -kv[1]))
        first = "; ".join(f"event #{seq} ({why})" for seq, why in t.examples)
        ctx.problem(f"{t.events} event(s) with a missing-typed or unusable field, kept with nulls there "
                    f"[{fields}]; first: {first}", None, "warning")


# -- handing the event array to DuckDB's JSON reader ------------------------------------------

SPOOL_READ = 2 << 20  # bytes copied at a time (8 MB: the same time, 50 MB more peak RSS per trace)
SPOOL_HOLD = 1 << 20  # the end of the data kept in memory: the `]` and the keys after it are in it
_TRAILER_TRIES = 64  # `]` candidates tried from the end


class _Replay:
    """The bytes of a trace again: ``head`` and then the file a spool copied the rest to."""

    def __init__(self, head: bytes, path: str):
        self.head, self.fh = head, open(path, "rb")

    def read(self, n: int = -1) -> bytes:
        if self.head:
            out, self.head = self.head[:n] if n >= 0 else self.head, self.head[n:] if n >= 0 else b""
            return out
        return self.fh.read(n)

    def close(self) -> None:
        self.fh.close()


class _LineWriter:
    """The (seq, line_no) of each event start, written to Parquet ``LINE_ROWS`` at a time;
    the last window's stay apart until the end of the array is known."""

    LINE_ROWS = 1 << 18  # starts gathered before a write: few writes, a few MB held

    def __init__(self, path: str):
        import pyarrow.parquet as pq

        # no dictionary: building one for the line numbers kept ~60 MB of Arrow's pool per trace
        self.writer = pq.ParquetWriter(path, pa.schema([("seq", pa.int64()), ("line_no", pa.int64())]),
                                       compression="none", use_dictionary=False, write_statistics=False)
        self.rows = 0
        self.written_to = -1  # the last offset passed on to be written
        self.held: tuple[np.ndarray, np.ndarray] | None = None  # (offsets, lines) of the last window
        self.pending: list[np.ndarray] = []  # line numbers passed on, not written yet
        self.pending_rows = 0

    def add(self, offsets: np.ndarray, lines: np.ndarray) -> None:
        self._flush(None)
        self.held = (offsets, lines)

    def _flush(self, end: int | None) -> None:
        if self.held is not None:
            offsets, lines = self.held
            self.held = None
            if end is not None:
                lines = lines[offsets < end]
            elif len(offsets):
                self.written_to = int(offsets[-1])
            if len(lines):
                self.pending.append(lines)
                self.pending_rows += len(lines)
        if self.pending_rows >= (1 if end is not None else self.LINE_ROWS):
            lines = np.concatenate(self.pending)
            self.writer.write_table(pa.table({"seq": np.arange(self.rows, self.rows + len(lines), dtype=np.int64),
                                              "line_no": lines}))
            self.rows += len(lines)
            self.pending, self.pending_rows = [], 0

    def close(self, end: int | None) -> bool:
        """Keep the starts before offset ``end`` (the array's ``]``); False when starts
        after it were passed on already (or there is no end)."""
        ok = end is not None and self.written_to < end
        if ok:
            self._flush(end)
        self.writer.close()
        return ok


# A value that DuckDB's JSON reader would convert without a word if the field were read
# with its column's type (``"12"`` read as DOUBLE is 12, ``12`` read as VARCHAR is
# ``"12"``), where the decoder above counts the event: text fields must be strings,
# ``ts``/``dur`` numbers, ``pid``/``tid`` strings or integers (fewer than 19 digits, not
# ``-0``; Kineto writes pid -1), each or null. Keys are matched at any depth (a nested
# ``"name": 5`` only costs the typed read); a key with white space before its colon and
# a value more than one space after it are taken as a mismatch. Sound only on text
# without a backslash: then every ``"`` delimits a string and no key has an escape.
_NOT_NULL = r"| ?n[^u]| ?nu[^l]| ?nul[^l]"  # starts like null but is not (a value is at most one space away)
_UNTYPED = re2.compile(
    (r'"[ \t\r\n]+:'
     r'|"(?:ph|cat|name)":(?:[^ "n]| [^"n]' + _NOT_NULL + ")"
     r'|"(?:ts|dur)":(?:[^ \-0-9n]| [^\-0-9n]| ?-[^0-9]' + _NOT_NULL + ")"
     r'|"(?:pid|tid)":(?:[^ \-0-9"n]| [^\-0-9"n]| ?-[^1-9]| ?-?[0-9]{19}| ?-?[0-9]{1,18}[.eE]' + _NOT_NULL + ")").encode())
# bytes of the previous piece searched again: more than any match spans, but for the white
# space before a colon, which is kept whole (up to _UNTYPED_SPACE bytes: more is a mismatch)
_UNTYPED_REACH = 64
_UNTYPED_SPACE = 4096


class TypedFields:
    """Whether the fields of every event can be read with their columns' types (see
    :data:`_UNTYPED`), told from the bytes of the array fed in order."""

    def __init__(self) -> None:
        self.ok = True
        self._tail = b""

    def feed(self, data) -> None:
        if not self.ok or not len(data):
            return
        piece = self._tail + data
        if b"\\" in piece or _UNTYPED.search(piece) is not None:
            self.ok = False
            return
        space = 0  # white space at the end: a key's `"` and its colon may be further apart
        while space < len(piece) and piece[len(piece) - 1 - space] in _WS:
            space += 1
            if space > _UNTYPED_SPACE:
                self.ok = False
                return
        self._tail = piece[-(space + _UNTYPED_REACH):]

    def close(self) -> bool:
        """Done: also looks at the last bytes once more with nothing after them."""
        if self.ok and self._tail and _UNTYPED.search(self._tail + b" ") is not None:
            self.ok = False
        return self.ok


def spool_events(reader: SafeReader, buf: bytearray, pos: int, ctx: FileContext, st: FileState
                 ) -> tuple[JsonArrayRows | None, bytes, str]:
    """Copy the event array at ``buf[pos - 1:]`` (its ``[``) and the rest of ``reader`` to a
    file in ``ctx.scratch`` and find the line of every event's ``{``.

    Returns (the hand-over, the text after the array, the copy's path). The hand-over is
    None when the events cannot be found without decoding them: the array is empty, cut
    off, or not closed by a ``]`` followed by the end of the object within
    ``SPOOL_HOLD`` bytes of the end, or its first element is not an object. The copy
    then holds every byte from the ``[`` on, for the usual parser to read again (and
    the line file is gone). Events
    separated otherwise than the file's usual way are not found: the store sees that by
    the count and has the file parsed the usual way too.
    """
    stem = os.path.join(ctx.scratch, f"events-{ctx.file_id}")
    path, lines_path = stem + ".json", stem + ".parquet"
    window = bytes(buf[pos - 1:])  # from the `[`
    window_line = 1 + _newlines(buf, 0, pos - 1)
    window_at = 0  # offset of window[0] in the copy
    sep = usual_separator(window)
    lw = _LineWriter(lines_path)
    typed = TypedFields()
    first = 1
    while first < len(window) and window[first] in _WS:
        first += 1
    found_first = first < len(window) and window[first] == 0x7B  # an event object (not `]`, not the cut)
    if found_first:
        lw.add(np.array([first], dtype=np.int64), np.array([window_line + _newlines(window, 0, first)], dtype=np.int64))
    hold = bytearray()  # the last bytes, not written yet: the end of the array is in them
    with open(path, "wb") as out:
        while True:
            if ctx.stopping is not None and ctx.stopping():
                lw.close(None)
                out.close()
                _remove_files(path, lines_path)
                raise Stopped(f"{ctx.path}: stopped while copying its events")
            nxt = _read_about(reader, SPOOL_READ)
            # the last len(sep) - 1 bytes may begin a separator that the next read completes
            keep = len(window) if not nxt else max(0, len(window) - (len(sep) - 1))
            view = np.frombuffer(window, dtype=np.uint8)
            newlines = np.flatnonzero(view == 10)
            if found_first:
                starts = _sep_positions(view, sep, newlines)
                starts = starts[starts < keep] + (len(sep) - 1)
                if len(starts):
                    lw.add(window_at + starts, window_line + np.searchsorted(newlines, starts).astype(np.int64))
            window_line += int(np.searchsorted(newlines, keep))
            del view, newlines
            typed.feed(memoryview(window)[:keep])
            hold += memoryview(window)[:keep]
            if len(hold) > SPOOL_HOLD:
                cut = len(hold) - SPOOL_HOLD
                with memoryview(hold) as mv, mv[:cut] as part:
                    out.write(part)
                del hold[:cut]  # cheap: a bytearray drops its head without moving the rest
            window_at += keep
            if not nxt:
                break
            window = window[keep:] + nxt
        hold_at = window_at - len(hold)
        hold = bytes(hold)
        end = _array_end(hold, hold_at) if found_first else None
        if lw.close(end):
            out.write(hold[: end - hold_at + 1])
            return (JsonArrayRows("trace_events", path, lines_path, lw.rows,
                                  events_select(path, lines_path, st, typed.close())),
                    hold[end - hold_at + 1:], path)
        out.write(hold)
    os.unlink(lines_path)  # of no use to the decoder, which finds the lines itself
    return None, b"", path


def _remove_files(*paths: str) -> None:
    for p in paths:
        if os.path.exists(p):
            os.unlink(p)


def _read_about(reader: SafeReader, n: int) -> bytes:
    """About ``n`` bytes (a gzip stream gives one step of decompression per read)."""
    parts, got = [], 0
    while got < n:
        block = reader.read(n - got)
        if not block:
            break
        parts.append(block)
        got += len(block)
    return b"".join(parts)


def _array_end(hold: bytes, at: int) -> int | None:
    """Offset in the copy of the event array's closing ``]``: the last ``]`` in ``hold``
    (the copy's last bytes, from offset ``at``) that follows an event's ``}`` and is
    followed by nothing but the end of the top-level object (and its last keys)."""
    i = len(hold)
    for _ in range(_TRAILER_TRIES):
        i = hold.rfind(b"]", 0, i)
        if i < 0:
            return None
        before = hold[:i].rstrip(_WS)
        if before.endswith(b"}") and parse_trailer(hold[i + 1:])[1]:
            return at + i
    return None


# The `args` keys that have a column of their own, and their DuckDB types.
_ARGS_SQL = {"External id": "BIGINT", "correlation": "BIGINT", "device": "INTEGER", "stream": "BIGINT",
             "Collective name": "VARCHAR", "In msg nelems": "BIGINT", "Out msg nelems": "BIGINT",
             "dtype": "VARCHAR", "Group size": "INTEGER", "Process Group Name": "VARCHAR",
             "Process Group Description": "VARCHAR"}


_JSON_FIELDS = ("ph", "cat", "name", "pid", "tid", "ts", "dur", "id", "args")  # read as JSON text (unless typed)


def _sql_text(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def events_select(array_path: str, lines_path: str, st: FileState, typed: bool = False) -> str:
    """The SELECT of :class:`~parsers.base.JsonArrayRows` for a Kineto event array: the
    ``trace_events`` columns as :func:`finish` derives them, and ``ok``.

    Every field is read as JSON text and converted here, so that ``ok`` can tell a value
    of the wrong type (DuckDB would turn ``"12"`` into 12 and round 1.5 to 2 where the
    decoder above keeps null and counts the event): ``ok`` is false when a text field is
    not a string, a number is not a number, an integer has a fraction or an exponent or
    does not fit its column, ``pid``/``tid`` is neither a string nor an integer, or
    ``args`` is not an object; and for a row of one side of the positional join only
    (more or fewer events than the parser found starts). An event with none of the
    fields read (``{}``) is not ``ok`` either: it cannot be told from such a row. The
    ``args`` text is DuckDB's compact rendering of the object.

    ``typed``: :class:`TypedFields` found every ``ph``/``cat``/``name``/``pid``/``tid``/
    ``ts``/``dur`` of the copy to be of its column's type, so those are read as such (a
    JSON string's text, a number) and need no check (a third less CPU for the whole
    insert on a real trace); ``id`` and ``args`` are read and checked as above."""
    def unquote(c: str) -> str:  # c: a JSON string's text (or the row is not ok); without an escape, what is between the quotes
        return f"(CASE WHEN contains({c}, '\\') THEN {c} ->> '$' ELSE {c}[2:-2] END)"

    def is_str(c: str) -> str:  # c: JSON text, null when missing or JSON null
        return f"({c} IS NULL OR starts_with({c}, '\"'))"

    def is_num(c: str, value: str) -> str:
        return f"({c} IS NULL OR ({value} IS NOT NULL AND NOT starts_with({c}, '\"')))"

    def whole(c: str) -> str:  # written without a fraction or an exponent
        return f"NOT (contains({c}, '.') OR contains({c}, 'e') OR contains({c}, 'E'))"

    def is_int(c: str, value: str) -> str:
        return f"({c} IS NULL OR ({value} IS NOT NULL AND {whole(c)}))"

    def is_id(c: str) -> str:  # pid / tid: a string, or an integer
        return f"({c} IS NULL OR starts_with({c}, '\"') OR (TRY_CAST({c} AS BIGINT) IS NOT NULL AND {whole(c)}))"

    def gpu_index(c: str, text: str, t: str) -> str:  # pid / tid of a device event as a number (polars' cast of the text)
        if typed:  # c read as text: a string, or a whole number's digits (TypedFields)
            return f"CASE WHEN category IN ({gpu}) AND regexp_full_match({text}, '-?[0-9]+') THEN TRY_CAST({text} AS {t}) END"
        return (f"CASE WHEN category IN ({gpu}) THEN CASE WHEN NOT starts_with({c}, '\"') THEN TRY_CAST({text} AS {t})"
                f" WHEN regexp_full_match({text}, '-?[0-9]+') THEN TRY_CAST({text} AS {t}) END END")

    read_as = {c: "JSON" for c in _JSON_FIELDS}
    if typed:  # the values themselves (TypedFields): nothing to convert or check
        read_as.update(ph="VARCHAR", cat="VARCHAR", name="VARCHAR", pid="VARCHAR", tid="VARCHAR", ts="DOUBLE", dur="DOUBLE")
        top = {c: c for c in ("ph", "cat", "name", "pid", "tid", "ts", "dur")}
        top_checks = []
    else:
        top = {c: unquote(c) for c in ("ph", "cat", "name")}
        top.update({c: f"""CASE WHEN starts_with({c}, '"') THEN {unquote(c)} ELSE {c} END""" for c in ("pid", "tid")})
        top.update({c: f"TRY_CAST({c} AS DOUBLE)" for c in ("ts", "dur")})
        top_checks = [is_str("ph"), is_str("cat"), is_str("name"), is_id("pid"), is_id("tid"),
                      is_num("ts", "ts_f"), is_num("dur", "dur_f")]
    args_json = json.dumps({k: "JSON" for k in _ARGS_SQL})
    arg_texts, arg_values, arg_checks = [], [], []
    for i, (key, t) in enumerate(_ARGS_SQL.items()):
        raw = f"r{i}"  # the value's JSON text (a cast of the JSON value itself would decode a string)
        arg_texts.append(f'CAST(a."{key}" AS VARCHAR) AS {raw}')
        if t == "VARCHAR":
            arg_values.append(f"{unquote(raw)} AS a{i}")
            arg_checks.append(is_str(raw))
        else:
            arg_values.append(f"TRY_CAST({raw} AS {t}) AS a{i}")
            arg_checks.append(is_int(raw, f"a{i}"))
    arg = {key: f"a{i}" for i, key in enumerate(_ARGS_SQL)}
    gpu = ", ".join(_sql_text(c) for c in GPU_CATEGORIES)
    base = st.base_us
    wall = f"(ts_f + {base!r})" if base is not None else "ts_f"
    lo = "0" if base is not None else repr(EPOCH_US_MIN)
    rank = "NULL" if st.rank is None else str(int(st.rank))
    old = "'$.\"external id\"'"  # the key of traces before 2022 (json_transform keys are case-sensitive)
    return f"""
WITH e AS (
    SELECT {", ".join(f"j.{c}::{'VARCHAR' if t == 'JSON' else t} AS {c}" for c, t in read_as.items())}, l.seq, l.line_no
    FROM read_json({_sql_text(array_path)}, format = 'array',
                   columns = {{{", ".join(f"{c}: '{t}'" for c, t in read_as.items())}}}) j
    POSITIONAL JOIN read_parquet({_sql_text(lines_path)}) l
), d AS (
    SELECT *, {top['ph']} AS ph_s, {top['cat']} AS cat_s, {top['pid']} AS pid_s, {top['tid']} AS tid_s,
        {top['ts']} AS ts_f, {top['dur']} AS dur_f, TRY_CAST(id AS BIGINT) AS id_i,
        json_transform(args, {_sql_text(args_json)}) AS a,
        CASE WHEN contains(args, '"external id"') THEN CAST(args -> {old} AS VARCHAR) END AS a_old
    FROM e
), r AS (
    SELECT *, {", ".join(arg_texts)} FROM d
), v AS (
    SELECT *, {", ".join(arg_values)}, TRY_CAST(a_old AS BIGINT) AS a_old_i,
        CASE WHEN ph_s = 'M' THEN 'metadata' WHEN cat_s IS NULL THEN 'uncategorized' ELSE cat_s END AS category
    FROM r
)
SELECT {int(st.file_id)}::INTEGER AS file_id, line_no, {_sql_text(st.source)} AS source, seq, {rank}::INTEGER AS rank,
    pid_s AS pid, tid_s AS tid, ph_s AS ph, category, {top['name']} AS name, ts_f AS ts_us, dur_f AS dur_us,
    CASE WHEN {wall} >= {lo} AND {wall} < {_WALL_US_MAX!r} THEN make_timestamp(floor({wall})::BIGINT) END AS ts,
    coalesce({arg['device']}, {gpu_index('pid', 'pid_s', 'INTEGER')}) AS device,
    coalesce({arg['stream']}, {gpu_index('tid', 'tid_s', 'BIGINT')}) AS stream,
    coalesce({arg['correlation']}, CASE WHEN category = 'ac2g' THEN id_i END) AS correlation,
    coalesce({arg['External id']}, a_old_i) AS external_id,
    args,
    {arg['Collective name']} AS coll_name, {arg['In msg nelems']} AS coll_in_nelems,
    {arg['Out msg nelems']} AS coll_out_nelems, {arg['dtype']} AS coll_dtype,
    {arg['Group size']} AS coll_group_size, {arg['Process Group Name']} AS pg_name,
    {arg['Process Group Description']} AS pg_desc, id_i AS flow_id,
    (seq IS NOT NULL AND NOT (ph IS NULL AND cat IS NULL AND name IS NULL AND pid IS NULL AND tid IS NULL
                              AND ts IS NULL AND dur IS NULL AND id IS NULL AND args IS NULL)
     AND {" AND ".join([*top_checks, is_int('id', 'id_i')])}
     AND (args IS NULL OR starts_with(args, '{{')) AND {is_int('a_old', 'a_old_i')}
     AND {' AND '.join(arg_checks)}) AS ok
FROM v"""


# -- the parser --------------------------------------------------------------------------------

def parse_trace(stream: BinaryIO, ctx: FileContext, batch_bytes: int = BATCH_BYTES) -> ParseOutput:
    """A Kineto trace: ``trace_events`` rows in batches, then one ``trace_meta`` row."""
    reader = SafeReader(stream, ctx)
    head, buf, pos, found = read_header(reader, ctx)
    info = head.get("distributedInfo")
    rank = _int_field(info, "rank")
    if rank is None:
        rank = rank_from_name(ctx.path)
    if rank is None:
        rank = ctx.rank
    base_ns = _int_field(head, "baseTimeNanoseconds")
    st = FileState(ctx.file_id, "kineto", rank, base_ns / 1000 if base_ns is not None else None)
    trailer: dict = {}
    arr = None
    if found and ctx.scratch is not None:
        handed, tail, copy = spool_events(reader, buf, pos, ctx, st)
        if handed is None:  # read it again, decoding it here
            ctx.scratch = None
            replay = _Replay(bytes(buf[: pos - 1]), copy)
            try:
                yield from parse_trace(replay, ctx, batch_bytes)
            finally:
                replay.close()
                os.unlink(copy)
            return
        st.seq = handed.rows
        yield "trace_events", handed
        trailer, _ = parse_trailer(tail)
        _late_keys(head, trailer, ctx)
        yield "trace_meta", finish_file(reader, st, None, ctx, {**head, **trailer})
        return
    if not found:
        ctx.truncated = True
        ctx.problem("no \"traceEvents\" array: the file ends before it", None, "truncated")
    else:
        arr = event_stream(reader, buf, pos, st, batch_bytes)
        yield from stream_rows(arr, st, ctx, "trace")
        if arr.closed:
            trailer, closed = parse_trailer(arr.tail)
            if not closed:
                ctx.truncated = True
                ctx.problem("the trace ends after the event array without a complete top-level object; all events were loaded",
                            arr.line, "truncated")
            _late_keys(head, trailer, ctx)
    yield "trace_meta", finish_file(reader, st, arr, ctx, {**head, **trailer})


def _late_keys(head: dict, trailer: dict, ctx: FileContext) -> None:
    for late in ("baseTimeNanoseconds", "distributedInfo"):
        if late in trailer and late not in head:
            ctx.problem(f"\"{late}\" comes after the events: their rank / wall clock do not use it", None, "warning")


def _int_field(obj, key: str) -> int | None:
    if not isinstance(obj, dict) or obj.get(key) is None:
        return None
    return _convert(obj[key], pl.Int64, key, [])


def meta_row(ctx: FileContext, st: FileState, meta: dict) -> pa.Table:
    known = {"schemaVersion", "baseTimeNanoseconds", "traceName", "deviceProperties", "distributedInfo", "traceEvents"}
    other = {k: v for k, v in meta.items() if k not in known}
    info = meta.get("distributedInfo")
    name = meta.get("traceName")
    world = _convert(info["world_size"], pl.Int32, "world_size", []) if isinstance(info, dict) and info.get("world_size") is not None else None
    row = {
        "file_id": ctx.file_id,
        "source": st.source,
        "rank": st.rank,
        "world_size": world,
        "schema_version": _int_field(meta, "schemaVersion"),
        "base_time_ns": _int_field(meta, "baseTimeNanoseconds"),
        "trace_name": name if isinstance(name, str) or name is None else _json_text(name),
        "device_properties": None if meta.get("deviceProperties") is None else _json_text(meta["deviceProperties"]),
        "distributed_info": None if info is None else _json_text(info),
        "other": _json_text(other) if other else None,
        "event_count": st.seq,
        "bad_events": st.tally.events,
        "truncated": bool(ctx.truncated),
    }
    return pa.Table.from_pylist([row], schema=TRACE_META.arrow_schema)


def _is_trace(h) -> bool:
    """A JSON object with the profiler's keys near its start (``traceEvents`` may come
    after a long header; ``schemaVersion`` and ``deviceProperties`` come first)."""
    window = h.data[:SNIFF_BYTES]
    return h.stripped[:1] == b"{" and (
        b'"traceEvents"' in window or b'"schemaVersion"' in window[:8192] or b'"deviceProperties"' in window)


FORMATS = (
    Format("kineto_trace", "structured", parse=parse_trace, tables=(TRACE_EVENTS, TRACE_META), direct=True,
           sniff=Sniff(800, _is_trace)),
)
