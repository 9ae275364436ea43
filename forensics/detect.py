"""Decide each file's format from its name AND its first bytes.

Files are often renamed (a driver log may be ``train.out``, ``stdout.txt`` or
``job_output.log``), so the name only breaks ties; the content decides. The format
names what parser reads the file (``parsers.FORMATS``) and, for text logs, what
kind of log it is (shown in the ingest summary and the ``files`` table).
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

from .parsers import ray_logs, torchrun

SNIFF_BYTES = 64 * 1024

_NODE_DIR = re.compile(r"^(?:node|host)_(?P<name>.+)$", re.I)  # node_<host>/
_NODE_NAMED = re.compile(r"^(?:node|host)-?[\w.-]+$", re.I)  # a folder named like a host: node-23/
_NODE_PARENTS = {"nodes", "hosts", "ray_logs", "node_logs", "machines"}
_NOT_NODES = re.compile(r"^(?:session_.*|session_latest|logs|events|export_events|old|profiler|trace|traces|nccl_debug|torchrun_logs|attempt_\d+|\d+|none_.*)$")


@dataclass
class Detected:
    format: str  # parser key, see parsers.FORMATS
    kind: str  # 'text' | 'structured' | 'skipped'
    compressed: bool = False
    node: str | None = None
    pid: int | None = None
    rank: int | None = None
    actor: str | None = None
    reason: str | None = None  # why a file is skipped


def read_head(path: str) -> tuple[bytes, bool]:
    """First bytes of the file, decompressed when it is gzip."""
    with open(path, "rb") as fh:
        raw = fh.read(SNIFF_BYTES)
    if raw[:2] == b"\x1f\x8b":
        try:
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            return d.decompress(raw, SNIFF_BYTES), True
        except zlib.error:
            return b"", True
    return raw, False


def node_from_path(rel: str) -> str | None:
    """A host name suggested by the folder layout (``nodes/<host>/``, ``node_<host>/``,
    ``ray_logs/<host>/``)."""
    parts = rel.split("/")[:-1]
    for i in range(len(parts) - 1, -1, -1):
        p = parts[i]
        m = _NODE_DIR.match(p)
        if m:
            return m.group("name")
        if i > 0 and parts[i - 1].lower() in _NODE_PARENTS and not _NOT_NODES.match(p):
            return p
        if _NODE_NAMED.match(p) and not _NOT_NODES.match(p):
            return p
    return None


_CONTROL_BYTES = bytes(b for b in range(32) if b not in (9, 10, 11, 12, 13, 27)) + b"\x7f"
_MAGIC = (b"\x7fELF", b"MZ", b"PK\x03\x04", b"\x89PNG", b"\x89HDF", b"SQLite format 3\x00", b"\x93NUMPY", b"PAR1",
          b"\xfd7zXZ", b"BZh", b"\x28\xb5\x2f\xfd", b"7z\xbc\xaf\x27\x1c")


def _looks_binary(head: bytes) -> bool:
    """Binary unless the first 8 KiB read as text. A log may hold NUL bytes (a writer
    killed mid-write, a zero-filled tail after a crash): NUL runs at either end of the
    sample are left out, and NULs elsewhere make it binary only in bulk (UTF-16 text
    has one every other byte) or with the other control bytes every binary format has."""
    if not head:
        return False
    if head.startswith(_MAGIC):
        return True
    sample = head[:8192].strip(b"\x00")
    if not sample:
        return True  # nothing but NUL bytes
    nuls = sample.count(b"\x00")
    other = len(sample) - len(sample.translate(None, _CONTROL_BYTES)) - nuls
    if other > len(sample) * 0.1 or nuls > len(sample) * 0.3:
        return True
    if other > len(sample) * 0.01:
        return nuls > 0 or sample.decode("utf-8", "replace").count("\ufffd") > len(sample) * 0.3
    return False


def _first_json_line(head: bytes) -> bytes:
    nl = head.find(b"\n")
    return head[:nl] if nl >= 0 else head


def sniff(rel: str, head: bytes, compressed: bool = False, size: int | None = None) -> Detected:
    name = rel.rsplit("/", 1)[-1]
    hints = ray_logs.file_hints(rel)
    rank = torchrun.rank_from_path(rel)
    node = node_from_path(rel)
    base = dict(compressed=compressed, node=node, pid=hints.get("pid"), rank=rank, actor=hints.get("actor"))
    if size == 0 or (not head and not compressed):
        return Detected("empty", "skipped", reason="empty file", **base)
    if compressed and not head:
        return Detected("binary", "skipped", reason="gzip data that does not decompress (cut off or corrupt), or nothing in it", **base)
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return Detected("flight_recorder", "structured", **base)
    stripped = head.lstrip()
    if stripped[:1] == b"{":
        window = head[:SNIFF_BYTES]
        first = _first_json_line(stripped)
        if b'"traceEvents"' in window or b'"schemaVersion"' in window[:8192] or b'"deviceProperties"' in window:
            return Detected("kineto_trace", "structured", **base)
        if first.rstrip().endswith(b"}") and (b'"step"' in first or b'"_step"' in first or b'"global_step"' in first):
            return Detected("metrics_jsonl", "text", **base)
        if name.endswith((".jsonl", ".ndjson")):
            return Detected("metrics_jsonl", "text", **base)
        return Detected("text", "text", **base)
    if stripped[:1] == b"[" and b'"ph"' in head[:8192] and (b'"ts"' in head[:8192] or b'"name"' in head[:8192]):
        return Detected("ray_timeline", "structured", **base)
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return Detected("binary", "skipped", reason="UTF-16 text (logs are read as UTF-8; convert it with iconv to ingest it)", **base)
    if _looks_binary(head):
        reason = "only NUL bytes (a zero-filled file)" if not head.strip(b"\x00") else "binary content (not a text log)"
        return Detected("binary", "skipped", reason=reason, **base)
    return Detected(_text_kind(name, rel, head, hints), "text", **base)


_KIND_PATTERNS = [
    ("nccl_debug", re.compile(rb"\n(?:\[[\d\- :]+\] )?[\w.\-]+:\d+:\d+ \[\d+\] (?:[\w./-]+:\d+ )?NCCL (?:INFO|WARN)")),
    ("kernel", re.compile(rb"\n(?:\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) \w{3} +\d+ [\d:]+ \d{4}\]|\[ *\d+\.\d+\]|\w{3} +\d+ [\d:]+ \S+ kernel:)")),
    ("driver", re.compile(rb"\n(?:\x1b\[[\d;]*m)*\((?:[\w.<>\-]+ )?pid=\d+(?:, ip=[^)]+)?\)")),
    ("vllm", re.compile(rb"\n(?:\([\w]+ pid=\d+\) )?(?:INFO|WARNING|ERROR|DEBUG) \d\d-\d\d [\d:]+ \[?[\w.]+\.py:\d+\]")),
    ("torchrun", re.compile(rb"\n(?:\[\w+\d+\]:|[IWE]\d{4} [\d:.]+ \d+ torch/distributed/)")),
]


def _text_kind(name: str, rel: str, head: bytes, hints: dict) -> str:
    if hints.get("format"):
        return hints["format"]
    if torchrun.rank_from_path(rel) is not None:
        return "torchrun_rank"
    head = head[:16384]  # a few hundred lines decide the kind
    # each pattern starts with a newline (the text gets one in front): re then jumps from
    # newline to newline, where a MULTILINE ``^`` made it try every byte (1 s per 8,000 files)
    nl_head = b"\n" + head
    counts = {k: len(p.findall(nl_head)) for k, p in _KIND_PATTERNS}
    total = max(1, head.count(b"\n"))
    if counts["nccl_debug"] > total * 0.5:
        return "nccl_debug"
    if counts["kernel"] > total * 0.5:
        return "kernel"
    if counts["driver"] >= 3:
        return "driver"
    if counts["vllm"] > total * 0.2:
        return "vllm"
    if counts["torchrun"] >= 3:
        return "torchrun"
    if counts["nccl_debug"] > total * 0.2:
        return "nccl_debug"
    return "text"


def detect(path: str, rel: str, size: int) -> Detected:
    head, compressed = read_head(path)
    return sniff(rel, head, compressed, size)

