"""Ray timelines (``ray timeline`` / ``ray.timeline()``) into trace_events."""
from __future__ import annotations

import io
import json
from datetime import datetime

import polars as pl
import pyarrow as pa

from forensics.detect import sniff
from forensics.parsers.base import FileContext
from forensics.parsers import kineto, ray_timeline

from .conftest import FIXTURES

TIMELINE = FIXTURES / "timeline" / "timeline.json"


def parse(data: bytes, batch_bytes: int = kineto.BATCH_BYTES):
    ctx = FileContext(file_id=3, path="timeline.json", size=len(data), fmt="ray_timeline")
    events, meta = [], None
    for table, frame in ray_timeline.parse_timeline(io.BytesIO(data), ctx, batch_bytes):
        if table == "trace_events":
            events.append(kineto.TRACE_EVENTS.conform(frame))
        else:
            meta = kineto.TRACE_META.conform(frame).to_pylist()[0]
    df = pl.from_arrow(pa.concat_tables(events)) if events else pl.DataFrame(schema=kineto.TRACE_EVENTS.polars_schema)
    return df, meta, ctx


def test_fixture_timeline():
    data = TIMELINE.read_bytes()
    truth = json.loads(data)
    assert sniff("timeline.json", data[:4096]).format == "ray_timeline"
    df, meta, ctx = parse(data)
    assert df.height == len(truth) == meta["event_count"] == 6
    assert set(df["source"]) == {"ray"} and df["rank"].null_count() == 6 and meta["source"] == "ray"
    assert df["category"].to_list() == [e["cat"] for e in truth]
    assert df["name"].to_list()[0] == "update_actor" and df["pid"][0] == "10.0.0.2"
    assert df["tid"][0].startswith("worker:15f2291e") and df["tid"][5].startswith("driver:")
    assert df["ts"][0] == datetime(2026, 11, 30, 0, 42, 18, 536675)  # ts is epoch microseconds
    assert df["dur_us"][0] == 530956.771
    assert json.loads(df["args"][0]) == truth[0]["args"] and df["args"][1] == "{}"
    assert set(df["line_no"]) == {1} and ctx.lines == 1
    assert not ctx.problems and not ctx.truncated


def test_small_batches_and_truncation():
    data = TIMELINE.read_bytes()
    whole, _, _ = parse(data)
    for batch_bytes in (1, 100):
        small, _, _ = parse(data, batch_bytes)
        assert small.equals(whole)
    cut = data.index(b"task:store_outputs") + 10  # inside the fourth event
    df, meta, ctx = parse(data[:cut])
    assert df.height == meta["event_count"] == 3
    assert ctx.truncated and meta["truncated"] and any(p.kind == "truncated" for p in ctx.problems)
    # cut right after an event's closing brace: that event is complete
    end = data.index(b"}}", data.index(b"task:store_outputs")) + 2
    df, _, ctx = parse(data[:end])
    assert df.height == 4 and ctx.truncated


def test_not_a_timeline():
    df, meta, ctx = parse(b'  {"not": "an array"}')
    assert df.height == 0 and meta["event_count"] == 0
    assert [p.kind for p in ctx.problems] == ["error"]
    df, meta, ctx = parse(b"")
    assert df.height == 0 and ctx.truncated


def test_corpus_timelines(corpus):
    paths = sorted(corpus.glob("real/ray-*/timeline.json"))
    assert paths
    for path in paths:
        data = path.read_bytes()
        truth = json.loads(data)
        df, meta, ctx = parse(data)
        assert df.height == len(truth) == meta["event_count"], path
        assert df["name"].to_list() == [e["name"] for e in truth]
        assert df["ts_us"].to_list() == [e["ts"] for e in truth]
        assert df["ts"].null_count() == 0 and not ctx.problems
        tasks = df.filter(pl.col("category").str.starts_with("task::"))
        assert tasks.height and tasks["tid"].str.starts_with("worker:").all()
