"""The Python API (`forensics.open`, `forensics.ingest`, `Run`) and the question views
(forensics/sql/7*_*.sql) it and the command line stand on."""
from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

import forensics
from forensics.api import Run
from forensics.cli import app

DRIVER = (
    "2026-03-09 14:00:00,000\tINFO worker.py:1841 -- Started a local Ray instance.\n"
    "(TaskRunner pid=100) step:1 - timing_s/gen:1.500 - actor/lr:0.00001\n"
    "(TaskRunner pid=100) step:2 - timing_s/gen:1.250 - actor/lr:0.00001\n"
    "(WorkerDict pid=200, ip=10.0.0.1) [rank0]: computing advantages\n"
    "(WorkerDict pid=201, ip=10.0.0.2) [rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    "(WorkerDict pid=200, ip=10.0.0.1) UserWarning: something odd [repeated 3x across cluster]\n"
)
METRICS = (
    '{"step": 1, "data": {"timing_s/gen": 1.4999, "actor/lr": 1e-5, "critic/score/mean": NaN}}\n'
    '{"step": 2, "data": {"timing_s/gen": 1.2501, "actor/lr": 1e-5, "critic/score/mean": 0.5}}\n'
)


@pytest.fixture(scope="module")
def run_db(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("logs")
    (root / "driver.log").write_text(DRIVER)
    (root / "metrics.jsonl").write_text(METRICS)
    db = tmp_path_factory.mktemp("db") / "run.duckdb"
    run = forensics.ingest(root, db=db, workers=1)
    assert isinstance(run, Run) and run.last_ingest.files_loaded == 2
    run.close()
    return db


@pytest.fixture()
def run(run_db):
    with forensics.open(run_db) as r:
        yield r


def test_open_is_read_only_and_needs_a_database(run, tmp_path):
    with pytest.raises(forensics.api.ForensicsError, match="forensics ingest"):
        forensics.open(tmp_path / "missing.duckdb")
    with pytest.raises(Exception, match="read-only"):
        run.sql("CREATE TABLE x (a INTEGER)")


def test_sql_returns_polars_with_parameters(run):
    df = run.sql("SELECT path, line_no FROM log WHERE line_no = ? ORDER BY path", [5])
    assert isinstance(df, pl.DataFrame)
    assert df.rows() == [("driver.log", 5)]


def test_metrics_wide_long_and_keys(run):
    wide = run.metrics()
    assert wide.columns == ["step", "actor/lr", "critic/score/mean", "timing_s/gen"]
    assert wide["step"].to_list() == [1, 2]
    # the console line and the JSONL record say the same: the JSONL value (full precision) wins
    assert wide["timing_s/gen"].to_list() == [1.4999, 1.2501]
    assert math.isnan(wide["critic/score/mean"][0])
    long = run.metrics(wide=False, keys=["timing_s/gen"])
    assert long.columns == ["step", "key", "value", "value_text", "ts", "reports"]
    assert long["reports"].to_list() == [2, 2]
    assert run.metrics(keys=["nope"]).columns == ["step"]
    with pytest.raises(ValueError):
        run.metrics(keys=[])


def test_metrics_by_step_view(run):
    row = run.sql('SELECT step, "timing_s/gen", metrics[\'actor/lr\'] AS lr FROM metrics_by_step WHERE step = 2').row(0)
    assert row == (2, 1.2501, 1e-5)


def test_error_lines_infer_levels_and_weights(run):
    df = run.sql("SELECT line_no, level, level_inferred, weight, rank, node FROM error_lines ORDER BY line_no")
    # the exception line has its traceback's level from the parser now (not inferred by the view)
    assert df.rows() == [(5, "ERROR", False, 1, 1, "10.0.0.2"), (6, "WARNING", True, 3, None, "10.0.0.1")]
    by_rank = run.sql("SELECT rank, errors, warnings, first_error FROM errors_by_rank ORDER BY rank NULLS LAST")
    assert by_rank.rows()[0][:3] == (1, 1, 0)
    assert by_rank.rows()[0][3].startswith("driver.log:5 torch.OutOfMemoryError")
    assert by_rank.rows()[1][:3] == (None, 0, 3)


def test_last_lines(run):
    last = run.last_lines(n=1)
    per_stream = {s: (line, rank) for s, line, rank in last.select("stream", "line_no", "rank").iter_rows()}
    assert per_stream["node 10.0.0.2 pid 201"] == (5, 1)
    # one process: its line with a rank prefix and its line without are one stream of rank 0
    assert per_stream["node 10.0.0.1 pid 200"] == (6, 0)
    assert set(last["back"]) == {1}
    before = run.last_lines(n=5, before_first_error=True)
    assert before["line_no"].max() <= 6
    # the table macro takes any n and cut-off
    assert run.sql("SELECT count(*) FROM tail_lines(2) WHERE stream = 'node 10.0.0.1 pid 200'").item() == 2


def test_question_views_exist_on_an_empty_database(tmp_path):
    db = tmp_path / "empty.duckdb"
    forensics.open(db, write=True).close()
    with forensics.open(db) as r:
        views = r.views()
        assert views and not [v for v in views if v.startswith("_")], "run.views() lists the modules' helpers"
        assert "_phase_trace" in r.tables()
        for view in ["error_lines", "errors_by_rank", "last_lines", "last_lines_before_error", "step_metrics",
                     "metrics_by_step", "collectives_by_rank", "kernel_time_by_phase", "top_kernels_by_phase"]:
            assert view in views
            assert r.sql(f"SELECT * FROM {view}").height == 0
        assert r.metrics().height == 0


def test_diagnose_is_typed_and_matches_the_cli(run, run_db):
    diagnosis = run.diagnose()
    payload = diagnosis.to_dict()
    assert set(payload) >= {"verdict", "root_causes", "findings"}
    assert payload["verdict"] == "failed"
    cause = payload["root_causes"][0]
    assert cause["id"] == "oom_training" and cause["rank"] == 1
    first = cause["evidence"][0]
    assert (first["file"], first["line"]) == ("driver.log", 5) and "CUDA out of memory" in first["text"]
    res = CliRunner().invoke(app, ["diagnose", "--db", str(run_db), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == json.loads(json.dumps(payload))


def test_cli_query_is_the_api(run, run_db):
    sql = "SELECT step, key, value FROM step_metrics ORDER BY step, key"
    res = CliRunner().invoke(app, ["query", sql, "--db", str(run_db), "--format", "json"])
    assert res.exit_code == 0, res.output

    def strict(constant):
        raise ValueError(f"not JSON: {constant}")

    # NaN (step 1's critic/score/mean) is printed as null: strict JSON parsers accept the output
    got = json.loads(res.stdout, parse_constant=strict)
    want = [{**r, "value": None if math.isnan(r["value"]) else r["value"]} for r in run.sql(sql).to_dicts()]
    assert got == want and None in [r["value"] for r in got]


PUBLIC_FUNCTIONS = [forensics.open, forensics.ingest]


def _public_methods():
    return [m for name, m in inspect.getmembers(Run, inspect.isfunction) if not name.startswith("_")]


@pytest.mark.parametrize("fn", PUBLIC_FUNCTIONS + _public_methods(), ids=lambda f: f.__qualname__)
def test_public_surface_has_docstrings_and_type_hints(fn):
    assert inspect.getdoc(fn), f"{fn.__qualname__} has no docstring"
    sig = inspect.signature(fn)
    for name, param in sig.parameters.items():
        if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        assert param.annotation is not inspect.Parameter.empty, f"{fn.__qualname__}({name}) has no type hint"


# the tiny profiler trace + Ray timeline database of the export tests
from tests.test_export import traces_db  # noqa: E402,F401  (a fixture)


def test_kernel_views_over_a_profiler_trace(traces_db):  # noqa: F811
    with forensics.open(traces_db) as r:
        by_phase = r.sql("SELECT rank, phase, steps, kernel_s, nccl_s, gpu_s, share, events FROM kernel_time_by_phase ORDER BY phase")
        # the NCCL kernel starts inside update_actor (train) of ProfilerStep#2; the memcpy
        # after update_actor ended, when no phase was open (idle)
        # (phase_gpu works on epoch microseconds, exact to 0.25 us at today's dates)
        us = pytest.approx(3.456e-6, abs=0.25e-6)
        assert by_phase.rows() == [
            (1, "idle", 1, us, 0.0, us, pytest.approx(0.003, abs=3e-4), 1),
            (1, "train", 1, 0.0, pytest.approx(1159.5e-6), pytest.approx(1159.5e-6), pytest.approx(0.997, abs=3e-4), 1),
        ]
        top = r.sql("SELECT phase, position, short_name, calls, total_s, ranks FROM top_kernels_by_phase")
        assert top.rows() == [("train", 1, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 1, pytest.approx(1159.5e-6), 1)]
        coll = r.sql("SELECT source, rank, pg_name, coll_name, calls, elements, wait_s FROM collectives_by_rank")
        # one rank only: nothing to match across ranks, so no wait figures
        assert coll.rows() == [("trace", 1, "0", "allreduce", 1, 32768000, None)]


def test_cli_prints_log_text_verbatim(tmp_path):
    """Log text is not rich markup and has no emoji codes: `[/red]` must not stop a command
    (it did: MarkupError after a successful ingest) and `:100:` (file:line:) must stay text."""
    logs = tmp_path / "logs"
    logs.mkdir()
    bad = "torch.OutOfMemoryError: CUDA out of memory [/red] :100: [bold]boom"
    (logs / "w.err").write_text(f'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n{bad}\n')
    db = str(tmp_path / "m.duckdb")
    runner = CliRunner()
    for args in (["ingest", str(logs), "--db", db, "-q"], ["query", "SELECT text FROM lines", "--db", db], ["diagnose", "--db", db]):
        res = runner.invoke(app, args)
        assert res.exit_code == 0, (args, res.output)
        assert bad in res.output.replace("\n", ""), (args, res.output)
        assert "\U0001f4af" not in res.output
