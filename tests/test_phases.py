"""Phase attribution views, phase rules, findings (forensics/phases.py, forensics/findings.py).

Fixture traces are written in the `trace_events` column contract (tests/fixtures/phase_*/
trace_events.json) and loaded next to logs ingested the normal way, so these tests do not
depend on the trace parsers; the corpus tests at the end use the real parsers.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
import polars as pl
import pytest

from forensics import findings as fd
from forensics import phases as ph
from forensics import pipeline
from forensics.api import Run
from forensics.store import Store

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def load_trace_fixture(db: Path, fixture: Path) -> None:
    """Insert a fixture's contract-shaped trace events (and their `files` rows) into ``db``."""
    doc = json.loads((fixture / "trace_events.json").read_text())
    con = duckdb.connect(str(db))  # the ingest created every table already
    try:
        next_id = int(con.execute("SELECT coalesce(max(file_id), 0) + 1 FROM files").fetchall()[0][0])
        ids = {}
        for old, path in doc["files"].items():
            ids[int(old)] = next_id
            fmt = "ray_timeline" if path.endswith("timeline.json") else "kineto_trace"
            con.execute("INSERT INTO files (file_id, root, path, format, kind, status) VALUES (?, ?, ?, ?, 'structured', 'ok')",
                        [next_id, str(fixture), path, fmt]).fetchall()
            next_id += 1
        events = pl.DataFrame(doc["events"], infer_schema_length=None).with_columns(
            pl.col("file_id").replace_strict(ids, return_dtype=pl.Int32),
            pl.col("ts").str.to_datetime("%Y-%m-%d %H:%M:%S%.f", time_unit="us"),
        )
        have = {r[0] for r in con.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'trace_events'").fetchall()}
        types = {"source": "VARCHAR", "rank": "INTEGER", "pid": "VARCHAR", "tid": "VARCHAR", "ph": "VARCHAR",
                 "category": "VARCHAR", "name": "VARCHAR", "ts_us": "DOUBLE", "dur_us": "DOUBLE", "ts": "TIMESTAMP",
                 "device": "INTEGER", "stream": "BIGINT", "coll_name": "VARCHAR", "pg_name": "VARCHAR",
                 "coll_group_size": "INTEGER", "coll_dtype": "VARCHAR"}
        for c in events.columns:  # only when no trace parser declared the table yet
            if c not in have:
                con.execute(f'ALTER TABLE trace_events ADD COLUMN "{c}" {types[c]}').fetchall()
        con.register("_fixture_events", events.to_arrow())
        con.execute("INSERT INTO trace_events BY NAME SELECT * FROM _fixture_events").fetchall()
        con.unregister("_fixture_events")
    finally:
        con.close()


def build_db(tmp_path: Path, fixture: str, extra: list[Path] = ()) -> Path:
    """Ingest a fixture folder's logs (plus ``extra`` files) and load its trace events."""
    src = tmp_path / "run"
    shutil.copytree(FIXTURES / fixture, src, ignore=shutil.ignore_patterns("trace_events.json"))
    for p in extra:
        shutil.copy(p, src / p.name)
    db = tmp_path / "run.duckdb"
    pipeline.ingest([str(src)], str(db), workers=1)
    load_trace_fixture(db, FIXTURES / fixture)
    return db


@pytest.fixture(scope="module")
def straggler_db(tmp_path_factory) -> Path:
    """Built once per module: tests must not write to it (see the stale-views test)."""
    return build_db(tmp_path_factory.mktemp("straggler"), "phase_straggler")


def rows(con, sql: str, params=None) -> list[dict]:
    return pl.from_arrow(con.sql(sql, params=params).to_arrow_table()).to_dicts()


# -- rules ----------------------------------------------------------------------------------

def test_rules_load_and_map_names():
    rules, settings, sha = ph.load_rules()
    assert {r["phase"] for r in rules} == set(ph.PHASES)
    assert settings["profiler_step_regex"] and len(sha) == 64
    con = duckdb.connect()
    con.execute("CREATE TABLE phase_rules (priority INTEGER, phase VARCHAR, sub_phase VARCHAR, pattern VARCHAR, sources VARCHAR, in_step BOOLEAN)")
    con.execute("CREATE TABLE phase_settings (key VARCHAR, value VARCHAR)")
    ph.attach(con)
    got = dict(con.execute("""
        SELECT n, arg_min(phase || '/' || coalesce(sub_phase, ''), priority) FROM (VALUES ('gen'), ('Update_Actor'),
            ('compute_ref_log_prob'), ('update_weights'), ('save_checkpoint'), ('DistributedDataParallel.forward')) t(n)
        JOIN phase_rules ON regexp_full_match(lower(n), pattern) GROUP BY n""").fetchall())
    assert got == {"gen": "rollout/generate", "Update_Actor": "train/actor", "compute_ref_log_prob": "rollout/logprob",
                   "update_weights": "sync/weights", "save_checkpoint": "other/checkpoint"}
    assert con.execute("SELECT _phase_setting('step_metric')").fetchall()[0][0] == "step"


def test_literal_macros_agree_with_the_rules_table(tmp_path):
    """attach() turns the rules into a CASE of literal patterns and a plain `gpu_categories` into
    an IN list: both answer what the rules table and the regular expression answer."""
    rules = tmp_path / "phases.yaml"
    rules.write_text(
        "rules:\n"
        "  - {phase: rollout, sub_phase: generate, names: [gen], sources: [kineto, log]}\n"
        "  - {phase: train, patterns: ['ge.*', 'upd(ate)?'], sources: [ray]}\n"
        "  - {phase: sync, names: [gen, update, 'a.b']}\n"
        "settings:\n  gpu_categories: 'kernel|gpu_memcpy'\n")
    con = duckdb.connect()
    con.execute("CREATE TABLE phase_rules (priority INTEGER, phase VARCHAR, sub_phase VARCHAR, pattern VARCHAR, sources VARCHAR, in_step BOOLEAN)")
    con.execute("CREATE TABLE phase_settings (key VARCHAR, value VARCHAR)")
    ph.attach(con, rules)
    rows = con.execute("""
        WITH n AS (SELECT * FROM (VALUES ('gen'), ('GEN'), ('general'), ('update'), ('upd'), ('a.b'), ('axb'), ('x'), (NULL)) t(bare)),
             s AS (SELECT * FROM (VALUES ('kineto'), ('ray'), ('metrics'), ('log')) t(src))
        SELECT bare, src, _phase_rule_priority(bare, src) AS got,
               (SELECT min(r.priority) FROM phase_rules r WHERE regexp_full_match(bare, r.pattern)
                  AND (r.sources IS NULL OR list_contains(string_split(r.sources, ','), src))) AS want
        FROM n, s""").fetchall()
    assert [r for r in rows if r[2] != r[3]] == []
    assert {(b, s): g for b, s, g, _ in rows}[("general", "ray")] == 1  # a pattern of a rule limited to ray
    assert {(b, s): g for b, s, g, _ in rows}[("GEN", "metrics")] == 2
    assert {(b, s): g for b, s, g, _ in rows}[("axb", "log")] is None  # the dot of a name is literal

    def macro() -> str:
        return con.execute("SELECT macro_definition FROM duckdb_functions() WHERE function_name = '_phase_gpu_category'").fetchall()[0][0]

    cats = "SELECT c, _phase_gpu_category(c) FROM (VALUES ('kernel'), ('Kernel'), ('kernels'), ('gpu_memcpy'), ('gpu_memset'), (NULL)) t(c)"
    assert " IN " in macro() and "regexp" not in macro()
    assert dict(con.execute(cats).fetchall()) == {"kernel": True, "Kernel": False, "kernels": False, "gpu_memcpy": True,
                                                   "gpu_memset": False, None: None}
    rules.write_text(rules.read_text().replace("'kernel|gpu_memcpy'", "'kernel|gpu_mem.*'"))
    ph.attach(con, rules)
    assert "regexp_full_match" in macro()
    assert dict(con.execute(cats).fetchall()) == {"kernel": True, "Kernel": False, "kernels": False, "gpu_memcpy": True,
                                                   "gpu_memset": True, None: None}


def test_bad_rules_are_refused(tmp_path):
    bad = tmp_path / "phases.yaml"
    bad.write_text("rules:\n  - phase: warmup\n    names: [x]\n")
    with pytest.raises(ph.PhaseRulesError, match="warmup"):
        ph.load_rules(bad)
    bad.write_text("rules:\n  - phase: train\n    sub_phase: x\n")
    with pytest.raises(ph.PhaseRulesError, match="neither"):
        ph.load_rules(bad)


def test_read_only_connection_gets_temp_rules(straggler_db):
    con = duckdb.connect(str(straggler_db), read_only=True)
    try:
        ph.attach(con)
        temp = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() WHERE temporary").fetchall()}
        assert {"phase_rules", "phase_settings"} <= temp
        assert con.execute("SELECT count(*) FROM phases").fetchall()[0][0] > 0
    finally:
        con.close()


def test_views_are_created_without_trace_tables(tmp_path):
    """A database whose parsers declare no trace_events/engine_events still gets the views."""
    db = tmp_path / "bare.duckdb"
    store = Store(db)
    store.con.execute("DROP VIEW IF EXISTS _phase_trace").fetchall()
    for t in ("trace_events", "engine_events"):
        store.con.execute(f"DROP TABLE IF EXISTS {t} CASCADE").fetchall()
    store.create_views()
    ph.attach(store.con)
    assert store.con.execute("SELECT count(*) FROM phase_steps").fetchall()[0][0] == 0
    store.close()


# -- profiler traces ------------------------------------------------------------------------

def test_profiler_steps_are_aligned_to_training_steps(straggler_db):
    with Run(straggler_db) as run:
        got = run.sql("SELECT rank, profiler_step, step, step_from FROM phase_profiler_steps ORDER BY rank, step").to_dicts()
    # ProfilerStep#5/#6 start when the logs say steps 2/3 start: the offset is measured, not assumed
    assert [(r["rank"], r["profiler_step"], r["step"]) for r in got] == [(0, 5, 2), (0, 6, 3), (1, 5, 2), (1, 6, 3)]
    assert {r["step_from"] for r in got} == {"log markers"}


def test_kineto_phases_add_up_to_the_step(straggler_db):
    with Run(straggler_db) as run:
        steps = run.phase_steps().filter(pl.col("source") == "kineto")
        assert steps.height == 4
        for r in steps.to_dicts():
            parts = r["rollout_s"] + r["reward_s"] + r["train_s"] + r["sync_s"] + r["other_s"] + r["idle_s"]
            assert parts == pytest.approx(r["step_s"], abs=1e-6)
            assert r["rollout_s"] == pytest.approx(0.40, abs=1e-6)
            assert r["train_s"] == pytest.approx(0.50, abs=1e-6)
            assert r["sync_s"] == pytest.approx(0.04, abs=1e-6)
            assert r["idle_s"] == pytest.approx(0.01, abs=1e-6)
        r0 = steps.filter(pl.col("rank") == 0).to_dicts()[0]
        r1 = steps.filter(pl.col("rank") == 1).to_dicts()[0]
        assert r0["wait_s"] == pytest.approx(0.39, abs=1e-6) and r1["wait_s"] == pytest.approx(0.0, abs=1e-6)
        assert r1["late_s"] == pytest.approx(0.39, abs=1e-6) and r0["late_s"] == pytest.approx(0.0, abs=1e-6)
        gpu_phase = {(r["rank"], r["step"], r["phase"]): r for r in run.sql("SELECT * FROM phase_gpu").to_dicts()}
        assert gpu_phase[(0, 2, "train")]["nccl_s"] == pytest.approx(0.40, abs=1e-6)
        assert gpu_phase[(0, 2, "train")]["kernel_s"] == pytest.approx(0.04 + 0.03, abs=1e-6)
        assert gpu_phase[(0, 2, "sync")]["nccl_s"] == pytest.approx(0.01, abs=1e-6)
        assert gpu_phase[(1, 2, "rollout")]["kernel_s"] == pytest.approx(0.34, abs=1e-6)
        # GPU: busy = union of the streams' events (NCCL overlaps the backward on rank 1), idle = the rest
        gpu = {(r["rank"], r["step"]): r for r in run.sql("SELECT * FROM phase_gpu_steps").to_dicts()}
        assert len(gpu) == 4
        for g in gpu.values():
            assert g["gpu_busy_s"] + g["gpu_idle_s"] == pytest.approx(g["step_s"], abs=1e-6)
        assert gpu[(0, 2)]["nccl_s"] == pytest.approx(0.41, abs=1e-6)
        assert gpu[(0, 2)]["kernel_s"] == pytest.approx(0.34 + 0.04 + 0.03 + 0.002, abs=1e-6)
        assert gpu[(0, 2)]["gpu_busy_s"] == pytest.approx(0.34 + 0.04 + 0.40 + 0.03 + 0.002 + 0.01, abs=1e-6)
        assert gpu[(1, 2)]["gpu_busy_s"] == pytest.approx(0.34 + 0.43 + 0.01 + 0.03 + 0.002 + 0.01, abs=1e-6)


def test_metric_steps_are_run_level(straggler_db):
    with Run(straggler_db) as run:
        run_steps = run.sql("SELECT * FROM phase_run_steps ORDER BY step").to_dicts()
    assert [r["step"] for r in run_steps] == [1, 2, 3, 4, 5]
    assert all(r["source"] == "metrics" for r in run_steps)
    s1 = run_steps[0]
    assert s1["rollout_s"] == pytest.approx(3.0) and s1["idle_s"] == pytest.approx(3.6 - 3.59)


def test_timeline_has_exact_and_laid_out_spans(straggler_db):
    with Run(straggler_db) as run:
        tl = run.timeline()
    kin = tl.filter(pl.col("source") == "kineto")
    assert set(kin["phase"].to_list()) == {"rollout", "reward", "train", "sync"}
    assert not kin["approximate"].any()
    met = tl.filter(pl.col("source") == "metrics")
    assert met["approximate"].all() and met["rank"].is_null().all()
    # laid out from each step's start marker, one span per timing metric in the order verl
    # runs them, then the part of timing_s/step no timer covers, without overlaps
    s2 = met.filter(pl.col("step") == 2).sort("start_us")
    assert s2["phase"].to_list() == ["rollout", "reward", "train", "sync", "idle"]
    assert s2["name"].to_list()[:4] == ["timing_s/gen", "timing_s/reward", "timing_s/update_actor", "timing_s/update_weights"]
    assert (s2["placement"] == "step start marker").all()
    assert (s2["end_us"][-1] - s2["start_us"][0]) / 1e6 == pytest.approx(1.0)  # timing_s/step
    assert (s2["start_us"][1:] >= s2["end_us"][:-1] - 1e-3).all()


def test_findings_name_the_straggler_and_the_jump(straggler_db):
    with Run(straggler_db) as run:
        found = run.findings()
    stragglers = [f for f in found if f["id"] == "straggler"]
    assert [f["rank"] for f in stragglers] == [1]
    assert stragglers[0]["phase"] == "train" and stragglers[0]["steps"] == [2, 3]
    assert stragglers[0]["value"] == pytest.approx(0.39, abs=0.01)
    assert "0.39 s after the first rank" in stragglers[0]["detail"]
    jumps = [f for f in found if f["id"] == "step_time_jump"]
    assert [f["steps"] for f in jumps] == [[5]] and jumps[0]["phase"] == "train"
    assert jumps[0]["evidence"][0]["file"] == "metrics.jsonl" and jumps[0]["evidence"][0]["line"] == 5
    for f in found:
        assert {"id", "rank", "detail"} <= set(f) and json.dumps(f)


def test_thresholds_are_data(straggler_db):
    cfg = fd.load_thresholds()
    cfg["straggler"]["min_gap_s"] = 0.5  # the fixture's gap is 0.39 s
    cfg["slow_weight_sync"].update(min_share=0.03, min_s=0.01)
    con = duckdb.connect(str(straggler_db), read_only=True)
    try:
        found = fd.findings(con, cfg)
    finally:
        con.close()
    assert not [f for f in found if f["id"] == "straggler"]
    sync = [f for f in found if f["id"] == "slow_weight_sync"]
    assert len(sync) == 1 and sync[0]["value"] == pytest.approx(0.04, abs=0.001)


# -- Ray timeline and markers ---------------------------------------------------------------

def test_ray_tasks_give_per_rank_phases(tmp_path):
    db = build_db(tmp_path, "phase_ray")
    with Run(db) as run:
        steps = run.phase_steps()
        spans = run.sql("SELECT * FROM phase_spans WHERE source = 'ray' ORDER BY rank, step, start_us")
    ray = steps.filter(pl.col("source") == "ray").sort("rank", "step")
    assert ray.select("rank", "step").rows() == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    r1 = ray.filter((pl.col("rank") == 1) & (pl.col("step") == 2)).to_dicts()[0]
    assert r1["rollout_s"] == pytest.approx(0.6 + 0.1, abs=1e-6)  # generate + log-prob
    assert r1["logprob_s"] == pytest.approx(0.1, abs=1e-6)
    assert r1["train_s"] == pytest.approx(0.2, abs=1e-6) and r1["sync_s"] == pytest.approx(0.03, abs=1e-6)
    # the actor index in `actor_rollout_ref_1:...__init__` is the rank; internal events are no phase
    assert set(spans["name"].to_list()) == {"generate_sequences", "compute_log_prob", "update_actor", "update_weights"}
    # the driver's [gen] start/end markers make run-level log spans
    with Run(db) as run:
        log_spans = run.sql("SELECT * FROM phase_spans WHERE source = 'log'").to_dicts()
    assert {(r["rank"], r["step"], r["phase"], round(r["seconds"], 3)) for r in log_spans} == {
        (None, s, "rollout", 0.62) for s in (1, 2, 3)}


def test_rollout_long_tail_across_ranks(tmp_path):
    db = build_db(tmp_path, "phase_ray")
    cfg = fd.load_thresholds()
    cfg["rollout_long_tail"]["rank_ratio"] = 1.1  # rank 1 generates 0.6 s vs 0.5 s
    cfg["rollout_long_tail"]["skip_first_steps"] = 0
    with Run(db) as run:
        found = fd.findings(run.con, cfg)
    tail = [f for f in found if f["id"] == "rollout_long_tail" and f["rank"] is not None]
    assert len(tail) == 1 and tail[0]["rank"] == 1
    cfg["rollout_long_tail"]["rank_ratio"] = 1.5
    with Run(db) as run:
        assert not [f for f in fd.findings(run.con, cfg) if f["id"] == "rollout_long_tail"]


def test_slowest_rank_per_step_matches_statistics_median():
    """The per-step ratios (the median of the other ranks taken from their sorted times) equal
    a loop over the steps with statistics.median, with odd and even numbers of other ranks,
    equal times, steps with one rank and zero medians."""
    import random
    import statistics

    rng = random.Random(7)
    rows = []
    for step in range(200):
        for rank in rng.sample(range(16), rng.randint(1, 9)):
            rows.append((step, rank, rng.choice([0.0, 0.5, 0.6, 0.1 + 0.2, rng.random()])))
    rng.shuffle(rows)
    per_rank = [{"step": st, "rank": r, "rollout_s": s} for st, r, s in rows]
    expected = []
    for step in sorted({st for st, _, _ in rows}):
        grp = sorted(((s, r) for st, r, s in rows if st == step), key=lambda x: (-x[0], x[1]))
        if len(grp) < 2:
            continue
        med = statistics.median(s for s, _ in grp[1:])
        if med > 0:
            expected.append((grp[0][0] / med, step, grp[0][1]))
    got = fd._slowest_rank_per_step(per_rank)
    assert got == expected
    others = {sum(1 for r in rows if r[0] == e[1]) - 1 for e in expected}
    assert {1, 2, 3, 4} <= others  # odd and even numbers of other ranks


def test_engine_sleep_wake_becomes_sync_when_metrics_hide_it(tmp_path):
    src = tmp_path / "run"
    src.mkdir()
    (src / "driver.log").write_text(
        "2026-01-01 00:00:00,000 INFO main: step 1: [gen] start\n"
        "2026-01-01 00:00:02,000 INFO main: step 2: [gen] start\n"
        "2026-01-01 00:00:04,000 INFO main: done\n")
    (src / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "data": {"timing_s/gen": 1.5, "timing_s/update_actor": 0.4, "timing_s/step": 2.0}}) + "\n"
        + json.dumps({"step": 2, "data": {"timing_s/gen": 1.5, "timing_s/update_actor": 0.4, "timing_s/step": 2.0}}) + "\n")
    db = tmp_path / "e.duckdb"
    pipeline.ingest([str(src)], str(db), workers=1)
    store = Store(db)
    have = {r[0] for r in store.con.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = 'engine_events'").fetchall()}
    for c, t in (("kind", "VARCHAR"), ("ts", "TIMESTAMP"), ("seconds", "DOUBLE")):
        if c not in have:
            store.con.execute(f"ALTER TABLE engine_events ADD COLUMN {c} {t}").fetchall()
    store.con.execute("""INSERT INTO engine_events BY NAME SELECT * FROM (VALUES
        (1, 2, 'wake', TIMESTAMP '2026-01-01 00:00:00.100', 0.3),
        (1, 3, 'sleep', TIMESTAMP '2026-01-01 00:00:01.500', 0.2)) t(file_id, line_no, kind, ts, seconds)""").fetchall()
    store.close()
    with Run(db) as run:
        steps = {r["step"]: r for r in run.phase_steps().to_dicts()}
    assert steps[1]["source"] == "metrics+engine"
    assert steps[1]["sync_s"] == pytest.approx(0.5) and steps[1]["rollout_s"] == pytest.approx(1.0)
    assert steps[2]["source"] == "metrics" and steps[2]["sync_s"] == 0


# -- real corpus ----------------------------------------------------------------------------

def _traced(db: Path) -> bool:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return bool(con.execute("SELECT count(*) FROM trace_events WHERE source = 'kineto'").fetchall()[0][0])
    finally:
        con.close()


@pytest.mark.parametrize("case", ["straggler", "healthy-torchrun"])
def test_corpus_phases_add_up_to_measured_step_time(ingested_corpus, corpus, case):
    db = ingested_corpus[corpus / "real" / case]
    if not _traced(db):
        pytest.skip("no PyTorch profiler trace parser in this checkout (trace_events is empty)")
    with Run(db) as run:
        steps = run.phase_steps()
    traced = steps.filter(pl.col("source") == "kineto")
    measured = {r["step"]: r["step_s"] for r in steps.filter(pl.col("rank").is_null()).to_dicts()}  # timing_s/step
    assert traced.height == 6 and set(traced["step"].to_list()) == {3, 4, 5}
    for r in traced.to_dicts():
        phases = r["rollout_s"] + r["reward_s"] + r["train_s"] + r["sync_s"] + r["other_s"]
        assert phases + r["idle_s"] == pytest.approx(measured[r["step"]], rel=0.03)
        assert phases / measured[r["step"]] > 0.97  # the annotations cover the step, idle is small


def test_corpus_straggler_is_rank_1(ingested_corpus, corpus):
    db = ingested_corpus[corpus / "real" / "straggler"]
    if not _traced(db):
        pytest.skip("no PyTorch profiler trace parser in this checkout (trace_events is empty)")
    with Run(db) as run:
        found = [f for f in run.findings() if f["id"] == "straggler"]
        late = run.sql("SELECT rank, step, sum(late_s) AS late FROM phase_collectives GROUP BY ALL").to_dicts()
    assert [f["rank"] for f in found] == [1]
    assert 0.3 <= found[0]["value"] <= 0.5 and found[0]["phase"] == "train"
    assert all(r["late"] > 0.3 for r in late if r["rank"] == 1)
    assert all(r["late"] < 0.01 for r in late if r["rank"] == 0)


def test_corpus_healthy_torchrun_has_no_straggler(ingested_corpus, corpus):
    db = ingested_corpus[corpus / "real" / "healthy-torchrun"]
    with Run(db) as run:
        assert not [f for f in run.findings() if f["id"] in ("straggler", "rollout_long_tail")]


def test_corpus_ray_timeline_phases(ingested_corpus, corpus):
    db = ingested_corpus[corpus / "real" / "ray-healthy"]
    with Run(db) as run:
        steps = run.phase_steps()
    if steps.filter(pl.col("source") == "ray").is_empty():
        pytest.skip("no Ray timeline parser in this checkout")
    ray = steps.filter(pl.col("source") == "ray")
    assert set(ray["rank"].to_list()) == {0, 1} and set(ray["step"].to_list()) == set(range(1, 9))
    assert (ray["train_s"] > 0.4).all() and (ray["rollout_s"] > 0.3).all()


def test_read_only_database_with_stale_views(tmp_path):
    """A database written by an older forensics: the phase views are missing or old."""
    straggler_db = build_db(tmp_path, "phase_straggler")
    con = duckdb.connect(str(straggler_db))
    con.execute("DROP VIEW phases").fetchall()
    con.execute("CREATE OR REPLACE VIEW phase_steps AS SELECT 1 AS stale").fetchall()
    con.execute("CREATE OR REPLACE MACRO _sql_modules_version() AS 'older'").fetchall()
    con.close()
    with Run(straggler_db) as run:  # read-only
        steps = run.phase_steps()
        assert "rollout_s" in steps.columns and steps.filter(pl.col("source") == "kineto").height == 4
        assert [f["rank"] for f in run.findings() if f["id"] == "straggler"] == [1]
        assert "stale" not in run.phase_steps().columns  # the TEMP views are back after the cache
