"""Stage 1: which rules match which lines, inside DuckDB.

One scan of ``lines`` with the union of every rule's keywords selects candidate lines into
a TEMP table; one ``UNION ALL`` query applies each rule's regular expressions (and negative
patterns and restrictions) to the candidates only. Each match becomes a :class:`Hit`."""
from __future__ import annotations

import re
from typing import Iterable

import duckdb
import polars as pl

from .. import catalogue as sig
from ..catalogue import Catalogue, Rule
from .facts import sql_str
from .model import Hit

MAX_HITS_PER_RULE_FILE = 2000


def _any_regex(column: str, patterns: Iterable[str]) -> str:
    return "(" + " OR ".join(f"regexp_matches({column}, {sql_str(p)})" for p in patterns) + ")"


def _rule_sql(idx: int, r: Rule) -> str:
    # the rule's own keywords first: a cheap substring test keeps the regexes off most rows
    kw = [f"contains(message, {sql_str(k)})" for k in r.keywords]
    kw += [f"contains(lower(message), {sql_str(k.lower())})" for k in r.keywords_ci]
    conds = ["(" + " OR ".join(kw) + ")"] if kw else []
    conds.append(_any_regex("message", r.patterns))
    if r.negative:
        conds.append("NOT " + _any_regex("message", r.negative))
    if not r.match_code_lines:
        conds.append(f"NOT regexp_matches(message, {sql_str(sig.CODE_LINE)})")
    w = r.where
    for col in ("header", "format", "level", "actor"):
        if w.get(col):
            conds.append(f"{col} IN ({', '.join(sql_str(v) for v in w[col])})")
    if w.get("path"):
        conds.append(f"regexp_matches(path, {sql_str(w['path'])})")
    if w.get("logger"):
        conds.append(f"regexp_matches(coalesce(logger, ''), {sql_str(w['logger'])})")
    if w.get("in_traceback") is True:
        conds.append("event_line IS NOT NULL")
    elif w.get("in_traceback") is False:
        conds.append("event_line IS NULL")
    return f"SELECT {idx} AS rule_idx, file_id, line_no FROM diag_candidates WHERE " + " AND ".join(conds)


def match(con: duckdb.DuckDBPyConnection, rules: list[Rule], extra: Iterable[str] = ()) -> pl.DataFrame:
    """Rule hits: one row per (rule, line), at most MAX_HITS_PER_RULE_FILE per rule and file.

    The one scan of ``lines`` keeps, in the TEMP table ``diag_candidates``, the lines that
    contain a rule keyword or match one of the ``extra`` patterns (read by later steps)."""
    # one alternation of plain literals keeps RE2 on its fast path; extra patterns (regexes
    # with anchors and classes) get their own keyword test first
    conds = [f"regexp_matches(l.message, {sql_str(sig.prefilter_regex(rules))})"]
    for p in extra:
        cs, ci = sig.derive_keywords([p], "extra pattern")
        kw = [f"contains(l.message, {sql_str(k)})" for k in cs] + [f"contains(lower(l.message), {sql_str(k.lower())})" for k in ci]
        conds.append(f"(({' OR '.join(kw)}) AND regexp_matches(l.message, {sql_str(p)}))")
    con.execute(
        f"""CREATE OR REPLACE TEMP TABLE diag_candidates AS
            SELECT l.file_id, l.line_no, l.ts, l.ts_quality, l.level, l.header, l.logger, l.actor, l.pid, l.node,
                   l.rank, l.event_line, l.message, l.text, f.path, f.format, f.pid AS file_pid
            FROM lines l JOIN files f USING (file_id)
            WHERE {" OR ".join(conds)}"""
    )
    if not rules:
        return pl.DataFrame()
    union = "\nUNION ALL\n".join(_rule_sql(i, r) for i, r in enumerate(rules))
    q = f"""
        WITH m AS ({union}),
        k AS (SELECT * FROM m QUALIFY row_number() OVER (PARTITION BY rule_idx, file_id ORDER BY line_no) <= {MAX_HITS_PER_RULE_FILE})
        SELECT k.rule_idx, c.* FROM k JOIN diag_candidates c USING (file_id, line_no)
        ORDER BY c.file_id, c.line_no, k.rule_idx"""
    return pl.from_arrow(con.sql(q).to_arrow_table())


def extract(h: Hit) -> None:
    for p in h.rule.extract:
        m = re.search(p, h.message)
        if not m:
            continue
        for k, v in m.groupdict().items():
            if v is not None and k not in h.groups:
                h.groups[k] = v.strip()



def line_hits(con: duckdb.DuckDBPyConnection, cat: Catalogue) -> list[Hit]:
    """Every rule hit on a line (the candidates table is left for later stages)."""
    rules = [r for r in cat.rules if r.patterns]  # the others match fatal events only
    df = match(con, rules, cat.rank_zero_prints)
    out: list[Hit] = []
    for row in df.iter_rows(named=True):
        r = rules[row["rule_idx"]]
        h = Hit(rule=r, file_id=row["file_id"], path=row["path"], fmt=row["format"], line_no=row["line_no"],
                ts=row["ts"], ts_quality=row["ts_quality"], level=row["level"], header=row["header"],
                actor=row["actor"], pid=row["pid"], node=row["node"], rank=row["rank"],
                event_line=row["event_line"], message=row["message"] or "", file_pid=row["file_pid"],
                text=row["text"])
        extract(h)
        out.append(h)
    return out
