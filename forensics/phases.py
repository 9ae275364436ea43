"""Phase attribution: where each rank spent each step (rollout, reward, train, sync, other, idle).

The analysis itself is SQL (the modules ``forensics/sql/phases*.sql``); the mapping from span, task,
metric and log-marker names to phases is data (``signatures/phases.yaml``). This module loads
that data into the tables ``phase_rules`` and ``phase_settings`` the views join, and reads
the views back as polars frames.

:func:`attach` must run on a connection before the phase views return rows. On a writable
connection it stores the rules in the database (once per change of the YAML file); on a
read-only one it creates TEMP tables of the same names, which shadow the stored ones for
that connection only.
"""
from __future__ import annotations

import hashlib
import re
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import duckdb

from . import sql_modules
from .catalogue import load_yaml

if TYPE_CHECKING:
    import polars as pl

SIGNATURES = Path(str(resources.files("forensics.signatures")))  # the built-in rule files (package data)
PHASES_YAML = SIGNATURES / "phases.yaml"

PHASES = ("rollout", "reward", "train", "sync", "other")
SOURCES = ("kineto", "ray", "metrics", "log")
SOURCE_HASH_KEY = "_phases_yaml_sha256"


class PhaseRulesError(ValueError):
    """signatures/phases.yaml is malformed."""


def load_rules(path: str | Path = PHASES_YAML) -> tuple[list[dict[str, Any]], dict[str, str], str]:
    """Read the YAML file: (rule rows, settings, sha256 of the file)."""
    raw = Path(path).read_bytes()
    doc = load_yaml(raw) or {}
    rules_in = doc.get("rules")
    if not isinstance(rules_in, list) or not rules_in:
        raise PhaseRulesError(f"{path}: `rules` must be a non-empty list")
    rows: list[dict[str, Any]] = []
    for i, rule in enumerate(rules_in):
        if not isinstance(rule, dict):
            raise PhaseRulesError(f"{path}: rule {i + 1} is not a mapping")
        phase = rule.get("phase")
        if phase not in PHASES:
            raise PhaseRulesError(f"{path}: rule {i + 1}: phase {phase!r} is not one of {', '.join(PHASES)}")
        sources = rule.get("sources")
        if sources is not None:
            bad = [s for s in sources if s not in SOURCES]
            if bad:
                raise PhaseRulesError(f"{path}: rule {i + 1}: unknown source(s) {bad}")
        patterns: list[str] = []
        names = rule.get("names") or []
        if names:
            patterns.append("(?i)(?:" + "|".join(re.escape(str(n)) for n in names) + ")")
        for p in rule.get("patterns") or []:
            re.compile(p)  # a typo in a pattern should fail here, not as an empty view
            patterns.append(p if p.startswith("(?i)") else "(?i)" + p)
        if not patterns:
            raise PhaseRulesError(f"{path}: rule {i + 1} has neither `names` nor `patterns`")
        for p in patterns:
            rows.append({
                "priority": i, "phase": phase, "sub_phase": rule.get("sub_phase"), "pattern": p,
                "sources": ",".join(sources) if sources else None, "in_step": bool(rule.get("in_step", True)),
            })
    settings = {str(k): str(v) for k, v in (doc.get("settings") or {}).items()}
    return rows, settings, hashlib.sha256(raw).hexdigest()


def _sql_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _create_setting_macro(con: duckdb.DuckDBPyConnection, settings: dict[str, str], temp: bool) -> None:
    """(Re)define ``_phase_setting(key)`` as a CASE over the settings' literal values.

    The SQL files define it as a lookup in ``phase_settings``, which is correct but opaque to
    the optimiser: DuckDB compiles a regular expression that comes from a table once per
    row. With literals the expression folds to a constant and each pattern compiles once.
    """
    cases = " ".join(f"WHEN {_sql_literal(k)} THEN {_sql_literal(v)}" for k, v in sorted(settings.items()))
    where = "TEMP MACRO " if temp else "MACRO main."
    con.execute(f"CREATE OR REPLACE {where}_phase_setting(k) AS CASE k {cases} ELSE NULL END").fetchall()


def _create_rules_macro(con: duckdb.DuckDBPyConnection, rows: list[dict[str, Any]], temp: bool) -> None:
    """(Re)define ``_phase_rule_priority(bare, src)`` as a CASE over the rules' literal patterns.

    The SQL file defines it as a lookup in ``phase_rules`` (a regular expression from a
    column, compiled again for every name and rule); with literals each compiles once. The
    WHENs run in priority order, so the first that matches is the lowest priority, as in the
    lookup's ``min``."""
    whens = []
    for r in sorted(rows, key=lambda r: r["priority"]):
        cond = f"regexp_full_match(bare, {_sql_literal(r['pattern'])})"
        if r["sources"] is not None:
            cond += " AND src IN (" + ", ".join(_sql_literal(s) for s in r["sources"].split(",")) + ")"
        whens.append(f"WHEN {cond} THEN {int(r['priority'])}")
    where = "TEMP MACRO " if temp else "MACRO main."
    con.execute(f"CREATE OR REPLACE {where}_phase_rule_priority(bare, src) AS "
                f"CASE {' '.join(whens)} ELSE NULL::INTEGER END").fetchall()


_PLAIN_WORDS = re.compile(r"[A-Za-z0-9_]+(?:\|[A-Za-z0-9_]+)*")


def _create_category_macro(con: duckdb.DuckDBPyConnection, settings: dict[str, str], temp: bool) -> None:
    """(Re)define ``_phase_gpu_category(c)``: ``c IN (...)`` when ``gpu_categories`` is a plain
    alternation of words (``kernel|gpu_memcpy``), which a whole-string match of it accepts
    exactly; otherwise the SQL file's regular expression. The test runs on every trace event."""
    pattern = settings.get("gpu_categories")
    if pattern is not None and _PLAIN_WORDS.fullmatch(pattern):
        body = "c IN (" + ", ".join(_sql_literal(w) for w in pattern.split("|")) + ")"
    else:
        body = "regexp_full_match(c, _phase_setting('gpu_categories'))"
    where = "TEMP MACRO " if temp else "MACRO main."
    con.execute(f"CREATE OR REPLACE {where}_phase_gpu_category(c) AS {body}").fetchall()


# The phase attribution's results: attach() makes sure a connection has them (and what they
# are made of) as this version's SQL modules create them.
PHASE_VIEWS = ("phases", "phase_steps", "phase_run_steps", "phase_timeline")


def attach(con: duckdb.DuckDBPyConnection, path: str | Path = PHASES_YAML) -> None:
    """Load the phase rules into ``con`` (see the module docstring). Idempotent."""
    rows, settings, sha = load_rules(path)
    read_only = sql_modules.read_only(con)
    # a database of another version: TEMP views of this version's modules, which read the
    # rules' macros as TEMP macros too (a stored macro is not seen behind the module's own)
    temp = sql_modules.ensure(con, PHASE_VIEWS) or read_only
    settings = {**settings, SOURCE_HASH_KEY: sha}
    _create_setting_macro(con, settings, temp=temp)
    _create_rules_macro(con, rows, temp=temp)
    _create_category_macro(con, settings, temp=temp)
    if read_only:
        _fill_tables(con, "TEMP", rows, settings)
        return
    if sql_modules.has_main_table(con, "phase_settings"):
        have = con.execute("SELECT max(value) FROM main.phase_settings WHERE key = ?", [SOURCE_HASH_KEY]).fetchall()
        if have and have[0][0] == sha:
            return
    try:
        con.execute("BEGIN TRANSACTION").fetchall()
        _fill_tables(con, "main", rows, settings)
        con.execute("COMMIT").fetchall()
    except BaseException:
        con.execute("ROLLBACK").fetchall()
        raise


_RULE_COLUMNS = ("priority", "phase", "sub_phase", "pattern", "sources", "in_step")


def _fill_tables(con: duckdb.DuckDBPyConnection, where: str, rows: list[dict[str, Any]], settings: dict[str, str]) -> None:
    """``phase_rules`` and ``phase_settings`` holding ``rows`` and ``settings``: TEMP tables
    made anew (``where="TEMP"``, a read-only connection) or the database's own (``"main"``)."""
    if where == "TEMP":
        make, table = "CREATE OR REPLACE TEMP TABLE ", "temp.main"
    else:
        make, table = "CREATE TABLE IF NOT EXISTS main.", "main"
    con.execute(f"{make}phase_rules (priority INTEGER, phase VARCHAR, sub_phase VARCHAR, pattern VARCHAR, "
                "sources VARCHAR, in_step BOOLEAN)").fetchall()
    con.execute(f"{make}phase_settings (key VARCHAR, value VARCHAR)").fetchall()
    con.execute(f"DELETE FROM {table}.phase_rules").fetchall()
    con.execute(f"DELETE FROM {table}.phase_settings").fetchall()
    # one statement each: a list parameter per column, unnested side by side
    con.execute(f"INSERT INTO {table}.phase_rules SELECT " + ", ".join(f"unnest(${i + 1})" for i in range(len(_RULE_COLUMNS))),
                [[r[c] for r in rows] for c in _RULE_COLUMNS]).fetchall()
    con.execute(f"INSERT INTO {table}.phase_settings SELECT unnest($1), unnest($2)",
                [list(settings), list(settings.values())]).fetchall()


# The expensive views, in dependency order: ``cached`` materialises each as a TEMP table of
# the same name, which the later views (and the caller's queries) then read instead.
CACHED_VIEWS = (
    "_phase_log_markers", "phase_names", "phase_log_steps", "phase_step_placement", "phase_profiler_steps", "phase_spans", "_phase_kineto_segments",
    "phase_gpu_events", "_phase_collective_matches", "phase_collectives", "phases", "phase_steps",
    "phase_run_steps", "phase_timeline",
)


@contextmanager
def cached(con: duckdb.DuckDBPyConnection, needed: Iterable[str] = ()) -> Iterator[None]:
    """Compute the phase views once for the duration of the block.

    Inside it, queries of ``phases``, ``phase_steps`` etc. read TEMP tables that shadow the
    views; they are dropped on exit. Nested use reuses the outer block's tables. ``needed``:
    the views the block reads (default: all); the cached views listed after the last of
    them are not computed (each one depends only on those before it).
    """
    attach(con)
    temp_tables = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() WHERE temporary").fetchall()}
    temp_views = {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE temporary").fetchall()}
    queries = sql_modules.view_queries(sql_modules.needed(PHASE_VIEWS))
    made: list[str] = []
    replaced_temp_views = False
    needed = set(needed)
    positions = [i for i, v in enumerate(CACHED_VIEWS) if v in needed]
    upto = max(positions) + 1 if positions else len(CACHED_VIEWS)
    try:
        for view in CACHED_VIEWS[:upto]:
            if view in temp_tables:
                continue
            if view in temp_views:  # a read-only connection's stand-in for a stale stored view
                con.execute(f'DROP VIEW temp.main."{view}"').fetchall()
                replaced_temp_views = True
            con.execute(f'CREATE TEMP TABLE "{view}" AS {queries[view]}').fetchall()
            made.append(view)
        yield
    finally:
        for view in reversed(made):
            con.execute(f'DROP TABLE IF EXISTS temp.main."{view}"').fetchall()
        if replaced_temp_views:
            sql_modules.ensure(con, PHASE_VIEWS, force=True)
            attach(con)


def _frame(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None) -> "pl.DataFrame":
    import polars as pl

    return pl.from_arrow(con.sql(sql, params=params).to_arrow_table())  # type: ignore[return-value]


def phase_steps(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """One row per (rank, step): seconds per phase, idle, GPU figures and the source."""
    attach(con)
    return _frame(con, "SELECT * FROM phase_steps ORDER BY step, rank NULLS FIRST")


def phases(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """One row per (rank, step, phase, sub_phase) with seconds and source."""
    attach(con)
    return _frame(con, "SELECT * FROM phases ORDER BY step, rank NULLS FIRST, phase, sub_phase")


def timeline(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """Every phase span with its wall-clock start and end (see the view ``phase_timeline``)."""
    attach(con)
    return _frame(con, "SELECT * FROM phase_timeline ORDER BY start_us, rank NULLS FIRST")
