"""Read a gzip file decompressed, as it goes, with ISA-L's inflate (the ``isal`` package).

Profiler traces come as ``.json.gz`` of ~100 MB decompressed each; ISA-L inflates them
about three times as fast as zlib. ``isal.igzip.IGzipFile`` is not used directly: when
the data is cut off (the profiler of a crashed process), it raises before handing over
the last block it decompressed, and a cut trace must load every event before the cut.
This reader hands over everything the stream decodes to, then raises ``EOFError`` as
``gzip.GzipFile`` does. Concatenated members and zero padding after the last member are
read as the gzip module reads them; other bytes after a member raise
``gzip.BadGzipFile``; corrupt data (a wrong CRC too) raises ``isal.isal_zlib.error``. Unlike
the gzip module, corrupt data loses the output of the read that finds it (at most what
``READ_COMPRESSED`` bytes decode to, and at most ``n``).
"""
from __future__ import annotations

import gzip
import io
from typing import BinaryIO

from isal import isal_zlib

READ_COMPRESSED = 64 << 10  # compressed bytes read at a time: corrupt data loses what the read it is in decodes to
_GZIP_WBITS = 16 + 15  # a gzip header and trailer around a deflate stream
_MAGIC = b"\x1f\x8b"


class GunzipReader(io.RawIOBase):
    """The decompressed bytes of the gzip stream ``raw``. ``read(n)`` gives at most ``n``
    bytes, and ``b""`` only at the end of the data."""

    def __init__(self, raw: BinaryIO):
        super().__init__()
        self._raw = raw
        self._inflate = isal_zlib.decompressobj(_GZIP_WBITS)
        self._pending = b""  # compressed bytes not taken by the current member yet
        self._started = False  # the current member has had input
        self._members = 0  # members read to their end
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def read1(self, n: int = -1) -> bytes:
        return self.read(n)

    def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0:
            return b"".join(iter(lambda: self.read(4 << 20), b""))
        while n and not self._done:
            if self._inflate.eof and not self._next_member():
                break
            data, self._pending = self._pending or self._raw.read(READ_COMPRESSED), b""
            if not data:
                if not self._started and not self._members:  # an empty file, which gzip reads as empty
                    self._done = True
                    break
                out = self._inflate.decompress(b"", n)  # what ISA-L decoded and holds back
                if out:
                    return out
                raise EOFError("Compressed file ended before the end-of-stream marker was reached")
            self._started = True
            out = self._inflate.decompress(data, n)
            self._pending = self._inflate.unused_data if self._inflate.eof else self._inflate.unconsumed_tail
            if out:
                return out
        return b""

    def _next_member(self) -> bool:
        """After a member's end: set up the next one; False at the end of the data."""
        self._members += 1
        data = self._pending
        while not (data := data.lstrip(b"\x00")):  # zero padding after a member is allowed
            data = self._raw.read(READ_COMPRESSED)
            if not data:
                self._done = True
                return False
        if not data.startswith(_MAGIC[: len(data)]):
            self._done = True
            raise gzip.BadGzipFile(f"not a gzip member after the end of member {self._members}: {data[:2]!r}")
        self._inflate = isal_zlib.decompressobj(_GZIP_WBITS)
        self._pending, self._started = data, False
        return True
