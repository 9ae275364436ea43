"""Reading the answer (issue 19): the README's own SQL finds the root cause on sample_logs/,
one time estimate per event, `diagnose -v` shows whole lines, the `incomplete` headline,
remediation that respects what the run set."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import forensics
from forensics import api

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


@pytest.fixture(scope="module")
def sample_db(tmp_path_factory) -> str:
    db = str(tmp_path_factory.mktemp("sample") / "sample.duckdb")
    forensics.ingest(str(ROOT / "sample_logs"), db=db, workers=1).close()
    return db


def readme_sql() -> list[str]:
    """Every SQL statement the README shows: `forensics query "..."` lines and `run.sql("...")` calls."""
    text = README.read_text()
    out = []
    for block in re.findall(r"```(?:bash|python)\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if line.strip().startswith("forensics query "):
                out.append(shlex.split(line, comments=True)[2])
            for m in re.finditer(r'run\.sql\("((?:[^"\\]|\\.)*)"', line):
                out.append(m.group(1))
    return out


def test_readme_sql_finds_the_root_cause_line(sample_db):
    queries = readme_sql()
    assert len(queries) >= 3, queries
    root = api.diagnose(sample_db).root_causes[0]
    ev = root.evidence[0]
    found_line = found_text = False
    line_queries = 0
    for sql in queries:
        df = api.query(sample_db, sql)  # every example runs
        cols = set(df.columns)
        line_col = next((c for c in ("line_no", "exc_line", "line") if c in cols), None)
        if "path" in cols and line_col:
            line_queries += 1
            rows = set(zip(df["path"].to_list(), df[line_col].to_list()))
            assert (ev.file, ev.line) in rows, f"{sql!r} misses the root cause {ev.file}:{ev.line}"
            found_line = True
        if "message" in cols:
            texts = [t for t in df["message"].to_list() if t]
            if any(t.strip() and t.strip() in ev.text for t in texts):
                found_text = True
    assert line_queries and found_line and found_text


def _cli(*argv: str):
    from typer.testing import CliRunner

    from forensics.cli import app

    return CliRunner(env={"COLUMNS": "100"}).invoke(app, list(argv))


def test_verbose_shows_evidence_lines_whole(tmp_path):
    tail = " ".join(f"part{i}" for i in range(120))  # ~900 characters
    log = tmp_path / "logs" / "train.log"
    log.parent.mkdir()
    log.write_text("step:1 - actor/loss:0.5\nTraceback (most recent call last):\n"
                   '  File "/work/train.py", line 3, in <module>\n    main()\n'
                   f"RuntimeError: reward server answered garbage {tail}\n")
    db = str(tmp_path / "x.duckdb")
    forensics.ingest(str(log.parent), db=db, workers=1).close()
    line = f"RuntimeError: reward server answered garbage {tail}"
    short = _cli("diagnose", "--db", db)
    assert short.exit_code == 0, short.output
    assert line not in short.output and "\u2026" in short.output
    full = _cli("diagnose", "--db", db, "-v")
    assert full.exit_code == 0, full.output
    assert line in full.output  # on one line, not cut, not wrapped
    with_context = _cli("diagnose", "--db", db, "-v", "-C", "2")
    assert line in with_context.output


def test_ingest_headline_of_logs_that_stop(tmp_path):
    res = _cli("ingest", str(ROOT / "tests" / "fixtures" / "diag_incomplete_no_end"), "--db", str(tmp_path / "i.duckdb"), "-q")
    assert res.exit_code == 0, res.output
    assert "diagnosis: incomplete: no failure found; the logs stop at step 3 without an end-of-run marker" in res.output
