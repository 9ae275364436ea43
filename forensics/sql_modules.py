"""The SQL modules of ``forensics/sql/``: one loader for the store, the phase attribution and
the diagnosis.

Each ``*.sql`` file is one module: a leading ``--`` comment block that documents its public
relations (docs/schema.md is made from it), then the statements that create them. Its
header names every relation (table, view, macro) the module reads and does not create
itself::

    -- depends: lines, files, _phase_trace

(several ``-- depends:`` lines add up; names are separated by commas). The loader orders
the modules so that each comes after the modules that create what it depends on; the file
names play no part. A relation whose name starts with ``_`` is a helper of the modules, not
for users: docs/schema.md leaves it out.

This module imports nothing of forensics: the store, ``forensics.phases`` and
``forensics.diagnose`` all read the modules through it.
"""
from __future__ import annotations

import hashlib
import heapq
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Iterable

import duckdb

# Answers the hash of the modules that created a database's relations (see ensure()).
VERSION_MACRO = "_sql_modules_version"
# What the modules of earlier versions made and these do not: dropped when a database is
# brought up to date (create()), so that an old helper does not linger among the views.
RETIRED_VIEWS = ("phase_trace", "phase_engine", "phase_log_markers", "phase_kineto_segments",
                 "phase_gpu_islands", "phase_collective_matches")
RETIRED_MACROS = ("phase_setting", "phase_rule_priority", "phase_gpu_category", "phase_views_version")

_DEPENDS = re.compile(r"^--\s*depends:(.*)$", re.M)
_CREATES = re.compile(
    r"^CREATE\s+(?:OR\s+REPLACE\s+)?(?:TEMP\s+)?(VIEW|MACRO|TABLE)\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)", re.I | re.M)
_VIEW = re.compile(r"^CREATE OR REPLACE VIEW (\w+) AS\s", re.M)


class SqlModuleError(ValueError):
    """The SQL modules cannot be put in order or created: modules that depend on each other
    in a cycle, two modules that create the same name, or a dependency that no module
    creates and the database has no table of."""


@dataclass(frozen=True)
class Module:
    name: str  # the file name without .sql
    sql: str
    depends: tuple[str, ...]  # relations read and not created here, as the header names them
    creates: tuple[tuple[str, str], ...]  # (kind, name): VIEW / MACRO / TABLE, in file order

    @property
    def relations(self) -> tuple[str, ...]:
        return tuple(name for _, name in self.creates)

    @property
    def public(self) -> tuple[str, ...]:
        """What the module makes for users (docs/schema.md); ``_helpers`` are left out."""
        return tuple(name for name in self.relations if not name.startswith("_"))

    @property
    def doc(self) -> str:
        """The leading comment block without the ``depends:`` lines: the module's section
        of docs/schema.md."""
        lines = []
        for line in self.sql.splitlines():
            if _DEPENDS.match(line):
                continue
            if line.startswith("--"):
                lines.append(line[2:].removeprefix(" "))
            elif line.strip():
                break
        return "\n".join(lines).strip()

    def statements(self) -> list[str]:
        """The module's statements, comments between them included, without the ``;``."""
        return [s for s in self.sql.split(";\n") if "CREATE" in s]


def parse(name: str, sql: str) -> Module:
    """The module ``name`` (its file name without .sql) of text ``sql``."""
    depends: list[str] = []
    for m in _DEPENDS.finditer(sql):
        depends += [d for d in re.split(r"[\s,]+", m.group(1)) if d]
    creates = tuple((kind.upper(), rel) for kind, rel in _CREATES.findall(sql))
    own = {rel for _, rel in creates}
    return Module(name, sql, tuple(dict.fromkeys(d for d in depends if d not in own)), creates)


def order(modules: Iterable[Module]) -> list[Module]:
    """The modules in dependency order (ties by name). A dependency that no module creates
    is taken for a table (:func:`create` checks that the database has it)."""
    mods = sorted(modules, key=lambda m: m.name)
    maker: dict[str, Module] = {}
    for m in mods:
        for rel in m.relations:
            if rel in maker and maker[rel] is not m:
                raise SqlModuleError(f"{rel} is created by two SQL modules: {maker[rel].name}.sql and {m.name}.sql")
            maker[rel] = m
    after = {m.name: {maker[d].name for d in m.depends if d in maker} for m in mods}
    waiting = {name: len(deps) for name, deps in after.items()}
    users: dict[str, list[str]] = {m.name: [] for m in mods}
    for name, deps in after.items():
        for d in deps:
            users[d].append(name)
    by_name = {m.name: m for m in mods}
    ready = [name for name, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    out: list[Module] = []
    while ready:
        name = heapq.heappop(ready)
        out.append(by_name[name])
        for u in users[name]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(out) < len(mods):
        raise SqlModuleError("SQL modules depend on each other in a cycle: " + _cycle(after, {m.name for m in out}))
    return out


def _cycle(after: dict[str, set[str]], placed: set[str]) -> str:
    """One cycle among the modules that could not be placed, as ``a -> b -> a``."""
    start = min(n for n in after if n not in placed)
    path, seen = [start], {start}
    while True:
        nxt = min(d for d in after[path[-1]] if d not in placed)
        if nxt in seen:
            return " -> ".join(path[path.index(nxt):] + [nxt])
        path.append(nxt)
        seen.add(nxt)


def read(folder: str | Path) -> list[Module]:
    """Every module of ``folder``, in dependency order."""
    return order(parse(p.stem, p.read_text()) for p in Path(folder).glob("*.sql"))


@lru_cache(maxsize=1)
def _package_modules() -> tuple[Module, ...]:
    folder = resources.files("forensics") / "sql"
    return tuple(order(parse(e.name[:-4], e.read_text()) for e in folder.iterdir() if e.name.endswith(".sql")))


def modules() -> list[Module]:
    """The modules of forensics/sql/, in dependency order."""
    return list(_package_modules())


def needed(relations: Iterable[str], mods: list[Module] | None = None) -> list[Module]:
    """The modules that create ``relations`` and those they depend on, in dependency order."""
    mods = modules() if mods is None else mods
    maker = {rel: m for m in mods for rel in m.relations}
    todo = list(relations)
    missing = [r for r in todo if r not in maker]
    if missing:
        raise SqlModuleError(f"no SQL module creates {', '.join(missing)}")
    want: set[str] = set()
    while todo:
        m = maker[todo.pop()]
        if m.name not in want:
            want.add(m.name)
            todo += [d for d in m.depends if d in maker]
    return [m for m in mods if m.name in want]


def version(mods: list[Module] | None = None) -> str:
    """Hash of the modules' names and text: what :data:`VERSION_MACRO` answers in a database
    whose relations they created."""
    h = hashlib.sha256()
    for m in modules() if mods is None else mods:
        h.update(m.name.encode() + b"\0" + m.sql.encode() + b"\0")
    return h.hexdigest()


def view_queries(mods: list[Module]) -> dict[str, str]:
    """The query of each view of ``mods``, as written in its module."""
    out = {}
    for m in mods:
        for stmt in m.statements():
            v = _VIEW.search(stmt)
            if v:
                out[v.group(1)] = stmt[v.end():]
    return out


def read_only(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether ``con``'s database was opened read-only."""
    row = con.execute(
        "SELECT readonly FROM duckdb_databases() WHERE database_name = current_database()"
    ).fetchall()
    return bool(row and row[0][0])


def has_main_table(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    """Whether the database (not the connection's TEMP schema) has the table ``name``."""
    return bool(con.execute(
        "SELECT count(*) FROM duckdb_tables() WHERE table_name = ? AND schema_name = 'main' AND database_name = current_database()",
        [name],
    ).fetchall()[0][0])


def _check_tables(con: duckdb.DuckDBPyConnection, mods: list[Module], everything: list[Module]) -> None:
    """A dependency that no module creates must be a table of the database: say which is not."""
    made = {rel for m in everything for rel in m.relations}
    have = {r[0] for r in con.execute(
        "SELECT table_name FROM duckdb_tables() UNION ALL SELECT view_name FROM duckdb_views()").fetchall()}
    for m in mods:
        gone = [d for d in m.depends if d not in made and d not in have]
        if gone:
            raise SqlModuleError(f"forensics/sql/{m.name}.sql depends on {', '.join(gone)}: "
                                 "no SQL module creates it and the database has no table of that name")


def create(con: duckdb.DuckDBPyConnection, mods: list[Module] | None = None, temp: bool = False) -> None:
    """Run the modules on ``con`` (default: all of them; then what older versions made and
    these do not is dropped, and their version recorded).

    ``temp``: as TEMP views and macros, which shadow the stored ones for this connection only
    (a read-only connection can make nothing else). A table a module creates ``IF NOT
    EXISTS`` (an input it may find missing) is made only when the database lacks it, TEMP
    when it is read-only: a TEMP table would hide the one a writable connection fills."""
    everything = modules()
    whole = mods is None
    mods = everything if whole else mods
    _check_tables(con, mods, everything)
    temp_tables = temp and read_only(con)
    for m in mods:
        for stmt in m.statements():
            if temp:
                table = re.search(r"CREATE TABLE IF NOT EXISTS (\w+)", stmt)
                if table and has_main_table(con, table.group(1)):
                    continue
                if temp_tables:
                    stmt = stmt.replace("CREATE TABLE IF NOT EXISTS", "CREATE TEMP TABLE IF NOT EXISTS")
                stmt = (stmt.replace("CREATE OR REPLACE VIEW", "CREATE OR REPLACE TEMP VIEW")
                        .replace("CREATE OR REPLACE MACRO", "CREATE OR REPLACE TEMP MACRO"))
            con.execute(stmt).fetchall()
    if whole and not temp:
        # only views and macros of those names: a user's table of such a name stays
        for (view,) in con.execute(
                "SELECT view_name FROM duckdb_views() WHERE NOT temporary AND schema_name = 'main' "
                "AND database_name = current_database() AND list_contains(?, view_name)", [list(RETIRED_VIEWS)]).fetchall():
            con.execute(f"DROP VIEW main.{view}").fetchall()
        for (macro,) in con.execute(
                "SELECT DISTINCT function_name FROM duckdb_functions() WHERE function_type = 'macro' AND NOT internal "
                "AND schema_name = 'main' AND database_name = current_database() AND list_contains(?, function_name)",
                [list(RETIRED_MACROS)]).fetchall():
            con.execute(f"DROP MACRO main.{macro}").fetchall()
        con.execute(f"CREATE OR REPLACE MACRO {VERSION_MACRO}() AS '{version(everything)}'").fetchall()


def _macro_answer(con: duckdb.DuckDBPyConnection, macro: str) -> str | None:
    """What the macro ``macro()`` answers on ``con``, None when there is no such macro (or
    one of that name from elsewhere that takes arguments). Asked directly: listing
    ``duckdb_functions()`` costs tens of milliseconds a call."""
    try:
        return con.execute(f"SELECT {macro}()").fetchall()[0][0]
    except duckdb.CatalogException:  # no such macro
        return None
    except duckdb.BinderException:  # a macro of that name from elsewhere that takes arguments
        return None


def current(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the database's relations were made by these modules (its version macro
    answers their hash)."""
    return _macro_answer(con, VERSION_MACRO) == version()


# TEMP macro: the modules this connection has TEMP stand-ins of (see ensure())
_STOOD_IN = "_sql_modules_stood_in"


def ensure(con: duckdb.DuckDBPyConnection, relations: Iterable[str], force: bool = False) -> bool:
    """Make ``relations`` current on ``con``, for a database written by another forensics
    version, which may lack them or hold old ones: nothing when its relations are this
    version's; else TEMP stand-ins of the modules ``relations`` need, which shadow the
    stored ones for this connection only (once per connection, unless ``force``: the
    caller dropped some). The database itself is never changed: a writable
    :class:`forensics.store.Store` brings it up to date when it opens it. A database
    without the ``files`` table is not forensics': left alone.

    Returns whether the connection reads TEMP stand-ins."""
    if not has_main_table(con, "files") or current(con):
        return False
    want = needed(relations)
    have = set((_macro_answer(con, _STOOD_IN) or "").split())
    if force or not {m.name for m in want} <= have:
        create(con, want, temp=True)
        have |= {m.name for m in want}
        con.execute(f"CREATE OR REPLACE TEMP MACRO {_STOOD_IN}() AS '{' '.join(sorted(have))}'").fetchall()
    return True
