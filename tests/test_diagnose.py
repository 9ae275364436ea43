"""Diagnosis on small hand-written bundles (tests/fixtures/diag_*), the contract's JSON shape,
the CLI, the metric detectors and the remediation text."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from forensics import api, detectors, pipeline
from forensics import diagnose as dg
from forensics import catalogue as sig
from forensics.diagnosis import explain, matching
from forensics.cli import app

from .conftest import FIXTURES

BUNDLES = sorted(p for p in FIXTURES.glob("diag_*") if (p / "expected.json").exists())
TAXONOMY_IDS = set(sig.load().classes)


@pytest.fixture(scope="module")
def diagnosed(tmp_path_factory) -> dict[str, tuple[Path, dg.Diagnosis, dict]]:
    base = tmp_path_factory.mktemp("diag")
    out = {}
    for b in BUNDLES:
        db = base / f"{b.name}.duckdb"
        pipeline.ingest([str(b)], str(db), workers=1, exclude=["expected.json"])
        out[b.name] = (db, dg.diagnose(db), json.loads((b / "expected.json").read_text()))
    return out


@pytest.mark.parametrize("name", [b.name for b in BUNDLES])
def test_fixture_bundle(diagnosed, name):
    db, d, want = diagnosed[name]
    top = d.root_causes[0] if d.root_causes else None
    got = top.id if top else "healthy"
    assert got == want["root_cause"], dg.render(d)
    assert d.verdict == want.get("verdict", "healthy" if want["root_cause"] == "healthy" else "failed"), dg.render(d)
    if "diagnosis_notes_contain" in want:
        assert any(want["diagnosis_notes_contain"] in n for n in d.notes), d.notes
    if top is None:
        for fid in want.get("findings_include", []):
            assert fid in {f.id for f in d.findings}, d.findings
        return
    if "rank" in want:
        assert top.rank == want["rank"], f"rank {top.rank} ({top.rank_source})"
    if "phase" in want:
        assert top.phase == want["phase"]
    if "step" in want:
        assert top.step == want["step"]
    if "evidence" in want:
        e = top.evidence[0]
        assert (e.file, e.line) == (want["evidence"]["file"], want["evidence"]["line"]), dg.render(d)
    for s in want.get("symptoms_include", []):
        assert s in top.symptoms
    if "summary_contains" in want:
        assert want["summary_contains"] in top.summary, top.summary
    if "remediation_contains" in want:
        assert any(want["remediation_contains"] in r for r in top.remediation), top.remediation
    if "notes_contain" in want:
        assert any(want["notes_contain"] in n for n in top.notes), top.notes
    if "cascade_contains" in want:
        assert any(want["cascade_contains"] in c for c in top.cascade), top.cascade


def test_contract_json_shape(diagnosed):
    for name, (db, d, want) in diagnosed.items():
        doc = json.loads(json.dumps(d.to_dict()))
        assert doc["verdict"] in ("failed", "healthy", "incomplete")  # ../shared/contract.md
        assert isinstance(doc["root_causes"], list) and isinstance(doc["findings"], list)
        assert (doc["verdict"] != "failed") == (not doc["root_causes"]), name
        for rc in doc["root_causes"]:
            assert rc["id"] in TAXONOMY_IDS and rc["id"] != "healthy"
            assert 0 <= rc["confidence"] <= 1
            assert rc["rank"] is None or isinstance(rc["rank"], int)
            assert rc["node"] is None or isinstance(rc["node"], str)
            assert rc["phase"] in (None, "rollout", "reward", "train", "sync", "init", "other")
            assert rc["step"] is None or isinstance(rc["step"], int)
            assert rc["evidence"], name
            for e in rc["evidence"]:
                assert isinstance(e["file"], str) and isinstance(e["line"], int) and isinstance(e["text"], str)
            assert all(s in TAXONOMY_IDS and s != rc["id"] for s in rc["symptoms"])
            assert all(isinstance(r, str) for r in rc["remediation"])
        for f in doc["findings"]:
            assert {"id", "rank", "detail"} <= set(f)


def test_evidence_line_is_the_physical_line(diagnosed):
    """The cited line number and text are those of the file as `grep -n` shows it."""
    for name, (db, d, want) in diagnosed.items():
        for rc in d.root_causes:
            for e in rc.evidence:
                path = FIXTURES / name / e.file
                if not path.exists():
                    continue
                raw = path.read_text().split("\n")[e.line - 1]
                assert e.text.strip() in raw, (name, e.file, e.line)


def test_cascade_names_the_root_rank(diagnosed):
    _, d, _ = diagnosed["diag_xid79_cascade"]
    top = d.root_causes[0]
    assert top.rank == 1 and top.rank_source == "missing_from_cascade"
    assert any(c.startswith("rank 0: watchdog timeout on _ALLGATHER_BASE SeqNum 8812 after 600 s") and "gpu_hardware on rank 1" in c
               for c in top.cascade), top.cascade


def test_render_and_headline(diagnosed):
    db, d, _ = diagnosed["diag_oom_rollout_oldtorch"]
    text = dg.render(d)
    assert "root cause: oom_generation" in text and "train.log:24" in text and "remediation:" in text
    head = dg.headline(db)
    assert head.startswith("failed: oom_generation") and "train.log:24" in head
    db, d, _ = diagnosed["diag_healthy_benign"]
    assert dg.headline(db).startswith("healthy")


def test_inferred_times_are_said(diagnosed):
    _, d, _ = diagnosed["diag_oom_train_torchrun"]
    assert any("no timestamp" in n for n in d.root_causes[0].notes)


def test_cli_diagnose(diagnosed, tmp_path):
    runner = CliRunner()
    db, _, _ = diagnosed["diag_healthy_benign"]
    r = runner.invoke(app, ["diagnose", "--db", str(db), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["verdict"] == "healthy"
    db, _, _ = diagnosed["diag_nccl_timeout_pure"]
    r = runner.invoke(app, ["diagnose", "--db", str(db)])
    assert r.exit_code == 0, r.output
    assert "root cause: nccl_timeout" in r.output
    r = runner.invoke(app, ["diagnose", "--db", str(tmp_path / "missing.duckdb")])
    assert r.exit_code != 0


def test_api_run_diagnose(diagnosed):
    db, d, _ = diagnosed["diag_gcs_lost"]
    with api.open(db) as run:
        assert run.diagnose().to_dict()["root_causes"][0]["id"] == "ray_cluster"


def test_ingest_prints_the_headline(tmp_path):
    r = CliRunner().invoke(app, ["ingest", str(FIXTURES / "diag_gcs_lost"), "--db", str(tmp_path / "g.duckdb"),
                                 "-x", "expected.json", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["diagnosis"].startswith("failed: ray_cluster")


# -- remediation text --------------------------------------------------------------------

@pytest.mark.parametrize("remedy, config, text", [
    (sig.Remedy(key="a.b", scale=0.5, why="w"), {"a.b": 8}, "a.b is 8 here; try 4 (w)"),
    (sig.Remedy(key="a.b", scale=0.8, min=0.3), {"a.b": 0.9}, "a.b is 0.9 here; try 0.72"),
    (sig.Remedy(key="a.b", scale=0.5), {"a.b": 1}, None),  # already as low as it goes
    (sig.Remedy(key="a.b", to=True), {"a.b": True}, None),  # already what we suggest
    (sig.Remedy(key="a.b", to=True), {}, "a.b: try True"),
    (sig.Remedy(key="a.b", scale=0.5), {}, "a.b: lower it"),
    (sig.Remedy(text="free some space"), {}, "free some space"),
])
def test_remedy_text(remedy, config, text):
    assert explain._remedy_text(remedy, dg.RunConfig(config)) == text


def test_ranks_text():
    assert explain._ranks_text([3]) == "rank 3"
    assert explain._ranks_text([0, 1, 2, 3, 5, 7, 8]) == "ranks 0-3,5,7-8"


# -- metric detectors --------------------------------------------------------------------------

SETTINGS = sig.load().metric_detectors


def _series(key: str, values: list[float], start: int = 1) -> detectors.Series:
    return detectors.Series(key, 1, "m.jsonl", "jsonl", [(start + i, v, start + i, None) for i, v in enumerate(values)])


def test_detector_spike_and_nonfinite():
    div = SETTINGS["divergence"]
    g = _series("actor/grad_norm", [0.4, 0.5, 0.45, 0.42, 0.48, 0.41, 7.0, math.inf])
    (spike,) = detectors.spike([g], div["spike"])
    assert spike.step == 7 and spike.line_no == 7
    (nf,) = detectors.nonfinite([g], div)
    assert nf.step == 8
    calm = _series("actor/grad_norm", [0.4, 0.5, 0.45, 0.42, 0.48, 0.41, 1.9, 2.0])
    assert detectors.spike([calm], div["spike"]) == []
    lone = _series("actor/grad_norm", [0.4, 0.5, 0.45, 0.42, 0.48, 0.41, 9.0, 0.44, 0.43, 0.47])
    assert detectors.spike([lone], div["spike"]) == []  # one spike that recovered is not a divergence


def test_detector_regime_change_after_lr_jump():
    rc = SETTINGS["divergence"]["regime_change"]
    lr = _series("actor/lr", [1e-6] * 10 + [3e-4] * 5)
    ent = _series("actor/entropy", [2.0, 2.01, 1.99, 2.0, 2.02, 1.98, 2.0, 2.01, 2.0, 1.99, 2.0, 1.6, 1.1, 0.7, 0.5])
    (a,) = detectors.regime_change([lr, ent], rc)
    assert a.step == 12 and "jumped 300x at step 11" in a.detail
    warmup = _series("actor/lr", [0.0, 1e-7, 2e-7, 4e-7, 8e-7, 1e-6, 1e-6])  # a schedule, no jump
    assert detectors.regime_change([warmup, ent], rc) == []


def test_detector_entropy_collapse_vs_divergence():
    col = SETTINGS["entropy"]
    decay = [0.6 * 0.93 ** i for i in range(60)]
    (a,) = detectors.entropy_collapse([_series("actor/entropy", decay)], col)
    assert decay[a.step - 1] < col["floor"] and decay[a.step - 2] >= col["floor"]
    noisy_high = [0.6 + 0.01 * (i % 3) for i in range(60)]
    assert detectors.entropy_collapse([_series("actor/entropy", noisy_high)], col) == []
    with_nan = decay[:30] + [math.nan] + decay[31:]
    assert detectors.entropy_collapse([_series("actor/entropy", with_nan)], col) == []


def test_detector_score_collapse():
    sc = SETTINGS["divergence"]["score_collapse"]
    up_then_down = [0.2, 0.3, 0.4, 0.5, 0.6, 0.62, 0.63, 0.61, 0.62, 0.3, 0.2, 0.1, 0.1, 0.05, 0.1]
    (a,) = detectors.score_collapse([_series("critic/score/mean", up_then_down)], sc)
    assert a.step == 10
    plateau = [0.2, 0.3, 0.4, 0.5, 0.6, 0.62, 0.63, 0.61, 0.62, 0.6, 0.55, 0.58, 0.6]
    noisy_dip = [0.6, 0.62, 0.63, 0.61, 0.62, 0.4, 0.38, 0.41, 0.6, 0.62, 0.61]  # a 35% dip that recovers
    assert detectors.score_collapse([_series("critic/score/mean", noisy_dip)], sc) == []
    assert detectors.score_collapse([_series("critic/score/mean", plateau)], sc) == []
    # at the edge of the shortcut that skips series which cannot collapse: a flat best and
    # a run exactly at (1 - drop) x best still fires
    w, drop, sustain = int(sc["window"]), float(sc["drop"]), int(sc["sustain"])
    edge = [0.8] * (w + 1) + [(1 - drop) * 0.8] * sustain
    (e,) = detectors.score_collapse([_series("critic/score/mean", edge)], sc)
    assert e.step == w + 2
    above = [0.8] * (w + 1) + [(1 - drop) * 0.8 + 1e-9] * sustain
    assert detectors.score_collapse([_series("critic/score/mean", above)], sc) == []


def test_empty_database_cannot_be_diagnosed(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "worker.err").write_bytes(b"")  # a folder with nothing in it is nothing to ingest (tests/test_runs.py)
    db = tmp_path / "e.duckdb"
    pipeline.ingest([str(empty)], str(db), workers=1)
    with pytest.raises(dg.NothingToDiagnose):
        dg.diagnose(db)
    assert dg.headline(db).startswith("nothing to diagnose")
    r = CliRunner().invoke(app, ["diagnose", "--db", str(db)])
    assert r.exit_code != 0 and "no log lines" in r.output


def _alarm_rows(alarms: list[detectors.Alarm]) -> list[tuple]:
    return [(a.cls, a.detector, a.step, a.key, repr(a.value), a.path, a.line_no, a.source, a.detail, a.ts, a.also) for a in alarms]


def test_detectors_by_chunks_of_files_find_the_same_alarms(tmp_path, monkeypatch):
    """Metric series are loaded a few files at a time (memory bounded by CHUNK_POINTS);
    the alarms, their corroborating lines in other files and their times do not depend
    on how the files were cut into chunks."""
    root = tmp_path / "run"
    for i, name in enumerate(("diag_divergence_console", "diag_divergence_console", "diag_healthy_benign")):
        shutil.copytree(FIXTURES / name, root / f"{i}-{name}", ignore=shutil.ignore_patterns("expected.json"))
    db = str(tmp_path / "c.duckdb")
    pipeline.ingest([str(root)], db, workers=1)
    settings = sig.load().metric_detectors
    con = duckdb.connect(db, read_only=True)
    try:
        assert len(detectors._file_chunks(con, detectors._watched_keys(con, ["."]), 1)) > 1
        whole = _alarm_rows(detectors.run(con, settings))
        monkeypatch.setattr(detectors, "CHUNK_POINTS", 1)  # one file per chunk
        chunked = _alarm_rows(detectors.run(con, settings))
    finally:
        con.close()
    assert whole and chunked == whole
    assert any(row[-1] for row in whole), "the copy of the console log corroborates the alarm"


@pytest.mark.parametrize("command", [["diagnose"], ["report", "-o", "r.html"]])
def test_a_bad_memory_setting_is_named(tmp_path, monkeypatch, command):
    """The diagnosis and the report read FORENSICS_DB_MEMORY as ingest does."""
    db = str(tmp_path / "m.duckdb")
    pipeline.ingest([str(FIXTURES / "diag_divergence_console")], db, workers=1)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FORENSICS_DB_MEMORY", "lots")
    res = CliRunner().invoke(app, [*command, "--db", db])
    assert res.exit_code == 2, res.output
    assert "FORENSICS_DB_MEMORY='lots'" in res.output
    assert not (tmp_path / "r.html").exists()
    monkeypatch.setenv("FORENSICS_DB_MEMORY", "256MB")
    assert CliRunner().invoke(app, [*command, "--db", db]).exit_code == 0


def test_node_of_a_pid_breaks_ties_by_name(tmp_path):
    """A pid seen on two nodes equally often gets the same node on every run (the
    first by name), not whichever row a parallel query returned first."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "a_driver.log").write_text("(WorkerDict pid=4242, ip=10.0.0.9) starting\n(WorkerDict pid=4242, ip=10.0.0.9) step\n")
    (run / "b_driver.log").write_text("(WorkerDict pid=4242, ip=10.0.0.1) starting\n(WorkerDict pid=4242, ip=10.0.0.1) step\n")
    db = str(tmp_path / "n.duckdb")
    pipeline.ingest([str(run)], db, workers=1)
    cat = sig.load()
    con = duckdb.connect(db, read_only=True)
    try:
        dg.ensure_views(con)
        matching.match(con, cat.rules, cat.rank_zero_prints)
        assert set(con.execute("SELECT DISTINCT node FROM lines WHERE pid = 4242").fetchall()) == {("10.0.0.9",), ("10.0.0.1",)}
        assert dg.RunFacts(con, cat).pid_node[4242] == "10.0.0.1"
    finally:
        con.close()


def _crlf(text: str) -> str:
    return text.replace("\n", "\r\n")


def _double_spaced(text: str) -> str:
    return "\n\n".join(text.split("\n"))


@pytest.mark.parametrize("name,how", [
    ("diag_wrapped_watchdog_paste", _crlf),  # a hard-wrapped paste saved with Windows line ends
    ("diag_capture_segfault", _double_spaced),
    ("diag_watchdog_rank_in_what", _double_spaced),
    ("diag_engine_utility_call_failed", _double_spaced),
    ("diag_healthy_scary_warnings", _double_spaced),  # a traceback logged by a warning stays handled
    ("diag_healthy_exception_ignored", _double_spaced),
])
def test_the_same_answer_whatever_the_paste_did_to_line_ends(diagnosed, tmp_path, name, how):
    """A paste keeps its meaning when its line ends were changed on the way: CR LF kept, or
    every line break doubled. The root cause, its rank and its evidence line (counted in the
    pasted file) are the diagnosis of the original."""
    _, d, want = diagnosed[name]
    bundle = tmp_path / name
    shutil.copytree(FIXTURES / name, bundle)
    for f in bundle.iterdir():
        if f.name != "expected.json":
            f.write_bytes(how(f.read_text()).encode())
    db = tmp_path / "p.duckdb"
    pipeline.ingest([str(bundle)], str(db), workers=1, exclude=["expected.json"])
    got = dg.diagnose(db)
    assert got.verdict == d.verdict, dg.render(got)
    if not d.root_causes:
        assert not got.root_causes, dg.render(got)
        return
    a, b = d.root_causes[0], got.root_causes[0]
    assert (b.id, b.rank) == (a.id, a.rank), dg.render(got)
    line = a.evidence[0].line if how is _crlf else 2 * a.evidence[0].line - 1
    assert (b.evidence[0].file, b.evidence[0].line) == (a.evidence[0].file, line), dg.render(got)
