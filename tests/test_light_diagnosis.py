"""What lets `forensics diagnose` of a small database start in half a second, checked
against what it replaced: the rules tried on the candidate lines are only those whose
keywords occur in them (the same hits as trying all), the format facts come from the
database (the same as the registry's), and the performance findings run on a second
connection beside the diagnosis (the same findings as after it)."""
from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import pytest

import forensics
from forensics import api
from forensics import catalogue as sig
from forensics import database
from forensics.diagnosis import explain, matching
from forensics.store import Store

from .test_phases import build_db

FIXTURES = Path(__file__).parent / "fixtures"
BUNDLES = ("diag_app_error_reward_keyerror", "diag_oom_train_torchrun", "diag_nccl_timeout_pure", "diag_xid79_cascade",
           "diag_wrapped_watchdog_paste", "diag_healthy_scary_warnings")


@pytest.fixture(scope="module")
def bundles_db(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("light")
    for name in BUNDLES:
        shutil.copytree(FIXTURES / name, root / "logs" / name, ignore=shutil.ignore_patterns("expected.json"))
    db = str(root / "b.duckdb")
    forensics.ingest(str(root / "logs"), db=db, workers=1).close()
    return db


def test_the_rules_left_out_would_have_matched_nothing(bundles_db):
    cat = sig.load()
    con = duckdb.connect(bundles_db, read_only=True)
    try:
        matching.candidates(con, cat.rules, cat.rank_zero_prints)
        kept = matching._rules_with_candidates(con, cat.rules)
        with_patterns = [i for i, r in enumerate(cat.rules) if r.patterns]
        assert 0 < len(kept) < len(with_patterns)  # some are left out, some are tried
        every = con.execute(matching._hits_sql(cat.rules)).fetchall()
        pruned = con.execute(matching._hits_sql(cat.rules, kept)).fetchall()
        none = con.execute(matching._hits_sql(cat.rules, [])).fetchall()
    finally:
        con.close()
    assert every and pruned == every
    assert none == []


def test_the_database_keeps_the_format_facts_of_its_ingest(bundles_db, tmp_path):
    con = duckdb.connect(bundles_db, read_only=True)
    try:
        stored = database.format_facts(con)
        (text,) = con.execute("SELECT value FROM meta WHERE key = ?", [database.FORMAT_FACTS_KEY]).fetchall()[0]
    finally:
        con.close()
    assert stored == database.FormatFacts.of_registry()
    assert stored.software.get("ray_worker") == "ray" and "ray_worker" in stored.own_output
    assert database.FormatFacts.from_json(text) == stored
    # a database without them (made before they were kept) is read with the registry's facts,
    # to the same diagnosis
    old = str(tmp_path / "old.duckdb")
    shutil.copy(bundles_db, old)
    w = duckdb.connect(old)
    w.execute("DELETE FROM meta WHERE key = ?", [database.FORMAT_FACTS_KEY])
    w.close()
    con = duckdb.connect(old, read_only=True)
    try:
        assert not con.execute("SELECT count(*) FROM meta WHERE key = ?", [database.FORMAT_FACTS_KEY]).fetchall()[0][0]
        assert database.format_facts(con) == stored
    finally:
        con.close()
    assert api.diagnose(old).to_dict() == api.diagnose(bundles_db).to_dict()
    # a writer puts them back
    Store(old).close()
    con = duckdb.connect(old, read_only=True)
    try:
        assert con.execute("SELECT value FROM meta WHERE key = ?", [database.FORMAT_FACTS_KEY]).fetchall() == [(text,)]
    finally:
        con.close()


def test_file_row_relations_are_the_declared_tables_of_file_rows(bundles_db):
    from forensics.store import all_tables

    con = duckdb.connect(bundles_db, read_only=True)
    try:
        got = database.file_row_relations(con)
        have = database.main_relations(con)
    finally:
        con.close()
    declared = {t.name for t in all_tables() if t.columns and t.columns[0].name == "file_id"}
    assert got == declared & have and "lines" in got and "fatal_events" in got


def test_findings_beside_the_diagnosis_are_those_after_it(tmp_path, monkeypatch):
    db = str(build_db(tmp_path, "phase_straggler"))
    beside = api.diagnose(db).to_dict()
    assert any(f["id"] == "straggler" for f in beside["findings"]), beside["findings"]
    monkeypatch.setattr(explain, "PARALLEL_FINDINGS_MAX_LINES", 0)
    after = api.diagnose(db).to_dict()
    assert after == beside


def test_findings_beside_the_diagnosis_read_the_run_it_reads(tmp_path):
    """A database of two runs: each run's findings are those of the run ingested alone (the
    second connection is restricted to the same run)."""
    logs = tmp_path / "logs"
    shutil.copytree(FIXTURES / "phase_straggler", logs / "a", ignore=shutil.ignore_patterns("trace_events.json"))
    shutil.copytree(FIXTURES / "diag_oom_train_torchrun", logs / "b", ignore=shutil.ignore_patterns("expected.json"))
    db = str(tmp_path / "two.duckdb")
    forensics.ingest(str(logs), db=db, workers=1).close()

    def found(d: dict) -> list:
        return [(f["id"], f["rank"], f["detail"]) for f in d["findings"]]

    by_name = {r["run"].rsplit("/", 1)[-1]: r for r in api.diagnose(db).to_dict()["runs"]}
    assert set(by_name) == {"a", "b"}
    assert found(by_name["a"])  # the test means something: run a has findings
    for name in ("a", "b"):
        alone = str(tmp_path / f"{name}.duckdb")
        forensics.ingest(str(logs / name), db=alone, workers=1).close()
        assert found(by_name[name]) == found(api.diagnose(alone).to_dict()), name
    assert found(api.diagnose(db, run="a").to_dict()) == found(by_name["a"])


def test_many_candidates_try_every_rule(bundles_db, monkeypatch):
    """Past PRECHECK_MAX_CANDIDATES the pre-check is skipped (its scan would cost more than
    the branches it saves): every rule with line patterns is tried, to the same hits."""
    cat = sig.load()
    con = duckdb.connect(bundles_db, read_only=True)
    try:
        matching.candidates(con, cat.rules, cat.rank_zero_prints)
        few = matching._rules_with_candidates(con, cat.rules)
        monkeypatch.setattr(matching, "PRECHECK_MAX_CANDIDATES", 0)
        many = matching._rules_with_candidates(con, cat.rules)
        assert many == [i for i, r in enumerate(cat.rules) if r.patterns] and set(few) < set(many)
        assert con.execute(matching._hits_sql(cat.rules, many)).fetchall() == con.execute(matching._hits_sql(cat.rules, few)).fetchall()
    finally:
        con.close()


def test_the_keyword_pre_check_in_python_is_duckdbs(bundles_db, tmp_path):
    """The pre-check over ASCII messages in Python keeps the same rules as DuckDB's
    `contains` / `lower` over the same candidates; a non-ASCII candidate sends it to DuckDB."""
    cat = sig.load()
    con = duckdb.connect(bundles_db, read_only=True)
    try:
        matching.candidates(con, cat.rules, cat.rank_zero_prints)
        assert matching._rules_with_candidates(con, cat.rules) == matching._rules_with_candidates(con, cat.rules, in_python=False)
    finally:
        con.close()
    # a candidate with a non-ASCII message (a character whose lower case may differ between
    # Python and DuckDB)
    run = tmp_path / "u"
    run.mkdir()
    (run / "train.log").write_text("İ→ torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n", encoding="utf-8")
    db = str(tmp_path / "u.duckdb")
    forensics.ingest(str(run), db=db, workers=1).close()
    con = duckdb.connect(db, read_only=True)
    try:
        matching.candidates(con, cat.rules, cat.rank_zero_prints)
        msgs = [m for (m,) in con.execute("SELECT message FROM diag_candidates").fetchall()]
        assert msgs and not all(m.isascii() for m in msgs)
        kept = matching._rules_with_candidates(con, cat.rules)
        assert kept == matching._rules_with_candidates(con, cat.rules, in_python=False)
        oom = [i for i, r in enumerate(cat.rules) if r.cls == "oom_training" or r.id == "torch_cuda_oom"]
        assert set(oom) & set(kept)  # the line's rule is tried
    finally:
        con.close()
