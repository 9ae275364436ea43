"""Store once: a column whose value is usually another column's (a `message` left as the
line's `text`, a metric's `value_text` that is its number as DuckDB prints it) keeps its
own value only where it differs, and reads back whole; an older database that keeps the
whole column still loads."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import duckdb
import pytest

from forensics import pipeline
from forensics.export import parquet
from forensics.parsers.text import LINES
from forensics.store import all_tables, ddl, stored_name

from .conftest import FIXTURES


def _write(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "driver.log").write_text(
        "\x1b[36m(TaskRunner pid=4101)\x1b[0m TaskRunner hostname: node-a, PID: 4101\n"
        "plain line kept as it is\n"
        "step:1 - actor/grad_norm:0.25 - actor/lr:1e-05 - timing_s/gen:12 - critic/score:nan\n"
        "step:2 - actor/grad_norm:0.5 - actor/lr:1.000e-05 - timing_s/gen:12.0\n")
    return folder


def _metrics(con) -> dict:
    return {(s, k): t for s, k, t in con.execute("SELECT step, key, value_text FROM metrics").fetchall()}


def test_stored_only_where_it_differs_and_read_back_whole(tmp_path):
    db = tmp_path / "a.duckdb"
    pipeline.ingest([str(_write(tmp_path / "logs"))], str(db), workers=1)
    con = duckdb.connect(str(db), read_only=True)
    n, differ, kept, nulls = con.execute(
        "SELECT count(*), count(*) FILTER (WHERE message <> text), count(_message), count(*) FILTER (WHERE message IS NULL) "
        "FROM lines").fetchone()
    assert n == 4 and nulls == 0
    assert kept == differ == 1  # only the line whose prefix was taken off keeps its message
    assert con.execute("SELECT message FROM lines WHERE line_no = 1").fetchone()[0] == "TaskRunner hostname: node-a, PID: 4101"
    got = _metrics(con)
    # printed as DuckDB prints the number: not kept; printed otherwise: kept as printed
    assert got[(1, "actor/grad_norm")] == "0.25" and got[(1, "actor/lr")] == "1e-05"
    assert got[(1, "timing_s/gen")] == "12" and got[(2, "actor/lr")] == "1.000e-05"
    assert got[(1, "critic/score")] == "nan" and got[(2, "timing_s/gen")] == "12.0"
    assert sorted(t for (t,) in con.execute("SELECT _value_text FROM metrics WHERE _value_text IS NOT NULL").fetchall()) \
        == ["1.000e-05", "12"]
    con.close()


def test_parquet_export_carries_the_column_whole_and_not_its_storage(tmp_path):
    db = tmp_path / "a.duckdb"
    pipeline.ingest([str(_write(tmp_path / "logs"))], str(db), workers=1)
    con = duckdb.connect(str(db), read_only=True)
    parquet(con, tmp_path / "pq", ["lines", "metrics"])
    stored = con.execute("SELECT line_no, message FROM lines ORDER BY 1").fetchall()
    con.close()
    pq = duckdb.connect()
    cols = [r[0] for r in pq.execute(f"DESCRIBE SELECT * FROM '{tmp_path / 'pq' / 'lines.parquet'}'").fetchall()]
    assert "message" in cols and not any(c.startswith("_") for c in cols)
    assert pq.execute(f"SELECT line_no, message FROM '{tmp_path / 'pq' / 'lines.parquet'}' ORDER BY 1").fetchall() == stored
    assert "_value_text" not in [r[0] for r in pq.execute(f"DESCRIBE SELECT * FROM '{tmp_path / 'pq' / 'metrics.parquet'}'").fetchall()]


def test_a_database_that_keeps_whole_columns_still_loads(tmp_path):
    """A database made before stored-once columns: `message` and `value_text` plain. New
    files go into it whole, and the answers are the same as in a new database."""
    old = tmp_path / "old.duckdb"
    con = duckdb.connect(str(old))
    for table in all_tables():
        whole = dataclasses.replace(table, columns=tuple(dataclasses.replace(c, default=None) for c in table.columns))
        con.execute(ddl(whole))
    con.close()
    logs = _write(tmp_path / "logs")
    pipeline.ingest([str(logs)], str(old), workers=1)
    new = tmp_path / "new.duckdb"
    pipeline.ingest([str(logs)], str(new), workers=1)
    a, b = duckdb.connect(str(old), read_only=True), duckdb.connect(str(new), read_only=True)
    hidden = {stored_name(c) for c in LINES.columns if c.default}
    assert hidden and not hidden & {r[0] for r in a.execute("DESCRIBE lines").fetchall()}
    q = "SELECT line_no, message, text FROM lines ORDER BY 1"
    assert a.execute(q).fetchall() == b.execute(q).fetchall()
    assert _metrics(a) == _metrics(b)
    a.close(), b.close()


def test_foundation_fixture_holds_no_stored_copy_of_text(tmp_path):
    db = tmp_path / "fx.duckdb"
    pipeline.ingest([str(FIXTURES / "foundation")], str(db), workers=1)
    con = duckdb.connect(str(db), read_only=True)
    n, nulls, copies = con.execute(
        "SELECT count(*), count(*) FILTER (WHERE message IS NULL), "
        "count(*) FILTER (WHERE _message IS NOT NULL AND _message = text) FROM lines").fetchone()
    assert n > 20 and nulls == 0 and copies == 0
    con.close()


def test_a_transaction_commits_together_or_not_at_all(tmp_path):
    """Store.transaction: the block's rows go in together; a block that raises leaves
    nothing and its exception goes on."""
    from forensics.store import Store

    store = Store(str(tmp_path / "t.duckdb"))
    try:
        store.con.execute("CREATE TABLE t (x INTEGER)")
        with store.transaction():
            store.con.execute("INSERT INTO t VALUES (1), (2)")
        with pytest.raises(KeyboardInterrupt), store.transaction():
            store.con.execute("INSERT INTO t VALUES (3)")
            raise KeyboardInterrupt
        assert store.con.execute("SELECT list(x ORDER BY x) FROM t").fetchone()[0] == [1, 2]
    finally:
        store.close()
