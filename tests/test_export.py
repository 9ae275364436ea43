"""`forensics export`: Parquet files per table and the merged Chrome/Perfetto trace."""
from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import forensics
from forensics import export
from forensics.cli import app

LOGS = {
    "train.log": (
        "[2026-11-30 00:32:30,100] [INFO] [trainer.py:10] starting step 1\n"
        "[2026-11-30 00:32:31,200] [WARNING] [trainer.py:20] grad norm is large\n"
        "[2026-11-30 00:32:35,724] [ERROR] [trainer.py:30] torch.OutOfMemoryError: CUDA out of memory\n"
    ),
    "other.log": (
        "2026-11-30 00:32:29,000 - INFO - worker up\n"
        "2026-11-30 00:32:36,000 - ERROR - RuntimeError: peer went away\n"
    ),
    "stderr.txt": "/x/y.py:3: UserWarning: no stamp on this line\n",
    "metrics.jsonl": (
        '{"step": 1, "data": {"timing_s/gen": 1.5, "actor/lr": 1e-5}}\n'
        '{"step": 2, "data": {"timing_s/gen": 1.25, "actor/lr": 1e-5}}\n'
    ),
}


@pytest.fixture(scope="module")
def small_db(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("logs")
    for name, text in LOGS.items():
        (root / name).write_text(text)
    db = tmp_path_factory.mktemp("db") / "small.duckdb"
    forensics.ingest(root, db=db, workers=1).close()
    return db


@pytest.fixture(scope="module")
def straggler_db(corpus, tmp_path_factory) -> Path:
    case = corpus / "real" / "straggler"
    if not case.is_dir():
        pytest.skip("real/straggler not in the corpus")
    db = tmp_path_factory.mktemp("straggler") / "straggler.duckdb"
    # one worker, like conftest.ingested_corpus: a forked parser pool can hang in a
    # process that has already used polars threads (as pytest has by now)
    forensics.ingest(case, db=db, workers=1, exclude=["label.json"]).close()
    return db


def _table_counts(db: Path) -> dict[str, int]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return {t: con.execute(f'SELECT count(*) FROM "{t}"').fetchall()[0][0] for t in export.base_tables(con)}
    finally:
        con.close()


def _assert_round_trip(db: Path, out: Path) -> dict[str, int]:
    with forensics.open(db) as run:
        written = run.export_parquet(out)
    expected = _table_counts(db)
    assert written == expected
    assert sorted(p.stem for p in out.glob("*.parquet")) == sorted(expected)
    con = duckdb.connect()
    for table, rows in expected.items():
        path = out / f"{table}.parquet"
        # three readers that know nothing of this package
        assert pq.read_table(path).num_rows == rows, table
        assert pl.read_parquet(path).height == rows, table
        assert con.execute("SELECT count(*) FROM read_parquet(?)", [str(path)]).fetchall()[0][0] == rows, table
    return expected


def test_parquet_round_trip(small_db, tmp_path):
    counts = _assert_round_trip(small_db, tmp_path / "pq")
    assert counts["lines"] == 8 and counts["metrics"] == 4
    # columns and types survive: timestamps stay timestamps
    lines = pl.read_parquet(tmp_path / "pq" / "lines.parquet")
    assert lines.schema["ts"] == pl.Datetime("us")
    assert set(lines.columns) >= {"file_id", "line_no", "ts", "level", "message", "text"}


def test_parquet_round_trip_straggler(straggler_db, tmp_path):
    counts = _assert_round_trip(straggler_db, tmp_path / "pq")
    assert counts["lines"] > 0 and counts["metrics"] > 0


def test_parquet_unknown_table_is_an_error(small_db, tmp_path):
    with forensics.open(small_db) as run, pytest.raises(KeyError, match="no table"):
        run.export_parquet(tmp_path, tables=["nope"])


def _events(path: Path) -> list[dict]:
    doc = json.loads(path.read_text())
    assert isinstance(doc["traceEvents"], list)
    return doc["traceEvents"]


def _process_names(events: list[dict]) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}


def _assert_well_formed(events: list[dict]) -> None:
    named_threads = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    pids = set(_process_names(events))
    for e in events:
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert e["pid"] in pids
        if e["ph"] == "M":
            continue
        assert (e["pid"], e["tid"]) in named_threads
        assert e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0


def _export_trace(db: Path, out: Path) -> tuple[export.ChromeTraceSummary, list[dict]]:
    """Export, parse back, check the structure every trace must have."""
    with forensics.open(db) as run:
        summary = run.export_chrome_trace(out)
    events = _events(out)
    _assert_well_formed(events)
    assert summary.events == len(events)
    return summary, events


def test_chrome_trace_log_lines(small_db, tmp_path):
    summary, events = _export_trace(small_db, tmp_path / "trace.json")
    logs = [e for e in events if e.get("cat", "").startswith("log")]
    assert summary.by_kind["log"] == len(logs) == 3
    files = {e["args"]["file"] for e in logs}
    assert files == {"train.log:2", "train.log:3", "other.log:2"}
    assert {e["args"]["level"] for e in logs} == {"WARNING", "ERROR"}
    # the earliest placed event is ts 0; the unstamped warning is counted, not placed
    assert min(e["ts"] for e in logs) == 0
    assert summary.unplaced_log_lines == 1
    assert summary.origin_utc == "2026-11-30T00:32:31.200000Z"
    # lines with no rank get one process per file, named after it
    assert sorted(_process_names(events).values()) == ["log other.log", "log train.log"]


FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="module")
def traces_db(tmp_path_factory) -> Path:
    """A tiny PyTorch profiler trace (rank 1: ProfilerStep#2, update_actor, an NCCL kernel,
    a memcpy, a python_function with quotes in its name) and a tiny Ray timeline."""
    root = tmp_path_factory.mktemp("traces")
    for src in (FIXTURES / "kineto" / "rank3.tiny.pt.trace.json", FIXTURES / "timeline" / "timeline.json"):
        shutil.copy(src, root / src.name)
    db = tmp_path_factory.mktemp("db") / "traces.duckdb"
    forensics.ingest(root, db=db, workers=1).close()
    return db


def _threads(events: list[dict]) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}


def test_chrome_trace_profiler_and_ray_timeline(traces_db, tmp_path):
    summary, events = _export_trace(traces_db, tmp_path / "t.json")
    procs = _process_names(events)
    threads = _threads(events)
    rank = next(pid for pid, name in procs.items() if name == "rank 1")
    by_name = {(e["name"], e["cat"]): e for e in events if e["ph"] != "M" and e["pid"] == rank}
    kernel = by_name[("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel")]
    assert threads[(rank, kernel["tid"])] == "GPU 0 stream 7"
    assert kernel["args"]["Collective name"] == "allreduce" and kernel["dur"] == 1159.5
    # sub-microsecond offsets survive the move to wall-clock time
    annotation = by_name[("update_actor", "user_annotation")]
    assert kernel["ts"] - annotation["ts"] == pytest.approx(300.75, abs=1e-3)
    assert threads[(rank, annotation["tid"])] == "kineto thread 928"
    assert ("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy") in by_name
    assert not any(e.get("cat") == "python_function" for e in events)  # not a default category
    # the phase the annotation maps to, on the rank's phases track
    phases = [e for e in events if e.get("cat") == "phase" and e["pid"] == rank]
    assert [(p["name"], threads[(rank, p["tid"])]) for p in phases] == [("train", "phases")]
    # the Ray timeline: a process for the node, a track per worker
    ray = next(pid for pid, name in procs.items() if name == "ray 10.0.0.2")
    ray_events = [e for e in events if e["pid"] == ray and e["ph"] == "X"]
    update = next(e for e in ray_events if e["name"] == "update_actor")
    assert threads[(ray, update["tid"])] == "ray thread worker:15f2291e85904c5a00adb493675b67de4b1c107b5956cef19fa16a51"
    assert all(threads[(ray, e["tid"])].startswith("ray thread ") for e in ray_events)
    assert summary.by_kind["trace"] == len([e for e in events if e.get("cat") not in ("phase", None)])


def test_chrome_trace_categories(traces_db, tmp_path):
    out = tmp_path / "t.json"
    with forensics.open(traces_db) as run:
        run.export_chrome_trace(out, categories=["python_function", "cpu_op", "user_annotation"])
    events = _events(out)
    names = {e["name"] for e in events if e["ph"] == "X" and e.get("cat") == "python_function"}
    assert names == {'verl/workers/fsdp_workers.py(512): update_actor "quoted" }, {'}
    assert not any(e.get("cat") == "kernel" for e in events)
    # offsets finer than a double of epoch microseconds can hold (0.25 us) survive
    ts = {e["name"]: e["ts"] for e in events if e["ph"] == "X"}
    assert ts["record_param_comms"] - ts["ProfilerStep#2"] == pytest.approx(199.625, abs=1e-3)


def test_chrome_trace_of_empty_database(tmp_path):
    db = tmp_path / "empty.duckdb"
    forensics.open(db, write=True).close()
    summary, events = _export_trace(db, tmp_path / "t.json")
    assert events == []
    assert summary.events == 0 and summary.processes == []


def test_chrome_trace_straggler(straggler_db, tmp_path):
    _, events = _export_trace(straggler_db, tmp_path / "straggler.json")
    names = _process_names(events)
    rank_pid = {int(n.split("rank ")[1].split()[0]): pid for pid, n in names.items() if "rank " in n}
    assert set(rank_pid) == {0, 1}
    per = Counter((e["pid"], e.get("cat")) for e in events if e["ph"] != "M")
    for rank, pid in rank_pid.items():
        assert per[(pid, "kernel")] > 1000, f"rank {rank} has no kernels"
        assert per[(pid, "phase")] > 0, f"rank {rank} has no phase spans"
    phases = {e["name"] for e in events if e.get("cat") == "phase"}
    assert {"rollout", "train"} <= phases


def test_cli_export(small_db, tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["export", "--db", str(small_db), "--parquet", str(tmp_path / "pq"),
                              "--chrome-trace", str(tmp_path / "t.json"), "--json"])
    assert res.exit_code == 0, res.output
    payload = json.loads(res.stdout)
    assert payload["parquet"]["tables"]["lines"] == 8
    assert payload["chrome_trace"]["events"] == len(_events(tmp_path / "t.json"))
    res = runner.invoke(app, ["export", "--db", str(small_db)])
    assert res.exit_code == 2
    assert "nothing to export" in res.output


def test_straggler_collective_waits_in_views(straggler_db):
    """The views the trace is drawn from tell the straggler story in numbers: rank 1
    arrives late at the gradient all-reduces, rank 0 waits for it."""
    with forensics.open(straggler_db) as run:
        coll = {(r["rank"], r["coll_name"]): r for r in run.sql("SELECT * FROM collectives_by_rank WHERE source = 'trace'").to_dicts()}
        assert coll[(0, "allreduce")]["wait_s"] > 0.5 and coll[(1, "allreduce")]["late_s"] > 0.5
        assert coll[(1, "allreduce")]["wait_s"] < 0.05
        top = run.sql("SELECT short_name FROM top_kernels_by_phase WHERE phase = 'train' AND position = 1").item()
        assert top.startswith("ncclDevKernel_AllReduce")
