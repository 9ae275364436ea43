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
