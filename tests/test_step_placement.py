"""Steps placed in time from durations (`phase_step_placement`, forensics/sql/phases_placed.sql)
and drawn on the report's timeline: a verl driver log whose step lines carry no time stamp,
with and without the training progress bar; the bundled sample; driver-only corpus logs."""
from __future__ import annotations

import json
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path

import duckdb
import polars as pl
import pytest

from forensics import phases as ph
from forensics import pipeline
from forensics import report as rp

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SAMPLE = Path(__file__).resolve().parent.parent / "sample_logs"


def us(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp() * 1e6


def ingest(tmp_path: Path, src: Path, drop_bar: bool = False, exclude: list[str] = ()) -> Path:
    run = tmp_path / "run"
    if src.is_dir():
        shutil.copytree(src, run, ignore=shutil.ignore_patterns(*exclude) if exclude else None)
    else:
        run.mkdir()
        shutil.copy(src, run / src.name)
    if drop_bar:
        for p in run.rglob("*.log"):
            p.write_text("".join(l for l in p.read_text().splitlines(keepends=True) if "Training Progress" not in l))
    db = tmp_path / "run.duckdb"
    pipeline.ingest([str(run)], str(db), workers=1)
    return db


def placement(db: Path) -> list[dict]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        ph.attach(con)
        return pl.from_arrow(con.sql("SELECT * FROM phase_step_placement ORDER BY step").to_arrow_table()).to_dicts()
    finally:
        con.close()


def timeline(db: Path) -> pl.DataFrame:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return ph.timeline(con)
    finally:
        con.close()


def figure(db: Path, tmp_path: Path) -> dict:
    out = tmp_path / "report.html"
    rp.write_report(db, out)
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', out.read_text(), re.S)
    return json.loads(m.group(1))["figures"]


def test_progress_bar_places_steps_without_stamps(tmp_path):
    """Step lines without a stamp: each step ends where the progress bar's elapsed time puts
    it, the bar started at the last stamped line before it (09:00:30), and the phases are
    laid out backwards from there by their durations, in verl's order."""
    db = ingest(tmp_path, FIXTURES / "report_driver_only")
    rows = placement(db)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert {r["placed_by"] for r in rows} == {"progress bar"}
    # elapsed 01:39, 03:22, 04:59 after 09:00:30
    assert [r["end_us"] for r in rows] == [us("2026-05-04 09:02:09"), us("2026-05-04 09:03:52"), us("2026-05-04 09:05:29")]
    assert rows[0]["start_us"] == us("2026-05-04 09:00:33")  # 96 s of timing_s/step before it
    assert rows[0]["line_no"] == 4  # the step's metric line
    tl = timeline(db).filter(pl.col("step") == 1).sort("start_us")
    assert tl["name"].to_list() == ["untimed part of the step", "timing_s/gen", "timing_s/reward", "timing_s/old_log_prob",
                                    "timing_s/update_actor", "timing_s/update_weights"]
    assert tl["end_us"][-1] == us("2026-05-04 09:02:09") and tl["start_us"][0] == us("2026-05-04 09:00:33")
    assert (tl["start_us"][1:] - tl["end_us"][:-1]).abs().max() < 1  # back to back
    assert tl["approximate"].all() and (tl["placement"] == "progress bar").all()


def test_without_a_bar_steps_are_laid_end_to_end(tmp_path):
    db = ingest(tmp_path, FIXTURES / "report_driver_only", drop_bar=True)
    rows = placement(db)
    assert {r["placed_by"] for r in rows} == {"step durations"}
    # from the last stamp before step 1's line (09:00:30), by timing_s/step: 96, 100.5, 94 s
    assert [r["end_us"] for r in rows] == [us("2026-05-04 09:02:06"), us("2026-05-04 09:03:46.5"), us("2026-05-04 09:05:20.5")]


def test_report_timeline_of_a_driver_log_says_how_it_was_placed(tmp_path):
    figs = figure(ingest(tmp_path, FIXTURES / "report_driver_only"), tmp_path)
    bars = [t for t in figs["timeline"]["data"] if t["type"] == "bar"]
    assert {t["name"] for t in bars} >= {"rollout", "rollout/logprob", "reward", "train", "sync"}
    gen = next(t for t in bars if t["name"] == "rollout")
    assert len(gen["x"]) == 3 and gen["x"][0] == pytest.approx(50.0)
    assert all("placement derived from durations" in h and "progress bar" in h for h in gen["hovertext"])
    # the watchdog timeout of rank 1 (stamped 09:20:00.1) is drawn on rank 1's lane, after the steps
    lanes = figs["timeline"]["layout"]["yaxis"]["ticktext"]
    assert lanes[0] == "run" and "rank 1" in lanes


def test_sample_quick_start_timeline_has_steps_and_phases(tmp_path):
    """The README's quick start on sample_logs/: the diagnosis as before, and a timeline of
    its six steps with their phases, the root cause and what followed it per rank."""
    db = ingest(tmp_path, SAMPLE)
    from forensics import diagnose as dg

    d = dg.diagnose(db).to_dict()
    rc = d["root_causes"][0]
    assert d["verdict"] == "failed" and rc["id"] == "oom_training" and rc["rank"] == 6
    assert [r["step"] for r in placement(db)] == [1, 2, 3, 4, 5, 6]
    figs = figure(db, tmp_path)
    data = {t["name"]: t for t in figs["timeline"]["data"]}
    assert {"rollout", "rollout/logprob", "reward", "train", "sync"} <= set(data)
    assert len(data["train"]["x"]) == 6
    steps = sorted({int(re.search(r"step (\d+)", h).group(1)) for t in data.values() if t["type"] == "bar" for h in t["hovertext"]})
    assert steps == [1, 2, 3, 4, 5, 6]
    # the root cause on rank 6, before everything that followed it; the watchdogs per rank
    lanes = figs["timeline"]["layout"]["yaxis"]["ticktext"]
    root, then = data["root cause"], data["what followed"]
    assert [lanes[y] for y in root["y"]] == ["rank 6"]
    assert {lanes[y] for y in then["y"]} >= {f"rank {r}" for r in (0, 1, 2, 3, 4, 5, 7)}
    assert root["x"][0] <= min(then["x"])
    assert root["x"][0] > max(b + w for b, w in zip(data["sync"]["base"], data["sync"]["x"]))  # after step 6
    assert "no time stamp" in root["hovertext"][0] and root["marker"]["symbol"] == ["star-open"]
    # ... so the failure is marked in step 7, the step after the last one logged
    assert figs["steps"]["layout"]["shapes"][0]["x0"] == 7


def test_driver_only_corpus_logs_get_steps(corpus, tmp_path):
    """Driver consoles of the corpus ingested alone (no metrics.jsonl beside them): every step
    with timing metrics is placed, and the report draws it. The first two bundles whose one
    text log has verl step lines with timings and a progress bar."""
    picked = []
    for case in sorted((corpus / "cases").iterdir()):
        logs = [p for p in case.rglob("*") if p.is_file() and p.suffix in (".log", ".out") and "ray_logs" not in p.parts]
        if len(logs) != 1:
            continue
        text = logs[0].read_text(errors="replace")
        if re.search(r"step:[1-9]\d* - .*timing_s/step", text) and "Training Progress" in text:
            picked.append(logs[0])
        if len(picked) == 2:
            break
    if not picked:
        pytest.skip("no driver-only verl log in the corpus")
    for i, log in enumerate(picked):
        work = tmp_path / str(i)
        work.mkdir()
        db = ingest(work, log)
        rows = placement(db)
        con = duckdb.connect(str(db), read_only=True)
        timed = {r[0] for r in con.execute("SELECT DISTINCT step FROM metrics WHERE key = 'timing_s/step'").fetchall()}
        con.close()
        assert timed and {r["step"] for r in rows} == timed, log
        figs = figure(db, work)
        drawn = {int(m) for t in figs["timeline"]["data"] if t["type"] == "bar"
                 for h in t["hovertext"] for m in re.findall(r"step (\d+)", h)}
        assert drawn == timed, log


def test_a_step_line_with_its_own_stamp_ends_there(tmp_path):
    """Rows as a parser writes them for step lines that carry their own time stamp: each
    step ends at its line's stamp, whatever a progress bar says; a step without a stamped
    line follows the one before it by its duration."""
    from forensics.store import Store

    db = tmp_path / "own.duckdb"
    Store(db).close()
    con = duckdb.connect(str(db))
    con.execute("INSERT INTO files (file_id, root, path, format, kind, status) VALUES (1, 'r', 'driver.log', 'driver', 'text', 'ok')")
    stamped = {1: "2026-05-04 09:02:10", 2: "2026-05-04 09:03:50", 3: None}
    elapsed = {1: "01:30", 2: "03:10", 3: "04:40"}
    for step, ts in stamped.items():
        line = 2 * step
        # a message equal to its text is stored once: in text alone (hidden _message NULL)
        con.execute("INSERT INTO lines (file_id, line_no, ts, ts_quality, text) VALUES (1, ?, ?, ?, ?)",
                    [line, ts or "2026-05-04 09:03:50", "full" if ts else "inherited", f"step:{step} - ..."])
        for key, value in (("timing_s/gen", 50.0), ("timing_s/update_actor", 30.0), ("timing_s/step", 90.0)):
            con.execute("INSERT INTO metrics (file_id, line_no, ts, step, key, value, source) VALUES (1, ?, ?, ?, ?, ?, 'console')",
                        [line, ts or "2026-05-04 09:03:50", step, key, value])
        con.execute("INSERT INTO lines (file_id, line_no, ts, ts_quality, _message, text) VALUES (1, ?, ?, 'inherited', ?, ?)",
                    [line + 1, ts or "2026-05-04 09:03:50", f"Training Progress: 5%|#| {step}/9 [{elapsed[step]}<00:10, 90.00s/it]",
                     "Training Progress"])
    con.close()
    rows = placement(db)
    assert [(r["step"], r["placed_by"]) for r in rows] == [(1, "step line"), (2, "step line"), (3, "progress bar")]
    assert [r["end_us"] for r in rows[:2]] == [us("2026-05-04 09:02:10"), us("2026-05-04 09:03:50")]
    assert rows[0]["start_us"] == us("2026-05-04 09:00:40")  # timing_s/step = 90 s
    # the bar's start follows from the stamped steps (09:02:10 - 01:30); step 3 at 04:40 after it
    assert rows[2]["end_us"] == us("2026-05-04 09:05:20")
