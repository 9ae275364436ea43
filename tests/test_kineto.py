"""PyTorch profiler (Kineto) traces: every event a row, streaming, tolerant of damage."""
from __future__ import annotations

import gzip
import io
import json
import shutil
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import duckdb
import orjson
import polars as pl
import pyarrow as pa
import pytest

from forensics import pipeline
from forensics.detect import sniff
from forensics.parsers.base import FileContext
from forensics.parsers import kineto

from .conftest import FIXTURES

TRACES = FIXTURES / "kineto"
TINY = TRACES / "rank3.tiny.pt.trace.json"


def parse(data: bytes, name: str = "trace.json", batch_bytes: int = kineto.BATCH_BYTES):
    """(trace_events frame, trace_meta row, ctx) of a trace given as bytes."""
    ctx = FileContext(file_id=7, path=f"prof/{name}", size=len(data), fmt="kineto_trace")
    events, meta = [], None
    for table, frame in kineto.parse_trace(io.BytesIO(data), ctx, batch_bytes):
        if table == "trace_events":
            events.append(kineto.TRACE_EVENTS.conform(frame))
        else:
            assert table == "trace_meta"
            meta = kineto.TRACE_META.conform(frame).to_pylist()[0]
    df = pl.from_arrow(pa.concat_tables(events)) if events else pl.DataFrame(schema=kineto.TRACE_EVENTS.polars_schema)
    return df, meta, ctx


def element_ends(data: bytes) -> list[int]:
    """Byte offset just after each element of the traceEvents array (stdlib decoder)."""
    text = data.decode()
    dec = json.JSONDecoder()
    i = text.index("[", text.index('"traceEvents"')) + 1
    ends = []
    while True:
        while text[i] in " \t\r\n,":
            i += 1
        if text[i] == "]":
            return ends
        _, i = dec.raw_decode(text, i)
        ends.append(len(text[:i].encode()))


def test_tiny_trace_columns():
    data = TINY.read_bytes()
    truth = json.loads(data)["traceEvents"]
    df, meta, ctx = parse(data, TINY.name)
    assert df.height == len(truth) == meta["event_count"] == 15
    assert df["seq"].to_list() == list(range(15))
    assert df["name"].to_list() == [e["name"] for e in truth]
    assert [json.loads(a) if a else None for a in df["args"]] == [e.get("args") for e in truth]
    # distributedInfo.rank wins over the "rank3" in the file name
    assert set(df["rank"]) == {1} and meta["rank"] == 1 and meta["world_size"] == 2
    assert meta["base_time_ns"] == 1790857026000000000 and meta["trace_name"].endswith("rank3.tiny.pt.trace.json")
    assert json.loads(meta["other"]) == {"cuda_runtime_version": 13000, "displayTimeUnit": "ms"}
    assert json.loads(meta["device_properties"])[0]["name"] == "NVIDIA H200"
    assert not ctx.problems and not ctx.truncated and meta["truncated"] is False
    # every row starts on the line of its `{`
    lines = data.split(b"\n")
    assert all(lines[n - 1].strip() == b"{" for n in df["line_no"])
    assert ctx.lines == data.count(b"\n")
    rows = {r["name"]: r for r in df.iter_rows(named=True)}
    step = rows["ProfilerStep#2"]
    assert step["category"] == "user_annotation" and step["pid"] == "893" and step["tid"] == "928"
    assert step["ts_us"] == 5141866642000.5 and step["dur_us"] == 9000.25
    assert step["ts"] == datetime(2026, 11, 30, 0, 34, 52, 642000)  # baseTimeNanoseconds + ts
    kernel = df.filter(pl.col("category") == "kernel").row(0, named=True)
    assert (kernel["device"], kernel["stream"], kernel["correlation"], kernel["external_id"]) == (0, 7, 4242, 3)
    assert (kernel["coll_name"], kernel["coll_in_nelems"], kernel["coll_out_nelems"], kernel["coll_dtype"],
            kernel["coll_group_size"], kernel["pg_name"], kernel["pg_desc"]) == ("allreduce", 32768000, 32768000, "Float", 2, "0", "default_pg")
    comms = rows["record_param_comms"]
    assert comms["category"] == "cpu_op" and comms["coll_name"] == "allreduce" and comms["device"] is None
    # a GPU annotation without args.device / args.stream: its pid / tid say them
    gpu_ann = df.filter(pl.col("category") == "gpu_user_annotation").row(0, named=True)
    assert (gpu_ann["device"], gpu_ann["stream"]) == (0, 7)
    flows = df.filter(pl.col("category") == "ac2g")
    assert flows["ph"].to_list() == ["s", "f"] and flows["flow_id"].to_list() == [4242, 4242]
    assert flows["correlation"].to_list() == [4242, 4242]
    assert df.filter(pl.col("ph") == "M")["category"].unique().to_list() == ["metadata"]
    marks = df.filter(pl.col("ph") == "i")
    assert marks["category"].unique().to_list() == ["uncategorized"] and marks["pid"].to_list() == ["Traces", ""]
    assert rows["PyTorch Profiler (0)"]["pid"] == "Spans"
    assert '"quoted" }, {' in df.filter(pl.col("category") == "python_function")["name"][0]


@pytest.mark.parametrize("batch_bytes", [1, 40, 333, 4096])
def test_batch_size_does_not_change_rows(batch_bytes):
    data = TINY.read_bytes()
    whole, _, _ = parse(data)
    small, meta, ctx = parse(data, batch_bytes=batch_bytes)
    assert small.equals(whole) and meta["event_count"] == 15 and not ctx.problems


def test_minified_and_one_line_layouts():
    obj = json.loads(TINY.read_bytes())
    for text in (json.dumps(obj, separators=(",", ":")), json.dumps(obj)):
        df, meta, ctx = parse(text.encode(), batch_bytes=64)
        assert df["name"].to_list() == [e["name"] for e in obj["traceEvents"]]
        assert set(df["line_no"]) == {1} and not ctx.problems


def test_rank_from_file_name_and_epoch_timestamps():
    data = (TRACES / "prof_rank-2.json").read_bytes()
    df, meta, ctx = parse(data, "prof_rank-2.json")
    assert df["rank"].to_list() == [2, 2, 2] and meta["rank"] == 2
    # no baseTimeNanoseconds: ts are epoch microseconds (old Kineto)
    assert df["ts"][0] == datetime(2023, 11, 14, 22, 13, 20, 123)
    # old Kineto writes "external id"
    assert df["external_id"].to_list() == [5, 5, None]
    assert df["device"].to_list() == [None, 1, None] and df["stream"][1] == 13
    assert kineto.rank_from_name("rank1.1795998896111586646.pt.trace.json.gz") == 1
    assert kineto.rank_from_name("x/trace_rank_13.json") == 13
    assert kineto.rank_from_name("workers/franks/profile.json") is None


def test_damaged_events_are_kept_and_counted():
    data = (TRACES / "odd.pt.trace.json").read_bytes()
    df, meta, ctx = parse(data)
    assert df.height == meta["event_count"] == 10  # every element a row, JSON literals included
    by = {r["seq"]: r for r in df.iter_rows(named=True)}
    assert by[0]["name"] == "fine" and by[0]["external_id"] == 1
    assert by[1]["ts_us"] == 200.5  # a number written as text is used, and counted
    assert by[2]["ts_us"] is None and by[2]["pid"] is None and by[2]["name"] == "not a number"
    assert by[3]["category"] == "invalid" and by[3]["args"] == "42"
    assert by[4]["category"] == "invalid" and by[4]["args"] is None
    assert by[5]["args"] == "[1,2]"
    assert by[6]["external_id"] == 7  # args not the last key
    assert by[7]["correlation"] == 16 and json.loads(by[7]["args"])["args"] == {"x": 1}
    assert by[8]["category"] == "uncategorized"
    assert by[9]["external_id"] is None  # beyond 64 bits
    assert meta["bad_events"] == 7
    [warning] = [p for p in ctx.problems if p.kind == "warning"]
    assert "7 event(s)" in warning.message and "not a JSON object: 2" in warning.message
    assert not ctx.truncated


def test_truncated_copies_load_their_complete_prefix():
    data = TINY.read_bytes()
    ends = element_ends(data)
    for cut in list(range(0, len(data), 53)) + [e for e in ends] + [e + 1 for e in ends] + [len(data) - 3]:
        df, meta, ctx = parse(data[:cut], batch_bytes=256)
        expected = sum(1 for e in ends if e <= cut)
        assert df.height == expected == meta["event_count"], cut
        assert df["name"].to_list() == [e["name"] for e in json.loads(data)["traceEvents"][:expected]]
        assert ctx.truncated and meta["truncated"], cut
        assert any(p.kind == "truncated" for p in ctx.problems)


def test_truncated_gzip_through_the_pipeline(tmp_path):
    data = TINY.read_bytes() * 1  # keep the fixture as is
    packed = gzip.compress(data)
    trace = tmp_path / "in" / "rank0.cut.pt.trace.json.gz"
    trace.parent.mkdir()
    trace.write_bytes(packed[: len(packed) * 2 // 3])
    db = tmp_path / "f.duckdb"
    pipeline.ingest([str(trace.parent)], str(db), workers=1)
    con = duckdb.connect(str(db), read_only=True)
    fmt, truncated, status = con.execute("SELECT format, truncated, status FROM files").fetchone()
    assert (fmt, truncated, status) == ("kineto_trace", True, "partial")
    n, count = con.execute("SELECT (SELECT count(*) FROM trace_events), (SELECT event_count FROM trace_meta)").fetchone()
    assert 0 < n == count < 15
    assert con.execute("SELECT count(*) FROM problems WHERE kind = 'truncated'").fetchone()[0] >= 1


def test_detect_routes_traces():
    head = TINY.read_bytes()[:4096]
    assert sniff("prof/rank3.tiny.pt.trace.json", head).format == "kineto_trace"
    assert sniff("prof/prof_rank-2.json", (TRACES / "prof_rank-2.json").read_bytes()).format == "kineto_trace"


def test_parallel_ingest_gives_the_same_rows(tmp_path):
    src = tmp_path / "run"
    shutil.copytree(TRACES, src / "profiler")
    shutil.copytree(FIXTURES / "timeline", src / "ray")
    (src / "profiler" / "rank0.copy.pt.trace.json.gz").write_bytes(gzip.compress(TINY.read_bytes()))
    # in a fresh process, two workers first: pool workers are forked, and a fork of a
    # process whose polars thread pool is running (as in this test session) can deadlock
    script = ("import sys; from forensics import pipeline; "
              "[pipeline.ingest([sys.argv[1]], f'{sys.argv[2]}/j{j}.duckdb', workers=j) for j in (2, 1)]")
    subprocess.run([sys.executable, "-c", script, str(src), str(tmp_path)], check=True, capture_output=True, timeout=300)
    dumps = []
    for workers in (1, 2):
        con = duckdb.connect(str(tmp_path / f"j{workers}.duckdb"), read_only=True)
        dumps.append({  # repr: the NaN `dur` of odd.pt.trace.json is not == itself
            t: [repr(r) for r in con.execute(f"SELECT f.path, t.* EXCLUDE (file_id) FROM {t} t JOIN files f USING (file_id) ORDER BY ALL").fetchall()]
            for t in ("trace_events", "trace_meta", "problems")
        })
        con.close()
    assert dumps[0] == dumps[1]
    assert len(dumps[0]["trace_events"]) == 15 + 3 + 10 + 15 + 6
    con = duckdb.connect(str(tmp_path / "j2.duckdb"), read_only=True)
    ranks = dict(con.execute("SELECT f.path, m.rank FROM trace_meta m JOIN files f USING (file_id)").fetchall())
    assert ranks == {"profiler/rank3.tiny.pt.trace.json": 1, "profiler/prof_rank-2.json": 2,
                     "profiler/odd.pt.trace.json": None, "profiler/rank0.copy.pt.trace.json.gz": 1,
                     "ray/timeline.json": None}


# -- the corpus ---------------------------------------------------------------------------

def _corpus_traces(corpus: Path, big: bool) -> list[Path]:
    found = sorted(corpus.glob("real/*/profiler/*.pt.trace.json*")) + sorted(corpus.glob("real/*/trace/*.pt.trace.json*"))
    return [p for p in found if (p.stat().st_size > 1 << 20) == big]


def _check_corpus_trace(path: Path) -> None:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    doc = json.loads(data)
    df, meta, ctx = parse(data, path.name)
    assert df.height == len(doc["traceEvents"]) == meta["event_count"]
    assert set(df["rank"]) == {doc["distributedInfo"]["rank"]}
    assert not ctx.problems and not ctx.truncated
    assert df["line_no"].null_count() == 0 and df["ts"].null_count() == 0
    names = [e.get("name") for e in doc["traceEvents"]]
    assert df["name"].to_list() == names


def test_small_corpus_traces_load_exactly(corpus):
    paths = _corpus_traces(corpus, big=False)
    assert paths
    for path in paths:
        _check_corpus_trace(path)


@pytest.mark.slow
def test_big_corpus_traces_load_exactly(corpus):
    paths = _corpus_traces(corpus, big=True)
    assert paths
    for path in paths:
        _check_corpus_trace(path)


def test_truncated_corpus_trace(corpus, tmp_path):
    [path] = _corpus_traces(corpus, big=False)[:1] or [None]
    data = gzip.decompress(path.read_bytes())
    cut = len(data) * 3 // 5
    ends = element_ends(data)
    df, meta, ctx = parse(data[:cut], path.name)
    assert df.height == sum(1 for e in ends if e <= cut) > 0
    assert ctx.truncated and meta["truncated"]
    # user annotations stay user annotations (vLLM's profiler run names its steps)
    assert df.filter(pl.col("category") == "user_annotation").height > 0


def test_ts_is_wall_clock_of_the_run(corpus):
    [path] = _corpus_traces(corpus, big=False)[:1]
    df, meta, _ = parse(gzip.decompress(path.read_bytes()), path.name)
    first = df.filter(pl.col("ph") == "X")["ts"].min()
    # the profiler's file name carries the epoch nanoseconds it was written at
    written = datetime(1970, 1, 1) + timedelta(microseconds=int(path.name.split(".")[1]) // 1000)
    assert timedelta(0) <= written - first < timedelta(hours=1)


def test_trace_written_by_the_torch_profiler(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

    out = tmp_path / "profiler"
    handler = tensorboard_trace_handler(str(out), worker_name="rank0", use_gzip=True)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
                 on_trace_ready=handler) as prof:
        for _ in range(4):
            with record_function("gen"):
                torch.randn(32, 32) @ torch.randn(32, 32)
            with record_function("update_actor"):
                torch.randn(16).sum()
            prof.step()
    # the handler writes one trace per profiling cycle; the first holds both steps
    trace = min(out.glob("*.pt.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    data = gzip.decompress(trace.read_bytes())
    assert sniff(f"profiler/{trace.name}", data[:4096], compressed=True).format == "kineto_trace"
    doc = json.loads(data)
    df, meta, ctx = parse(data, trace.name)
    assert df.height == len(doc["traceEvents"]) == meta["event_count"] and not ctx.problems
    assert df["name"].to_list() == [e.get("name") for e in doc["traceEvents"]]
    annotations = set(df.filter(pl.col("category") == "user_annotation")["name"])
    assert {"gen", "update_actor"} <= annotations and any(n.startswith("ProfilerStep#") for n in annotations)
    assert set(df["rank"]) == {0}  # no distributedInfo: from the file name
    spans = df.filter(pl.col("ph") == "X")
    assert spans["ts"].null_count() == 0 and spans["line_no"].null_count() == 0


# -- the bulk decoder against the element-by-element one ------------------------------------

def _both_decoders(text: bytes, sep: bytes = b"},\n  {"):
    """(bulk frame, element frame) of a run of comma-separated events."""
    bulk = kineto.frame_from_text(text, 1, sep)
    assert bulk is not None
    values = orjson.loads(b"[" + text + b"]")
    lines = bulk["line_no"].to_numpy()
    one = kineto.frame_from_values(values, lines, kineto.Tally(), 0)
    assert bulk.columns == one.columns == list(kineto._DECODED)
    return bulk, one


def _assert_same_rows(bulk: pl.DataFrame, one: pl.DataFrame) -> None:
    # args: the bulk decoder keeps the text as written, the other writes it compactly
    assert [json.loads(a) if a is not None else None for a in bulk["args"]] == \
           [json.loads(a) if a is not None else None for a in one["args"]]
    assert bulk.drop("args").equals(one.drop("args"))


def test_bulk_decoder_matches_element_decoder_on_odd_but_valid_events():
    events = [
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1, "dur": 2.5,
         "args": {"External id": 3, "device": 0, "stream": 7, "correlation": 9, "extra": [1, {"x": None}]}},
        {"name": "no args", "ph": "i", "pid": "Traces", "tid": "", "ts": 5.0},
        {"ph": "X", "name": "null args", "args": None, "pid": 1, "tid": 2},
        {"ph": "X", "name": "empty args", "args": {}, "pid": -1, "tid": 2 ** 40},
        {"ph": "s", "id": 4242, "cat": "ac2g", "name": "flow", "pid": 1, "tid": 2, "ts": 3.25},
        {"ph": "X", "cat": "cpu_op", "name": "say \"hi\" }, { \u00e9\u4e2d", "pid": 1, "tid": 2,
         "args": {"Collective name": "allreduce", "In msg nelems": 2 ** 40, "Out msg nelems": 0, "dtype": "Float",
                  "Group size": 8, "Process Group Name": "0", "Process Group Description": "default_pg",
                  "external id": 12}},
        {},
    ]
    text = b",\n  ".join(json.dumps(e, indent=2, ensure_ascii=False).encode() for e in events)
    bulk, one = _both_decoders(text, b"},\n  {")
    _assert_same_rows(bulk, one)
    assert bulk["args"][1] is None and bulk["args"][2] is None and bulk["args"][3] == "{}"
    assert bulk["pid"].to_list()[:4] == ["0", "Traces", "1", "-1"] and bulk["tid"][3] == str(2 ** 40)
    # every event starts on the line of its `{`
    starts = [n for n, line in enumerate(text.split(b"\n"), 1) if line.lstrip().startswith(b"{") and not line.startswith(b"   ")]
    assert bulk["line_no"].to_list() == starts


@pytest.mark.parametrize("event, bad", [
    ({"ph": "X", "ts": "1.5"}, 1),  # a number as text
    ({"ph": "X", "args": {"External id": 5.5}}, 1),  # a fraction for an integer
    ({"ph": "X", "args": {"External id": True}}, 1),
    ({"ph": "X", "args": {"device": 2 ** 31}}, 1),  # beyond 32 bits
    ({"ph": "X", "args": {"External id": 2 ** 63}}, 1),  # beyond 64 bits
    ({"ph": "X", "args": [1]}, 1),
    ({"ph": "X", "name": 3}, 1),
    ({"ph": "X", "pid": True}, 1),
    ({"ph": "X", "pid": 1.5}, 0),  # any number is fine as a pid, written as the element decoder writes it
])
def test_bulk_decoder_refuses_mistyped_events(event, bad):
    """A batch with a field of another type goes element by element, where the field is
    counted; the bulk decoder must not quietly convert it."""
    fine = {"ph": "X", "cat": "cpu_op", "name": "fine", "pid": 1, "tid": 2, "ts": 1.0, "args": {"External id": 1}}
    text = b",\n  ".join(json.dumps(e).encode() for e in (fine, event, fine))
    assert kineto.frame_from_text(text, 1, b"},\n  {") is None
    data = b'{"traceEvents": [\n  ' + text + b"\n]}"
    df, meta, ctx = parse(data)
    assert df.height == meta["event_count"] == 3 and meta["bad_events"] == bad
    assert df["name"][0] == "fine" and df["external_id"][2] == 1
    assert df["pid"][1] == ("1.5" if event.get("pid") == 1.5 else None)


def test_bulk_decoder_matches_element_decoder_on_a_real_trace(corpus):
    [path] = _corpus_traces(corpus, big=False)[:1] or [None]
    data = gzip.decompress(path.read_bytes())
    start = data.index(b"[", data.index(b'"traceEvents"')) + 1
    body = data[start:start + (4 << 20)]
    text = body[: body.rindex(b"},\n  {") + 1].strip()
    bulk, one = _both_decoders(text)
    assert bulk.height > 1000
    _assert_same_rows(bulk, one)


def test_bulk_decoder_keys_written_with_escapes_and_bad_utf8_in_args():
    # a key spelled with an escape is still the key: its column must not be skipped
    text = b'{"ph": "X", "name": "a", "\\u0069d": 5, "args": {"\\u0045xternal id": 6, "d\\u0074ype": "Float"}}'
    bulk, one = _both_decoders(text)
    _assert_same_rows(bulk, one)
    assert (bulk["flow_id"][0], bulk["external_id"][0], bulk["coll_dtype"][0]) == (5, 6, "Float")
    # text that is not UTF-8 inside args (which the bulk decoder keeps as text) is not
    # decoded in bulk; element by element, that event is invalid and the others load
    bad = b'{"ph": "X", "name": "b", "args": {"x": "\xff"}}'
    assert kineto.frame_from_text(text + b",\n  " + bad, 1, b"},\n  {") is None
    df, meta, ctx = parse(b'{"traceEvents": [\n  ' + text + b",\n  " + bad + b"\n]}")
    assert df["category"].to_list() == ["uncategorized", "invalid"] and meta["bad_events"] == 1
    assert df["flow_id"][0] == 5
