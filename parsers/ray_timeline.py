"""Ray timelines: the output of ``ray timeline`` / ``ray.timeline(filename=...)``.

A JSON array of Chrome trace events, all on one line::

    [{"cat": "task::ActorRolloutRefWorker.update_actor", "name": "update_actor",
      "pid": "10.0.0.2", "tid": "worker:15f2291e...", "ts": 1795999338536675.2,
      "dur": 530956.771, "ph": "X", "cname": "generic_work",
      "args": {"name": "update_actor", "task_id": "f50e24e4..."}},
     {"cat": "task:execute", "name": "task:execute", ...}, ...]

``pid`` is the node's IP, ``tid`` the worker (``worker:<id>``) or driver
(``driver:<job id>...``); ``cat`` names the task (``task::Class.method``) or the step of
task execution (``submit_task``, ``task:deserialize_arguments``, ``task:execute``,
``task:store_outputs``). ``ts`` is in microseconds since the epoch.

Rows go to ``trace_events`` with ``source = 'ray'``, through the same streaming
splitter and row builder as PyTorch profiler traces (:mod:`parsers.kineto`).
"""
from __future__ import annotations

from typing import BinaryIO

from .base import FileContext, Format, ParseOutput, Sniff
from .kineto import BATCH_BYTES, READ_BYTES, TRACE_EVENTS, TRACE_META, FileState, SafeReader, event_stream, finish_file, stream_rows


def parse_timeline(stream: BinaryIO, ctx: FileContext, batch_bytes: int = BATCH_BYTES) -> ParseOutput:
    """A Ray timeline: ``trace_events`` rows in batches, then one ``trace_meta`` row."""
    reader = SafeReader(stream, ctx)
    buf = bytearray()
    start = -1
    while start < 0:
        block = reader.read(READ_BYTES)
        if not block:
            break
        buf += block
        body = buf.lstrip()
        if body:
            if body[:1] != b"[":
                ctx.problem("not a Ray timeline: the file does not start with a JSON array", 1, "error")
                break
            start = len(buf) - len(body) + 1
    st = FileState(ctx.file_id, "ray", None, None)  # ts is epoch microseconds already
    arr = None
    if start >= 0:
        arr = event_stream(reader, buf, start, st, batch_bytes)
        yield from stream_rows(arr, st, ctx, "timeline")
        if arr.closed and arr.tail.strip():
            ctx.problem("text after the end of the timeline's event array (ignored)", arr.line, "warning")
    elif not buf.strip():
        ctx.truncated = True
        ctx.problem("empty timeline", None, "truncated")
    yield "trace_meta", finish_file(reader, st, arr, ctx, {})


def _is_timeline(h) -> bool:
    """A JSON array of trace events (their ``ph`` and ``ts`` or ``name`` keys early on)."""
    sample = h.data[:8192]
    return h.stripped[:1] == b"[" and b'"ph"' in sample and (b'"ts"' in sample or b'"name"' in sample)


FORMATS = (
    Format("ray_timeline", "structured", parse=parse_timeline, tables=(TRACE_EVENTS, TRACE_META),
           sniff=Sniff(750, _is_timeline), software="ray"),
)
