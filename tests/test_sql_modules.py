"""The SQL modules (forensics/sql/*.sql) and their loader (forensics/sql_modules.py).

* the loader orders modules by the relations their headers say they depend on, and says so
  when one is missing or when modules depend on each other in a cycle;
* each module's header names what its SQL reads;
* every public view, run on a fixture database, gives the rows of tests/sql_expected/<view>.csv.
  After a change that is meant to change them:

      python -m pytest tests/test_sql_modules.py --update-expected

  rewrites the CSV files; read their diff before committing it.
"""
from __future__ import annotations

import csv
import difflib
import io
import json
import math
import re
import shutil
from datetime import date, datetime
from pathlib import Path

import duckdb
import pytest

from forensics import pipeline, sql_modules, store
from forensics.sql_modules import SqlModuleError
from tests.test_phases import load_trace_fixture

FIXTURES = Path(__file__).resolve().parent / "fixtures"
EXPECTED = Path(__file__).resolve().parent / "sql_expected"
# the fixture of the expected rows: these folders ingested as one database, plus the
# contract-shaped trace events of phase_straggler (two ranks, one of them late); together
# they give every public view rows
FOLDERS = ("foundation", "nccl_two_nodes", "torch_dist", "diag_rank_hang_desync", "diag_actor_died_boilerplate",
           "phase_ray", "kineto", "phase_straggler")

MODULES = sql_modules.modules()
PUBLIC_VIEWS = sorted(name for m in MODULES for kind, name in m.creates if kind == "VIEW" and not name.startswith("_"))


# -- the loader -------------------------------------------------------------------------------

def _write(folder: Path, **modules: str) -> Path:
    folder.mkdir(exist_ok=True)
    for name, sql in modules.items():
        (folder / f"{name}.sql").write_text(sql)
    return folder


def test_modules_are_ordered_by_what_they_depend_on_not_by_name(tmp_path):
    folder = _write(tmp_path / "sql",
                    a_last="-- depends: mid, t\nCREATE OR REPLACE VIEW last AS SELECT * FROM mid JOIN t USING (x);\n",
                    b_mid="-- depends: first\nCREATE OR REPLACE VIEW mid AS SELECT * FROM first;\n",
                    c_first="-- depends: t\nCREATE OR REPLACE VIEW first AS SELECT x FROM t;\n")
    mods = sql_modules.read(folder)
    assert [m.name for m in mods] == ["c_first", "b_mid", "a_last"]
    assert mods[-1].depends == ("mid", "t")
    con = duckdb.connect()
    con.execute("CREATE TABLE t (x INTEGER)")
    for m in mods:  # in that order every view binds
        for stmt in m.statements():
            con.execute(stmt)
    assert [m.name for m in sql_modules.needed(["mid"], mods)] == ["c_first", "b_mid"]


def test_a_cycle_is_refused_and_named(tmp_path):
    folder = _write(tmp_path / "sql",
                    one="-- depends: v3\nCREATE OR REPLACE VIEW v1 AS SELECT * FROM v3;\n",
                    two="-- depends: v1\nCREATE OR REPLACE VIEW v2 AS SELECT * FROM v1;\n",
                    three="-- depends: v2\nCREATE OR REPLACE VIEW v3 AS SELECT * FROM v2;\n",
                    free="CREATE OR REPLACE VIEW v0 AS SELECT 1 AS x;\n")
    with pytest.raises(SqlModuleError, match=r"cycle: (one -> three -> two -> one)"):
        sql_modules.read(folder)


def test_a_relation_made_twice_is_refused(tmp_path):
    folder = _write(tmp_path / "sql", a="CREATE OR REPLACE VIEW v AS SELECT 1;\n", b="CREATE OR REPLACE VIEW v AS SELECT 2;\n")
    with pytest.raises(SqlModuleError, match="v is created by two SQL modules: a.sql and b.sql"):
        sql_modules.read(folder)


def test_a_missing_dependency_is_named(tmp_path, monkeypatch):
    """A dependency no module creates is a table: creating the modules in a database that
    does not have it says which module wanted what, before any statement runs."""
    mods = sql_modules.read(_write(tmp_path / "sql", reader="-- depends: lines, no_such_table\n"
                                   "CREATE OR REPLACE VIEW reader AS SELECT * FROM no_such_table;\n"))
    monkeypatch.setattr(sql_modules, "modules", lambda: mods)
    con = duckdb.connect()
    con.execute("CREATE TABLE lines (x INTEGER)")
    with pytest.raises(SqlModuleError, match=r"reader\.sql depends on no_such_table: no SQL module creates it"):
        sql_modules.create(con)
    assert con.execute("SELECT count(*) FROM duckdb_views() WHERE view_name = 'reader'").fetchone()[0] == 0
    with pytest.raises(SqlModuleError, match="no SQL module creates nope"):
        sql_modules.needed(["nope"])


# -- the package's modules ----------------------------------------------------------------------

_COMMENT = re.compile(r"--[^\n]*")
_READ = re.compile(r"\b(?:FROM|JOIN)\s+([A-Za-z_]\w*)(?!\s*\()", re.I)
_CTE = re.compile(r"\b([A-Za-z_]\w*)\s+AS\s+(?:MATERIALIZED\s+)?\(", re.I)


def _reads(m: sql_modules.Module, known: set[str]) -> set[str]:
    """The relations of ``known`` that ``m``'s statements read (FROM, JOIN, a macro call),
    less the names of its own CTEs and relations."""
    body = _COMMENT.sub("", m.sql)
    ctes = set(_CTE.findall(body))
    names = set(_READ.findall(body))
    names |= {k for k in known if re.search(rf"(?<![\w.]){k}\s*\(", body)}  # macros, table macros
    return (names & known) - ctes - set(m.relations)


@pytest.mark.parametrize("m", MODULES, ids=lambda m: m.name)
def test_the_header_names_what_the_module_reads(m):
    tables = {t.name for t in store.all_tables()}
    made = {rel for mod in MODULES for rel in mod.relations}
    reads = _reads(m, tables | made)
    assert reads <= set(m.depends), f"forensics/sql/{m.name}.sql reads {sorted(reads - set(m.depends))}: add it to `-- depends:`"
    unused = [d for d in m.depends if not re.search(rf"(?<![\w.]){d}\b", _COMMENT.sub("", m.sql))]
    assert not unused, f"forensics/sql/{m.name}.sql: `-- depends:` names {unused}, which it does not read"
    external = set(m.depends) - made
    assert external <= tables, f"forensics/sql/{m.name}.sql depends on {sorted(external - tables)}: no module or table has that name"


def test_file_names_carry_no_order():
    assert not [m.name for m in MODULES if re.match(r"\d", m.name)], "the loader orders the modules: no number prefixes"


def test_the_database_answers_the_modules_version(tmp_path):
    s = store.Store(tmp_path / "v.duckdb")
    try:
        assert sql_modules.current(s.con)
        assert s.con.execute(f"SELECT {sql_modules.VERSION_MACRO}()").fetchone()[0] == sql_modules.version()
    finally:
        s.close()


def test_a_changed_module_makes_a_new_template(tmp_path, monkeypatch):
    """The empty database new ones are copied from is kept per schema: changing a module's
    text gives it another name, so the next database is made (and cached) with the change."""
    monkeypatch.setenv("FORENSICS_CACHE", str(tmp_path / "cache"))
    before = store.template_path()
    changed = [sql_modules.parse(m.name, m.sql.replace("SELECT f.path, f.format, l.*", "SELECT f.path, f.format, 1 AS new_column, l.*"))
               if m.name == "log" else m for m in MODULES]
    monkeypatch.setattr(sql_modules, "_package_modules", lambda: tuple(changed))
    assert store.template_path() != before
    s = store.Store(tmp_path / "n.duckdb")
    try:
        assert "new_column" in [r[0] for r in s.con.execute("DESCRIBE log").fetchall()]
    finally:
        s.close()
    assert Path(store.template_path()).exists()


def test_bringing_a_database_up_to_date_drops_retired_helpers(tmp_path):
    """An earlier version's helper views and macros (public names then) go when a writable
    store updates the database; a user's table of such a name stays."""
    db = tmp_path / "old.duckdb"
    store.Store(db).close()
    con = duckdb.connect(str(db))
    con.execute("CREATE VIEW phase_trace AS SELECT 1 AS x").fetchall()
    con.execute("CREATE MACRO phase_setting(k) AS k").fetchall()
    con.execute("CREATE TABLE phase_engine (mine INTEGER)").fetchall()
    con.execute(f"CREATE OR REPLACE MACRO {sql_modules.VERSION_MACRO}() AS 'older'").fetchall()
    con.execute("UPDATE meta SET value = 'older' WHERE key = 'schema_fingerprint'").fetchall()
    con.close()
    s = store.Store(db)
    try:
        views = {r[0] for r in s.con.execute("SELECT view_name FROM duckdb_views()").fetchall()}
        macros = {r[0] for r in s.con.execute("SELECT function_name FROM duckdb_functions() WHERE function_type = 'macro'").fetchall()}
        assert "phase_trace" not in views and "_phase_trace" in views
        assert "phase_setting" not in macros and "_phase_setting" in macros
        assert s.con.execute("SELECT count(*) FROM phase_engine").fetchone() == (0,)
        assert sql_modules.current(s.con)
    finally:
        s.close()


def test_a_database_of_another_version_gets_temp_stand_ins_once(tmp_path):
    """Read-only, a database whose relations another version made gets this version's as
    TEMP views, made once per connection for what is asked, and more when more is asked."""
    db = tmp_path / "old.duckdb"
    pipeline.ingest([str(FIXTURES / "diag_actor_died_boilerplate")], str(db), workers=1)
    con = duckdb.connect(str(db))
    con.execute("CREATE OR REPLACE VIEW rank_pids AS SELECT 1 AS stale").fetchall()
    con.execute(f"CREATE OR REPLACE MACRO {sql_modules.VERSION_MACRO}() AS 'older'").fetchall()
    con.close()
    con = duckdb.connect(str(db), read_only=True)
    try:
        def temp_views() -> set[str]:
            return {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE temporary").fetchall()}

        assert sql_modules.ensure(con, ["rank_pids"])
        assert {"rank_pids", "actor_deaths", "ray_task_errors"} <= temp_views() and "phases" not in temp_views()
        assert "pid" in [r[0] for r in con.execute("DESCRIBE rank_pids").fetchall()]
        con.execute("CREATE OR REPLACE TEMP VIEW actor_deaths AS SELECT 'kept' AS mark").fetchall()
        assert sql_modules.ensure(con, ["rank_pids"])  # made already: not again
        assert con.execute("SELECT mark FROM actor_deaths").fetchone()[0] == "kept"
        assert sql_modules.ensure(con, ["phases"]) and "phases" in temp_views()
        assert sql_modules.ensure(con, ["rank_pids"], force=True)
        assert "member_index" in [r[0] for r in con.execute("DESCRIBE actor_deaths").fetchall()]
    finally:
        con.close()
    with duckdb.connect() as other:  # not a forensics database: nothing is made
        assert not sql_modules.ensure(other, ["rank_pids"])


# -- expected rows ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sql_db(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sql-fixture")
    db = root / "run.duckdb"
    for name in FOLDERS:
        shutil.copytree(FIXTURES / name, root / name, ignore=shutil.ignore_patterns("expected.json", "trace_events.json"))
    pipeline.ingest([str(root / name) for name in FOLDERS], str(db), workers=1)
    load_trace_fixture(db, FIXTURES / "phase_straggler")
    return db


def _cell(value) -> str:
    """A value as the expected CSV writes it: floats to 10 significant digits (the last
    bits of a sum depend on the order DuckDB's threads add it in), NULL as ``NULL``."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if not math.isfinite(value) else f"{value:.10g}"
    if isinstance(value, (datetime, date)):
        return value.isoformat(sep=" ") if isinstance(value, datetime) else value.isoformat()
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(_plain(value), sort_keys=True)
    return str(value)


def _plain(value):
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int)) or value is None else _cell(value)


def view_csv(con: duckdb.DuckDBPyConnection, view: str) -> str:
    """The view's rows as CSV, header first, rows in the order of their text (a stable
    order for every column type; DuckDB cannot ORDER BY a MAP)."""
    cur = con.execute(f'SELECT * FROM "{view}"')
    header = [d[0] for d in cur.description]
    rows = sorted([_cell(v) for v in row] for row in cur.fetchall())
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


@pytest.fixture(scope="module")
def sql_con(sql_db):
    from forensics import phases

    con = duckdb.connect(str(sql_db), read_only=True)
    con.execute("SET threads = 1")
    phases.attach(con)
    yield con
    con.close()


def _read(path: Path) -> str:
    # newline="": log text keeps its carriage returns (progress bars), which universal
    # newlines would turn into line ends
    with open(path, newline="") as fh:
        return fh.read()


def mismatch(view: str, got: str, path: Path) -> str | None:
    """Why ``got`` is not the expected CSV ``path`` of ``view`` (None: it is)."""
    if not path.exists():
        return f"{path} is missing: run python -m pytest tests/test_sql_modules.py --update-expected"
    want = _read(path)
    if got == want:
        return None
    diff = "\n".join(list(difflib.unified_diff(want.split("\n"), got.split("\n"), "expected", "got", lineterm="", n=1))[:60])
    return (f"{view} gives other rows than {path.name} (python -m pytest tests/test_sql_modules.py "
            f"--update-expected rewrites it if the change is meant):\n{diff}")


@pytest.mark.parametrize("view", PUBLIC_VIEWS)
def test_view_gives_the_expected_rows(view, sql_con, request):
    got = view_csv(sql_con, view)
    assert got.count("\n") > 1, f"{view}: no rows on the fixture; add a folder to FOLDERS that gives it some"
    path = EXPECTED / f"{view}.csv"
    if request.config.getoption("--update-expected"):
        EXPECTED.mkdir(exist_ok=True)
        with open(path, "w", newline="") as fh:
            fh.write(got)
        return
    problem = mismatch(view, got, path)
    if problem:
        pytest.fail(problem)


def test_every_public_view_has_expected_rows_and_no_others():
    have = {p.stem for p in EXPECTED.glob("*.csv")}
    assert have == set(PUBLIC_VIEWS), f"tests/sql_expected/: missing {sorted(set(PUBLIC_VIEWS) - have)}, stale {sorted(have - set(PUBLIC_VIEWS))}"


def test_a_changed_row_fails(sql_con, tmp_path):
    """One value changed in one row of the expected CSV, or one row fewer: the view fails."""
    got = view_csv(sql_con, "errors_by_rank")
    header, first, *rest = got.split("\n")[:-1]
    path = tmp_path / "errors_by_rank.csv"
    assert mismatch("errors_by_rank", got, EXPECTED / "errors_by_rank.csv") is None
    path.write_text("\n".join([header, re.sub(r",\d", ",9", first, count=1), *rest]) + "\n")
    assert "+" + first in mismatch("errors_by_rank", got, path)
    path.write_text("\n".join([header, *rest]) + "\n")
    assert "+" + first in mismatch("errors_by_rank", got, path)
