"""`forensics query` (issues 18, 19): streamed output in every format, a table that reads like
DuckDB's own."""
from __future__ import annotations

import csv
import io
import json

import duckdb
import pytest
from typer.testing import CliRunner

from forensics import api
from forensics.cli import app


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("q") / "q.duckdb")
    con = duckdb.connect(path)
    con.execute("""CREATE TABLE t AS SELECT i AS n, 'row ' || i AS name, i * 1.5 AS x,
                   repeat('long text ', 30) || i AS message, [i, i + 1] AS pair, {'k': i, 'tags': ['a', 'b']} AS info
                   FROM range(12981) r(i)""")
    con.execute("CREATE TABLE wide AS SELECT " + ", ".join(f"'value of column {c}' AS col_{c}" for c in range(30)))
    con.close()
    return path


def run(*argv, columns: int = 100):
    res = CliRunner(env={"COLUMNS": str(columns)}).invoke(app, ["query", *argv])
    assert res.exit_code == 0, res.output
    return res.output


def test_table_cuts_rows_and_cells_and_aligns_numbers(db):
    text = run("SELECT n, name, x, message FROM t ORDER BY n", "--db", db)
    lines = text.rstrip("\n").split("\n")
    assert lines[-1] == "(12,981 rows, 40 shown)"
    body = lines[2:-1]
    assert len(body) == 40
    assert all(len(line) <= 100 for line in lines)
    assert "\u2026" in body[0] and "long text long text" in body[0]  # the long cell cut
    assert body[0].startswith(" " * 2) and body[0].split("\u2502")[0].strip() == "0"  # right-aligned
    n_col = [line.split("\u2502")[0] for line in body]
    assert len({len(c) for c in n_col}) == 1 and n_col[-1].strip() == "39" and n_col[-1].endswith("39 ")
    assert "Decimal" not in text and "datetime" not in text and "None" not in text
    assert run("SELECT n FROM t ORDER BY n", "--db", db, "--max-rows", "5").rstrip().endswith("(12,981 rows, 5 shown)")
    assert run("SELECT n FROM t LIMIT 3", "--db", db).rstrip().endswith("(3 rows)")


def test_table_leaves_out_middle_columns_to_fit(db):
    text = run("SELECT * FROM wide", "--db", db, columns=80)
    lines = text.rstrip("\n").split("\n")
    assert all(len(line) <= 80 for line in lines)
    head = [c.strip() for c in lines[0].split("\u2502")]
    assert head[0] == "col_0" and head[-1] == "col_29" and "\u2026" in head
    assert lines[-1] == "(1 row; 30 columns, %d shown)" % (len(head) - 1)


def test_nested_values_are_json_in_csv_and_json(db):
    rows = list(csv.DictReader(io.StringIO(run("SELECT n, pair, info FROM t ORDER BY n LIMIT 2", "--db", db, "-f", "csv"))))
    assert json.loads(rows[1]["pair"]) == [1, 2] and json.loads(rows[1]["info"]) == {"k": 1, "tags": ["a", "b"]}
    got = json.loads(run("SELECT n, pair, info FROM t ORDER BY n LIMIT 2", "--db", db, "-f", "json"))
    assert got[1] == {"n": 1, "pair": [1, 2], "info": {"k": 1, "tags": ["a", "b"]}}
    nd = run("SELECT n, pair FROM t ORDER BY n LIMIT 3", "--db", db, "-f", "ndjson").splitlines()
    assert [json.loads(line) for line in nd] == [{"n": i, "pair": [i, i + 1]} for i in range(3)]
    assert json.loads(run("SELECT n FROM t WHERE false", "--db", db, "-f", "json")) == []


def test_every_format_is_streamed_in_batches(db):
    with api.query_batches(db, "SELECT * FROM t", batch_rows=1000) as result:
        sizes = [b.num_rows for b in result]
    assert len(sizes) > 5 and max(sizes) <= 2048 and sum(sizes) == 12981
    text = run("SELECT n FROM t ORDER BY n", "--db", db, "-f", "json")
    assert [r["n"] for r in json.loads(text)] == list(range(12981))
    assert len(run("SELECT n FROM t", "--db", db, "-f", "ndjson").splitlines()) == 12981
    assert len(run("SELECT n FROM t", "--db", db, "-f", "csv").splitlines()) == 12982


def test_an_error_while_streaming_is_a_user_error(db):
    res = CliRunner().invoke(app, ["query", "SELECT CAST('x' || n AS INT) FROM t", "--db", db, "-f", "csv"])
    assert res.exit_code == 2 and "ConversionException" in res.output
