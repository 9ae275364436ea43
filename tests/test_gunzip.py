"""The ISA-L gzip reader gives what the gzip module gives, a cut file included."""
from __future__ import annotations

import gzip
import io
import random

import pytest
from isal import isal_zlib

from forensics import gunzip
from forensics.gunzip import GunzipReader

_rng = random.Random(7)
DATA = bytes(_rng.getrandbits(8) for _ in range(200_000)) + b'{"name": "ncclDevKernel_AllReduce"}, ' * 40_000
PACKED = gzip.compress(DATA)


def read_all(packed: bytes, n: int, reader=GunzipReader) -> tuple[bytes, type | None]:
    """What reads of ``n`` bytes give before the end or an error, and the error's type."""
    f = reader(io.BytesIO(packed))
    out = []
    try:
        while block := f.read1(n):
            assert len(block) <= n
            out.append(block)
    except Exception as exc:  # the error is what the test compares
        return b"".join(out), type(exc)
    return b"".join(out), None


def by_gzip(packed: bytes) -> tuple[bytes, type | None]:
    return read_all(packed, 1 << 16, reader=lambda raw: gzip.GzipFile(fileobj=raw))


@pytest.mark.parametrize("n", [1, 13, 4096, 1 << 16, 1 << 24])
def test_whole_file_any_read_size(n):
    assert read_all(PACKED, n) == (DATA, None)


@pytest.mark.parametrize("packed", [
    PACKED + gzip.compress(b"second member"),
    PACKED + b"\x00" * 1000,
    b"",
    gzip.compress(b""),
], ids=["two members", "zero padding", "empty file", "empty member"])
def test_layouts_read_as_gzip_reads_them(packed):
    assert read_all(packed, 1 << 16) == by_gzip(packed)


@pytest.mark.parametrize("keep", [12, 1000, len(PACKED) // 3, len(PACKED) - 9, len(PACKED) - 1])
def test_cut_file_gives_every_byte_before_the_cut(keep):
    """A profiler killed mid-write: all that the cut data decodes to, then EOFError."""
    got, err = read_all(PACKED[:keep], 1 << 16)
    want, want_err = by_gzip(PACKED[:keep])
    assert err is EOFError and want_err is EOFError
    assert got == want and DATA.startswith(got)
    assert keep < 1000 or len(got) > 0


def test_bytes_after_a_member_are_refused_after_its_data():
    got, err = read_all(PACKED + b"not gzip", 1 << 16)
    assert (got, err) == (DATA, gzip.BadGzipFile)


def test_corrupt_data_raises_after_most_of_the_data():
    bad_crc = PACKED[:-8] + bytes([PACKED[-8] ^ 1]) + PACKED[-7:]
    got, err = read_all(bad_crc, 1 << 16)
    assert err is isal_zlib.error
    assert DATA.startswith(got)
    assert len(DATA) - len(got) <= gunzip.READ_COMPRESSED * 1032  # deflate expands 1032:1 at most
    assert len(got) > len(DATA) // 2


def test_read_without_size_reads_everything():
    assert GunzipReader(io.BytesIO(PACKED)).read() == DATA
    assert GunzipReader(io.BytesIO(PACKED)).read(0) == b""
