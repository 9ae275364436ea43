"""Every rule of the catalogue carries examples (signatures/*.yaml, `examples: {match, no_match}`),
and this one test checks each rule against them: a `match` example must make the rule fire,
a `no_match` example (a look-alike) must not.

Each example is a small log file of its own, ingested through the real pipeline (so prefixes
and headers are stripped as they are in a run, and `where` restrictions on the header,
level, logger or format apply). A line rule fires when one of its patterns matches a line
of the file (its `event_context`, if any, found in the line's event); an exception rule
fires when its `exception` matcher accepts one of the file's fatal events. `requires` and
`class_if_present` speak of other rules and are not part of a rule's own examples.
"""
from __future__ import annotations

import re

import duckdb
import pytest

from forensics import catalogue as sig
from forensics import pipeline
from forensics.diagnosis import matching

CATALOGUE = sig.load()


def test_every_rule_has_a_matching_example():
    missing = [r.id for r in CATALOGUE.rules if not r.examples[0]]
    assert not missing, f"rules without a `match` example: {missing}"


@pytest.fixture(scope="module")
def examples_db(tmp_path_factory) -> tuple[str, dict[tuple[str, str, int], str]]:
    """All examples as files ingested into one database: (db, {(rule, kind, i): path})."""
    root = tmp_path_factory.mktemp("examples")
    paths: dict[tuple[str, str, int], str] = {}
    for r in CATALOGUE.rules:
        for kind, items in (("match", r.examples[0]), ("no_match", r.examples[1])):
            for i, (name, text) in enumerate(items):
                rel = f"{r.id}/{kind}{i}/{name or 'example.log'}"
                f = root / "bundle" / rel
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
                paths[(r.id, kind, i)] = rel
    db = str(root / "examples.duckdb")
    pipeline.ingest([str(root / "bundle")], db, workers=1)
    return db, paths


def _fires(con, rule: sig.Rule, path: str) -> bool:
    file_id = con.execute("SELECT file_id FROM files WHERE path = ?", [path]).fetchone()
    assert file_id is not None, f"{path} was not ingested"
    file_id = file_id[0]
    if rule.patterns:
        df = matching.match(con, [rule])
        for line_no in df.filter(df["file_id"] == file_id)["line_no"].to_list() if df.height else []:
            if not rule.event_context:
                return True
            body = con.execute(
                """SELECT string_agg(message, chr(10) ORDER BY line_no) FROM lines WHERE file_id = ?
                   AND (event_line = (SELECT event_line FROM lines WHERE file_id = ? AND line_no = ?) OR line_no = ?)""",
                [file_id, file_id, line_no, line_no]).fetchone()[0] or ""
            if any(re.search(p, body) for p in rule.event_context):
                return True
    if rule.exception is not None:
        cols = matching.EVENT_COLUMNS
        for row in con.execute(f"SELECT {', '.join(cols)} FROM fatal_events WHERE file_id = ?", [file_id]).fetchall():
            e = dict(zip(cols, row))

            def preceded(rx: str, e=e) -> bool:
                return bool(con.execute(
                    "SELECT 1 FROM lines WHERE file_id = ? AND line_no < ? AND regexp_matches(message, ?) LIMIT 1",
                    [file_id, e["line_no"], rx]).fetchall())

            if matching.event_matches(rule.exception, e, preceded):
                return True
    return False


@pytest.mark.parametrize("rule", CATALOGUE.rules, ids=lambda r: r.id)
def test_rule_against_its_examples(examples_db, rule):
    db, paths = examples_db
    con = duckdb.connect(db, read_only=True)
    try:
        for kind, items in (("match", rule.examples[0]), ("no_match", rule.examples[1])):
            for i, (_, text) in enumerate(items):
                fired = _fires(con, rule, paths[(rule.id, kind, i)])
                assert fired == (kind == "match"), f"{rule.id} {'missed' if kind == 'match' else 'fired on'} its {kind} example {i}: {text[:160]!r}"
    finally:
        con.close()


def test_a_rule_that_misses_its_example_is_caught(tmp_path):
    """The check itself can fail: a rule whose example does not match is reported."""
    folder = tmp_path / "rules"
    folder.mkdir()
    (folder / "mine.yaml").write_text(
        "rules:\n  - id: my_rule\n    class: disk_full\n    role: cause\n    patterns: ['quota refused for \\\\S+']\n"
        "    examples: {match: ['quota granted for vol1']}\n")
    rule = next(r for r in sig.load([folder]).rules if r.id == "my_rule")
    bundle = tmp_path / "b"
    (bundle / "x").mkdir(parents=True)
    (bundle / "x" / "example.log").write_text(rule.examples[0][0][1] + "\n")
    db = str(tmp_path / "x.duckdb")
    pipeline.ingest([str(bundle)], db, workers=1)
    con = duckdb.connect(db, read_only=True)
    try:
        assert _fires(con, rule, "x/example.log") is False
    finally:
        con.close()
