"""Small text files are parsed many to a frame (parsers.text.parse_text_batch); that
must give exactly what parsing each file alone gives. This pins the line-format
contract: frames hold many files, so every join, fill, shift and grouping in a
line-format module is keyed by file_id."""
from __future__ import annotations

import io
from pathlib import Path

import polars as pl
import pytest

from forensics import detect as det
from forensics import pipeline
from forensics.parsers.base import FileContext
from forensics.parsers.text import parse_text, parse_text_batch

from .conftest import FIXTURES, corpus_cases


def _contexts(root: Path):
    out = []
    for i, (abs_path, rel) in enumerate(pipeline.walk(str(root), [], set())):
        d = det.detect(abs_path, rel, Path(abs_path).stat().st_size)
        task = pipeline.FileTask(i + 1, str(root), rel, abs_path, 0, 0.0, d)
        task.size = Path(abs_path).stat().st_size
        if not pipeline.batchable(task):
            continue
        data = Path(abs_path).read_bytes()
        out.append((data, lambda i=i, d=d, rel=rel, n=len(data): FileContext(
            file_id=i + 1, path=rel, size=n, fmt=d.format, node=d.node, pid=d.pid, rank=d.rank, actor=d.actor)))
    return out


def _collect(frames) -> dict[str, pl.DataFrame]:
    got: dict[str, list[pl.DataFrame]] = {}
    for name, frame in frames:
        got.setdefault(name, []).append(frame)
    return {k: pl.concat(v, how="diagonal_relaxed") for k, v in got.items()}


def _canonical(df: pl.DataFrame) -> pl.DataFrame:
    return df.select(sorted(df.columns)).sort(by=sorted(df.columns), nulls_last=True)


def check_same(root: Path) -> int:
    items = _contexts(root)
    if not items:
        return 0
    alone: dict[str, list[pl.DataFrame]] = {}
    ctx_alone = {}
    for data, make in items:
        ctx = make()
        ctx_alone[ctx.file_id] = ctx
        for name, frame in _collect(parse_text(io.BytesIO(data), ctx)).items():
            alone.setdefault(name, []).append(frame)
    batch_ctx = [(data, make()) for data, make in items]
    together = _collect(parse_text_batch(batch_ctx))
    singles = {k: pl.concat(v, how="diagonal_relaxed") for k, v in alone.items()}
    assert set(singles) == set(together)
    for name in singles:
        a, b = _canonical(singles[name]), _canonical(together[name])
        assert a.columns == b.columns, name
        assert a.height == b.height, (name, a.height, b.height)
        assert a.equals(b), f"{name}: batch parse differs from single-file parse in {root}"
    for _, ctx in batch_ctx:
        ref = ctx_alone[ctx.file_id]
        assert (ctx.lines, ctx.unparsed_lines) == (ref.lines, ref.unparsed_lines), ctx.path
    return len(items)


def test_fixture_batch_equals_single():
    assert check_same(FIXTURES / "foundation") >= 5


@pytest.mark.parametrize("case", corpus_cases(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_corpus_batch_equals_single(case):
    check_same(case)
