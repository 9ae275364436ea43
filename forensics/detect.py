"""Decide each file's format from its name AND its first bytes.

Files are often renamed (a driver log may be ``train.out``, ``stdout.txt`` or
``job_output.log``), so the name only breaks ties; the content decides. Each format
declares its own rules (:class:`forensics.parsers.base.Format`, found by
:mod:`forensics.parsers.registry`); this module reads the first bytes (through gzip),
walks the rules highest priority first, and knows what is common to all formats: empty
files, binary data, and the host a folder layout names.

Priorities, by convention: above ``BINARY_GATE`` the rules that may claim any bytes (a
magic number, a JSON document's keys; ours 600-900); then the check that skips binary
data and UTF-16; below it the kinds of text log, by name first (Ray's exact file names,
400; torchrun's per-rank layout, 350), then by the share of their lines in the first
16 KiB (250-300); the plain text format claims the rest (0).
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

from .parsers import registry
from .parsers.base import SNIFF_BYTES, Head

# Rules of a priority below this one see text only: binary data and UTF-16 are skipped first.
BINARY_GATE = 500

_NODE_DIR = re.compile(r"^(?:node|host)_(?P<name>.+)$", re.I)  # node_<host>/
_NODE_NAMED = re.compile(r"^(?:node|host)-?[\w.-]+$", re.I)  # a folder named like a host: node-23/
_NODE_PARENTS = {"nodes", "hosts", "ray_logs", "node_logs", "machines"}
_NOT_NODES = re.compile(r"^(?:session_.*|session_latest|logs|events|export_events|old|profiler|trace|traces|nccl_debug|torchrun_logs|attempt_\d+|\d+|none_.*)$")


@dataclass
class Detected:
    format: str  # a format's name (forensics.parsers.registry), or why skipped: empty, binary, ...
    kind: str  # the format's kind, 'text' | 'structured', or 'skipped'
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


def _not_text(head: bytes) -> str | None:
    """Why the bytes are no text log to read, or None."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "UTF-16 text (logs are read as UTF-8; convert it with iconv to ingest it)"
    if _looks_binary(head):
        return "only NUL bytes (a zero-filled file)" if not head.strip(b"\x00") else "binary content (not a text log)"
    return None


def sniff(rel: str, head: bytes, compressed: bool = False, size: int | None = None) -> Detected:
    """The format of the file at ``rel`` (below the ingested root) whose first bytes are
    ``head``: the first rule of the registry's formats, highest priority first, that claims
    it; files with nothing to read, and binary data below ``BINARY_GATE``, are skipped."""
    hints = registry.path_hints(rel)
    base = dict(compressed=compressed, node=node_from_path(rel), pid=hints.get("pid"), rank=hints.get("rank"), actor=hints.get("actor"))
    if size == 0 or (not head and not compressed):
        return Detected("empty", "skipped", reason="empty file", **base)
    if compressed and not head:
        return Detected("binary", "skipped", reason="gzip data that does not decompress (cut off or corrupt), or nothing in it", **base)
    h = Head(rel, head, compressed, size)
    gated = False
    for priority, fmt, rule in registry.rules():
        if priority < BINARY_GATE and not gated:
            gated = True
            reason = _not_text(head)
            if reason:
                return Detected("binary", "skipped", reason=reason, **base)
        if rule.test(h):
            return Detected(fmt.name, fmt.kind, **base)
    reason = None if gated else _not_text(head)  # (only when every format may claim any bytes)
    if reason:
        return Detected("binary", "skipped", reason=reason, **base)
    return Detected("unknown", "skipped", reason="no format claims it", **base)


def detect(path: str, rel: str, size: int) -> Detected:
    head, compressed = read_head(path)
    return sniff(rel, head, compressed, size)

