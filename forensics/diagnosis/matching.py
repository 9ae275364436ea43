"""Stage 1: which rules match which lines, inside DuckDB.

One scan of ``lines`` with the union of every rule's keywords selects candidate lines into
a TEMP table; one ``UNION ALL`` query applies each rule's regular expressions (and negative
patterns and restrictions) to the candidates only. Each match becomes a :class:`Hit`."""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Callable, Iterable, Iterator, NamedTuple

import duckdb

from .. import catalogue as sig
from ..catalogue import Catalogue, ExceptionMatch, Rule
from .facts import keyword_sql, sql_str
from .model import Hit
from ..parsers.conventions import WRAP_MAX_LINES, WRAP_MIN_SHARE, WRAP_MIN_WIDTH

MAX_HITS_PER_RULE_FILE = 2000


def _any_regex(column: str, patterns: Iterable[str]) -> str:
    return "(" + " OR ".join(f"regexp_matches({column}, {sql_str(p)})" for p in patterns) + ")"


def _message_conds(r: Rule) -> list[str]:
    """The tests of rule ``r`` that read only ``message``: its keywords first (a cheap
    substring test keeps the regexes off most rows), its patterns, negative patterns and
    the code-line test."""
    kw = keyword_sql("message", r.keywords, r.keywords_ci)
    conds = [kw] if kw else []
    conds.append(_any_regex("message", r.patterns))
    if r.negative:
        conds.append("NOT " + _any_regex("message", r.negative))
    if not r.match_code_lines:
        conds.append(f"NOT regexp_matches(message, {sql_str(sig.CODE_LINE)})")
    return conds


def _line_conds(r: Rule) -> list[str]:
    """The tests of rule ``r`` on the rest of a candidate line (its ``where``)."""
    conds = []
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
    return conds


def _rule_sql(idx: int, r: Rule) -> str:
    """Rule ``r``'s message tests over the distinct candidate messages (``diag_messages``):
    a big run prints the same line on many ranks and nodes, and each regex then runs once
    per text instead of once per line."""
    return f"SELECT {idx} AS rule_idx, message FROM diag_messages WHERE " + " AND ".join(_message_conds(r))


# A file is hard-wrapped when a terminal cut its lines at a fixed width W (a paste of a
# narrow console): no line is longer than W and many are exactly W long. Such a line, unless
# it ends in padding, continues on the next one. Only files of up to WRAP_MAX_LINES lines
# are examined (pastes; a real log is not wrapped, and this saves scanning big files).
# A trailing \r (a paste saved with Windows line ends) is not part of a line's width. The
# parser reads the same shape for fatal events (parsers/fatal_events.py; the numbers: parsers/conventions.py).


def wrapped_records(con: duckdb.DuckDBPyConnection) -> None:
    """TEMP table ``diag_wrapped(file_id, line_no, message)``: the logical lines of
    hard-wrapped files (more than one physical line), at their first line, joined."""
    con.execute(
        f"""CREATE OR REPLACE TEMP TABLE diag_wrapped AS
            WITH small AS (SELECT file_id FROM files WHERE kind = 'text' AND lines <= {WRAP_MAX_LINES}),
            -- the widths first (cheap, computed once); the text only of the lines of full width
            -- in the files with enough of them; the words and neighbours only of the few wrapped files
            len AS MATERIALIZED (SELECT l.file_id, length(rtrim(l.text, chr(13))) AS n FROM lines l SEMI JOIN small USING (file_id)),
            widest AS (SELECT file_id, max(n) AS w, count(*) AS c FROM len GROUP BY file_id HAVING max(n) >= {WRAP_MIN_WIDTH}),
            full_width AS (SELECT file_id, widest.w FROM widest JOIN len USING (file_id) WHERE len.n = widest.w
                           GROUP BY file_id, widest.w, widest.c HAVING count(*) >= greatest(3, {WRAP_MIN_SHARE} * widest.c)),
            width AS (SELECT file_id, full_width.w FROM full_width JOIN lines l USING (file_id) WHERE length(rtrim(l.text, chr(13))) = full_width.w
                      GROUP BY file_id, full_width.w HAVING count(DISTINCT l.text) >= 3),
            prev AS (SELECT l.file_id, l.line_no, l.message, t.text, l.header, length(t.text) AS n, width.w,
                            regexp_extract(t.text, '^\\W*\\w+') AS first_word,
                            lag(length(t.text)) OVER w0 AS prev_n, lag(t.text) OVER w0 AS prev_text,
                            lag(regexp_extract(t.text, '^\\W*\\w+')) OVER w0 AS prev_word
                     FROM lines l JOIN width USING (file_id), LATERAL (SELECT rtrim(l.text, chr(13)) AS text) t
                     WINDOW w0 AS (PARTITION BY l.file_id ORDER BY l.line_no)),
            -- a full-width line continues on the next one unless it ends in padding, or the next
            -- line starts a record of its own (a header, or the first word the full line starts with)
            g AS (SELECT *, sum(CASE WHEN prev_n = w AND NOT regexp_matches(prev_text, '\\s$') AND header IS NULL
                                          AND first_word IS DISTINCT FROM prev_word THEN 0 ELSE 1 END)
                              OVER (PARTITION BY file_id ORDER BY line_no) AS grp FROM prev)
            SELECT file_id, min(line_no) AS line_no, string_agg(message, '' ORDER BY line_no) AS message
            FROM g GROUP BY file_id, grp HAVING count(*) > 1""")


def candidates(con: duckdb.DuckDBPyConnection, rules: list[Rule], extra: Iterable[str] = ()) -> None:
    """The one scan of ``lines``: the TEMP table ``diag_candidates`` of the lines that contain
    a rule keyword or match one of the ``extra`` patterns (read by later steps too), and
    ``diag_messages``, their distinct messages. A hard-wrapped logical line is matched
    whole, at its first physical line."""
    wrapped_records(con)
    msg = "coalesce(w.message, l.message)"
    # one alternation of plain literals keeps RE2 on its fast path; extra patterns (regexes
    # with anchors and classes) get their own keyword test first
    conds = [f"regexp_matches({msg}, {sql_str(sig.prefilter_regex(r for r in rules if r.patterns))})"]
    for p in extra:
        cs, ci = sig.derive_keywords([p], "extra pattern")
        conds.append(f"({keyword_sql(msg, cs, ci)} AND regexp_matches({msg}, {sql_str(p)}))")
    con.execute(
        f"""CREATE OR REPLACE TEMP TABLE diag_candidates AS
            SELECT l.file_id, l.line_no, l.ts, l.ts_quality, l.level, l.header, l.logger, l.actor, l.pid, l.node,
                   l.rank, l.event_line, {msg} AS message,
                   -- kept small (a big run has hundreds of thousands of candidates): the physical
                   -- line's message only where a wrapped record stands for it, the raw text only
                   -- of NCCL lines (what a hit keeps of it: nccl_text)
                   CASE WHEN w.message IS NOT NULL THEN l.message END AS line_message,
                   CASE WHEN l.header = 'nccl' THEN l.text END AS text, f.path, f.format, f.pid AS file_pid
            FROM lines l JOIN files f USING (file_id) LEFT JOIN diag_wrapped w USING (file_id, line_no)
            WHERE {" OR ".join(conds)}"""
    )
    con.execute("CREATE OR REPLACE TEMP TABLE diag_messages AS SELECT DISTINCT message FROM diag_candidates WHERE message IS NOT NULL")


def _hits_sql(rules: list[Rule], kept: Iterable[int] | None = None) -> str:
    """The rule hits over ``diag_candidates``: one row per (rule, line), at most
    MAX_HITS_PER_RULE_FILE per rule and file, in (file, line, rule) order. ``kept``: the
    indexes of the rules to try (default: every rule with line patterns). The message tests
    run on the distinct messages (``diag_messages``, made by :func:`candidates`); the rest
    of a rule's ``where`` on the lines that carry a matching message."""
    kept = set(range(len(rules)) if kept is None else kept)
    chosen = [(i, r) for i, r in enumerate(rules) if r.patterns and i in kept]
    union = "\nUNION ALL\n".join(_rule_sql(i, r) for i, r in chosen) \
        or "SELECT NULL::INTEGER AS rule_idx, message FROM diag_messages WHERE false"
    line_tests = [(i, _line_conds(r)) for i, r in chosen]
    line_tests = [f"WHEN {i} THEN " + " AND ".join(c) for i, c in line_tests if c]
    where = f"WHERE CASE m.rule_idx {' '.join(line_tests)} ELSE true END" if line_tests else ""
    return f"""
        WITH m AS ({union}),
        j AS (SELECT m.rule_idx, c.file_id, c.line_no FROM m JOIN diag_candidates c USING (message) {where}),
        k AS (SELECT * FROM j QUALIFY row_number() OVER (PARTITION BY rule_idx, file_id ORDER BY line_no) <= {MAX_HITS_PER_RULE_FILE})
        SELECT k.rule_idx, c.* FROM k JOIN diag_candidates c USING (file_id, line_no)
        ORDER BY c.file_id, c.line_no, k.rule_idx"""


# Up to this many candidate lines the rules whose keywords occur in none are left out of the
# union (planning the union of every rule is most of a small run's matching: 0.15 of 0.18 s
# for 72 candidates); past it, the pre-check's scan costs more than the branches it saves
# (74k candidates: 0.64 s for the pre-check, 1.05 s for the union of the 77 rules kept,
# 1.28 s for the union of all 107).
PRECHECK_MAX_CANDIDATES = 10_000


def _rules_with_candidates(con: duckdb.DuckDBPyConnection, rules: list[Rule], in_python: bool = True) -> list[int]:
    """The indexes of the rules with line patterns that can match a candidate: those whose
    keyword test (the first condition of :func:`_rule_sql`) holds on at least one, and
    those without keywords: the union of the rest would only be planned to give no row.
    Every rule with line patterns when there are more than PRECHECK_MAX_CANDIDATES
    candidates. The test runs in Python over the candidates' messages when they are ASCII
    (``in_python``; substrings and lower case are then the same as DuckDB's), else as one
    aggregate in DuckDB."""
    rows = con.execute(f"SELECT message FROM diag_candidates LIMIT {PRECHECK_MAX_CANDIDATES + 1}").fetchall()
    with_patterns = [i for i, r in enumerate(rules) if r.patterns]
    if len(rows) > PRECHECK_MAX_CANDIDATES:
        return with_patterns
    out = {i for i in with_patterns if not rules[i].keywords and not rules[i].keywords_ci}
    tested = [i for i in with_patterns if i not in out]
    text = "\0".join(m for (m,) in rows if m) if in_python else ""  # no keyword holds a NUL: none matches across two messages
    if in_python and text.isascii():
        lowered = text.lower()
        out.update(i for i in tested if any(k in text for k in rules[i].keywords)
                   or any(k.lower() in lowered for k in rules[i].keywords_ci))
    elif tested:
        # keyword_sql's test, with each message lowered once for all the case-insensitive keywords
        tests = [keyword_sql("message", rules[i].keywords, rules[i].keywords_ci, lowered="lowered") for i in tested]
        present = con.execute("SELECT [" + ", ".join(f"coalesce(bool_or({kw}), false)" for kw in tests)
                              + "] FROM (SELECT message, lower(message) AS lowered FROM diag_candidates)").fetchall()[0][0]
        out.update(i for i, ok in zip(tested, present) if ok)
    return sorted(out)


def match(con: duckdb.DuckDBPyConnection, rules: list[Rule], extra: Iterable[str] = ()):
    """Rule hits (:func:`_hits_sql`), one polars frame (for tests and notebooks); fills
    ``diag_candidates`` first. Empty, with no columns, when no rule has line patterns."""
    import polars as pl

    candidates(con, rules, extra)
    if not any(r.patterns for r in rules):
        return pl.DataFrame()
    return pl.from_arrow(con.sql(_hits_sql(rules, _rules_with_candidates(con, rules))).to_arrow_table())


HIT_BATCH = 20_000  # hit rows fetched from DuckDB at a time


def match_batches(con: duckdb.DuckDBPyConnection, rules: list[Rule], extra: Iterable[str] = ()) -> Iterator[list[dict]]:
    """:func:`match`'s rows, in order, as lists of at most HIT_BATCH rows (dicts by column):
    the hits of a big run are never all in Python at once. Fills ``diag_candidates`` first;
    none without line patterns (such rules match fatal events only: event_hits)."""
    candidates(con, rules, extra)
    if not any(r.patterns for r in rules):
        return
    kept = _rules_with_candidates(con, rules)
    cur = con.execute(_hits_sql(rules, kept))
    cols = [d[0] for d in cur.description]
    while True:
        batch = cur.fetchmany(HIT_BATCH)
        if not batch:
            return
        yield [dict(zip(cols, row)) for row in batch]


def extract(h: Hit, extra: str = "") -> None:
    """The named groups of the rule's ``extract`` patterns, from the line (and ``extra``:
    the event's messages) into ``h.groups``."""
    text = h.message + ("\n" + extra if extra else "")
    for p in h.rule.extract:
        m = re.search(p, text)
        if not m:
            continue
        for k, v in m.groupdict().items():
            if v is not None and k not in h.groups:
                h.groups[k] = v.strip()



def nccl_text(header: str | None, text: str | None) -> str | None:
    """What a hit keeps of its raw line: only an NCCL line's (Hit.cuda_dev reads the device in
    its header); the diagnosis reads ``message`` otherwise, and a big run has many hits."""
    return text if header == "nccl" else None


def line_hits(con: duckdb.DuckDBPyConnection, cat: Catalogue) -> list[Hit]:
    """Every rule hit on a line (the candidates table is left for later stages)."""
    rules = cat.rules
    out: list[Hit] = []
    # one string object for equal values: a line's text, message and physical message are
    # mostly the same string, and its path and values are those of the line's other hits
    shared: dict[str, str] = {}
    for batch in match_batches(con, rules, cat.rank_zero_prints):
        for row in batch:
            for k in ("path", "format", "ts_quality", "level", "header", "actor", "node", "message", "line_message", "text"):
                v = row[k]
                if v is not None:
                    row[k] = shared.setdefault(v, v)
            r = rules[row["rule_idx"]]
            h = Hit(rule=r, file_id=row["file_id"], path=row["path"], fmt=row["format"], line_no=row["line_no"],
                    ts=row["ts"], ts_quality=row["ts_quality"], level=row["level"], header=row["header"],
                    actor=row["actor"], pid=row["pid"], node=row["node"], rank=row["rank"],
                    event_line=row["event_line"], message=row["message"] or "", file_pid=row["file_pid"],
                    text=nccl_text(row["header"], row["text"]),
                    line_message=row["message"] if row["line_message"] is None else row["line_message"])
            extract(h)
            out.append(h)
    if cat.relayed_ranks:
        _ranks_relayed_by_events(con, out, cat.relayed_ranks)
    return out


def _ranks_relayed_by_events(con: duckdb.DuckDBPyConnection, hits: list[Hit], patterns: list[str]) -> None:
    """A line hit inside a fatal event that reports another rank's failure (the catalogue's
    ``relayed_ranks``) is about the rank the event names, as the event's own hits are
    (:func:`_event_hit`)."""
    inside = [h for h in hits if h.event_line is not None and "ranks" not in h.groups]
    if not inside:
        return
    keys = sorted({(h.file_id, h.event_line) for h in inside})
    rows = con.execute(
        """WITH k AS (SELECT unnest($fids) AS file_id, unnest($lns) AS line_no)
           SELECT e.file_id, e.line_no, hl.message, e.message, e.outer_message
           FROM k JOIN fatal_events e USING (file_id, line_no)
           LEFT JOIN lines hl ON hl.file_id = e.file_id AND hl.line_no = e.line_no
           WHERE regexp_matches(concat_ws(chr(10), hl.message, e.message, e.outer_message), $rx)
           ORDER BY e.file_id, e.line_no""",
        {"fids": [f for f, _ in keys], "lns": [ln for _, ln in keys], "rx": "|".join(f"(?:{p})" for p in patterns)}).fetchall()
    named = {(f, ln): relayed_ranks(patterns, texts) for f, ln, *texts in rows}
    for h in inside:
        rank = named.get((h.file_id, h.event_line))
        if rank is not None:
            h.groups["ranks"] = str(rank)  # placement reads it as the rank the text names


# -- fatal events ------------------------------------------------------------------------

EVENT_COLUMNS = ("file_id", "line_no", "last_line", "exc_line", "kind", "exc_type", "exc_name", "message", "outer_type",
                 "outer_message", "wrapper", "wrapped_type", "types", "chain", "frames", "package", "user_frame", "signal",
                 "ray_actor", "ray_method", "ray_pid", "actor", "cut_off")
# a traceback logged at these levels, after which its process logged more, was handled
QUIET_LEVELS = ("DEBUG", "INFO", "WARNING")
# how fatal_events marks an exception Python reported and went on from (at garbage
# collection or exit, in an asyncio task nobody awaited): not a failure of the run
SURVIVED = ("ignored", "atexit", "asyncio")


class EventFields(NamedTuple):
    """What the matchers read of a fatal event, made once per event (see event_matches)."""
    types: list[str]
    names: list[str]
    messages: list[str]
    frames: list[str]


def event_fields(e: dict) -> EventFields:
    types = [t for t in (e.get("types") or []) if t]
    for t in (e.get("exc_type"), e.get("wrapped_type"), e.get("outer_type")):
        if t and t not in types:
            types.append(t)
    names = types + [t.rsplit(".", 1)[-1].rsplit("::", 1)[-1] for t in types]
    messages = [x for x in (e.get("message"), e.get("outer_message"), *[(c or {}).get("message") for c in e.get("chain") or []]) if x]
    # a frame is read as `file:function`, and by the source line it shows
    frames = [f"{f.get('file')}:{f.get('function')}" for f in e.get("frames") or []]
    frames += [f["code"] for f in e.get("frames") or [] if f.get("code")]
    return EventFields(types, names, messages, frames)


_COMPILED: dict[str, re.Pattern] = {}


def _rx(pattern: str) -> re.Pattern:
    """``pattern`` compiled, once (event_matches runs hundreds of thousands of times on a
    big run, and ``re.search``'s own cache lookup cost as much as the searches)."""
    c = _COMPILED.get(pattern)
    if c is None:
        c = _COMPILED[pattern] = re.compile(pattern)
    return c


def event_matches(m: ExceptionMatch, e: dict, preceded: Callable[[str], bool] | None = None,
                  fields: EventFields | None = None) -> bool:
    """Whether the fatal event ``e`` (a ``fatal_events`` row as a dict) meets every field of
    the matcher ``m`` (see :class:`forensics.catalogue.ExceptionMatch`). ``preceded(regex)``
    answers ``preceded_by`` (None: such a matcher does not match), last. ``fields``: the
    event's :func:`event_fields`, when the caller tries many matchers on one event."""
    # the tests of set membership first, the regular expressions after them
    if m.raised_in and e.get("package") not in m.raised_in:
        return False
    if m.not_raised_in and e.get("package") in m.not_raised_in:
        return False
    if m.kind and e.get("kind") not in m.kind:
        return False
    if m.signal and e.get("signal") not in m.signal:
        return False
    if m.wrapper and e.get("wrapper") not in m.wrapper:
        return False
    if m.not_wrapper and e.get("wrapper") in m.not_wrapper:
        return False
    types, names, messages, frames = fields or event_fields(e)
    if m.type and not any(map(_rx(m.type).search, names)):
        return False
    if m.not_type and any(map(_rx(m.not_type).search, types)):
        return False
    if m.message and not any(map(_rx(m.message).search, messages)):
        return False
    if m.not_message and any(map(_rx(m.not_message).search, messages)):
        return False
    if m.frames and not any(map(_rx(m.frames).search, frames)):
        return False
    if m.not_frames and any(map(_rx(m.not_frames).search, frames)):
        return False
    if m.method and not _rx(m.method).search(e.get("ray_method") or ""):
        return False
    if m.actor and not any(_rx(m.actor).search(a) for a in (e.get("ray_actor"), e.get("actor")) if a):
        return False
    if m.preceded_by and (preceded is None or not preceded(m.preceded_by)):
        return False
    return True


def event_hits(con: duckdb.DuckDBPyConnection, cat: Catalogue) -> list[Hit]:
    """Every exception rule's hits on the ``fatal_events`` rows: one hit at the event's
    ``exc_line`` (the line that shows the failure), its body the event's lines."""
    rules = [r for r in cat.rules if r.exception is not None]
    if not rules:
        return []
    driver = set(cat.causality.driver_actors)
    out: list[Hit] = []
    # a big run raises the same exception on many ranks: the matchers' verdicts on an
    # event's content (what event_matches reads, but preceded_by) are made once per content
    verdicts: dict[tuple, dict[int, bool]] = {}

    def tried(r: Rule, e: dict) -> bool:
        if r.generic and e["level"] in QUIET_LEVELS and e["went_on"]:
            return False  # logged, and its process logged more: not an exception that ended anything
        return not (e["wrapper"] in SURVIVED and r.role in ("cause", "fallback") and e["wrapper"] not in r.exception.wrapper)

    def holds(r: Rule, e: dict, fields: EventFields, known: dict[int, bool]) -> bool:
        """Every field of the rule's matcher but preceded_by holds (event_matches asks it last)."""
        ok = known.get(id(r))
        if ok is None:
            ok = known[id(r)] = event_matches(r.exception, e, lambda rx: True, fields)
        return ok

    for page in _events(con, cat.causality.teardown_records):
        if len(verdicts) > MATCH_KEYS_KEPT:
            verdicts.clear()  # bounded: the keys hold each event's frames
        keyed = []
        for e in page:
            fields = event_fields(e)
            keyed.append((e, fields, verdicts.setdefault(_match_key(e, fields), {})))
        # preceded_by, for the events whose other fields hold: one query per regex and page
        asked: dict[str, list[int]] = defaultdict(list)
        for n, (e, fields, known) in enumerate(keyed):
            for r in rules:
                if r.exception.preceded_by and tried(r, e) and holds(r, e, fields, known):
                    asked[r.exception.preceded_by].append(n)
        answered = {rx: _preceded(con, [(n, keyed[n][0]) for n in ns], rx) for rx, ns in asked.items()}
        for n, (e, fields, known) in enumerate(keyed):
            for r in rules:
                if not tried(r, e) or not holds(r, e, fields, known):
                    continue
                if r.exception.preceded_by and n not in answered[r.exception.preceded_by]:
                    continue
                out.append(_event_hit(con, r, e, driver, cat.relayed_ranks))
            out += _raised_hits(cat, e)
            if out and out[-1].event is e:
                # what later stages read of a matched event on its hits: its key and where it was
                # raised (the root cause's whole row, frames and chain, is read again by
                # incident.fatal_event_of); a big run has thousands of matched events
                slim = {k: e[k] for k in EVENT_KEPT}
                for h in reversed(out):
                    if h.event is not e:
                        break
                    h.event = slim
    return out


PRECEDED_LINES = 200  # how far above an event preceded_by looks


def _preceded(con: duckdb.DuckDBPyConnection, events: list[tuple[int, dict]], rx: str) -> set[int]:
    """Of the numbered ``events``, those with a line matching ``rx`` among the
    PRECEDED_LINES lines of their file just above them: one query for all."""
    ns, fids, lns = zip(*((n, e["file_id"], e["line_no"]) for n, e in events))
    rows = con.execute(
        f"""WITH e AS (SELECT unnest($ns) AS n, unnest($fids) AS file_id, unnest($lns) AS line_no),
                 l AS (SELECT file_id, line_no FROM lines
                       WHERE file_id IN (SELECT file_id FROM e) AND regexp_matches(message, $rx))
            SELECT DISTINCT e.n FROM e JOIN l ON l.file_id = e.file_id
                AND l.line_no BETWEEN greatest(1, e.line_no - {PRECEDED_LINES}) AND e.line_no - 1""",
        {"ns": list(ns), "fids": list(fids), "lns": list(lns), "rx": rx}).fetchall()
    return {n for (n,) in rows}


def _event_hit(con: duckdb.DuckDBPyConnection, r: Rule, e: dict, driver: set[str], relayed: Iterable[str] = ()) -> Hit:
    """The hit of rule ``r`` on the fatal event ``e``. ``relayed``: the catalogue's
    ``relayed_ranks`` (the rank a report of another rank's failure names)."""
    h = Hit(rule=r, file_id=e["file_id"], path=e["path"], fmt=e["format"], line_no=e["exc_line"], ts=e["ts"],
            ts_quality=e["ts_quality"], level=e["level"], header=e["header"], actor=e["l_actor"], pid=e["l_pid"],
            node=e["l_node"], rank=e["l_rank"], event_line=e["line_no"], message=e["l_message"] or "",
            file_pid=e["file_pid"], text=nccl_text(e["header"], e["l_text"]))
    cited = _matched_frame_line(r.exception, e)
    if cited is not None and cited != h.line_no:
        h.line_no = cited  # no exception line: the frame that says what failed
        row = con.execute("SELECT message, text FROM lines WHERE file_id = ? AND line_no = ?", [e["file_id"], cited]).fetchone()
        if row:
            h.message, h.text = row[0] or "", nccl_text(h.header, row[1])
    h.event = e
    if e["exc_type"]:
        h.groups["exc"] = e["exc_type"]  # the root exception, not the wrapper its line may show
    if e["ray_pid"] is not None and e["ray_actor"] not in driver:
        h.task_pid = e["ray_pid"]  # the worker whose task failed, whoever printed the wrapper
    extract(h, extra="\n".join(x for x in (e["message"], e["outer_message"]) if x))
    if "ranks" not in h.groups:
        named = relayed_ranks(relayed, (e["head_message"], e["message"], e["outer_message"]))
        if named is not None:
            h.groups["ranks"] = str(named)  # placement reads it as the rank the text names
    return h


def relayed_ranks(patterns: Iterable[str], texts: Iterable[str | None]) -> int | None:
    """The one rank that the ``relayed_ranks`` patterns find named in ``texts`` (a report
    of another rank's failure), or None (none, or several ranks)."""
    ranks = {int(x) for p in patterns for t in texts if t for m in _rx(p).finditer(t) for x in re.findall(r"\d+", m["ranks"])}
    return ranks.pop() if len(ranks) == 1 else None


MATCH_KEYS_KEPT = 20_000  # distinct event contents whose verdicts event_hits keeps at a time


def _match_key(e: dict, fields: EventFields) -> tuple:
    """Everything :func:`event_matches` reads of the event ``e`` but ``preceded_by``: two
    events with the same key meet the same matchers."""
    return (tuple(fields.types), tuple(fields.names), tuple(fields.messages), tuple(fields.frames),
            e.get("package"), e.get("kind"), e.get("signal"), e.get("wrapper"), e.get("ray_method"),
            e.get("ray_actor"), e.get("actor"))


# the fields of a fatal event its hits keep (``Hit.event``)
EVENT_KEPT = ("file_id", "line_no", "exc_line", "kind", "exc_type", "wrapper", "package", "user_frame")


EVENT_PAGE = 5_000  # fatal events fetched at a time, as Python rows (frames and chains are lists of dicts)


def _event_pages(con: duckdb.DuckDBPyConnection) -> list[tuple[int, int]]:
    """Ranges of file ids holding about EVENT_PAGE fatal events each (a file's events stay
    in one range), in file order."""
    pages: list[tuple[int, int]] = []
    lo, n = None, 0
    for fid, count in con.execute("SELECT file_id, count(*) FROM fatal_events GROUP BY file_id ORDER BY file_id").fetchall():
        lo = fid if lo is None else lo
        n += count
        if n >= EVENT_PAGE:
            pages.append((lo, fid))
            lo, n = None, 0
    if lo is not None:
        pages.append((lo, fid))
    return pages


def _events(con: duckdb.DuckDBPyConnection, teardown_records: tuple[str, ...] = ()) -> Iterator[list[dict]]:
    """The fatal events with what the matchers read of their exception line and process, in
    (file, line) order, one dict each, a list per range of files (:func:`_event_pages`: a
    big run has hundreds of thousands, frames and chains included). Each range is fetched
    whole before it is handed out: the caller queries ``con`` meanwhile, which would end a
    result still being fetched."""
    cols = ", ".join(f"e.{c}" for c in EVENT_COLUMNS)
    # a launcher's records of tearing its children down (DeepSpeed's `Killing subprocess N`,
    # torchrun's `Sending process N closing signal`) follow the exception that ended the run:
    # they are not the process going on after it
    teardown = "|".join(f"(?:{p})" for p in teardown_records)
    not_teardown = "AND NOT regexp_matches(coalesce(message, ''), $teardown)" if teardown else ""
    params = {"teardown": teardown} if teardown else {}
    for lo, hi in _event_pages(con):
        cur = con.execute(
            f"""SELECT {cols}, f.path, f.format, f.pid AS file_pid, l.ts, l.ts_quality, l.level, l.header, l.actor AS l_actor,
                       l.pid AS l_pid, l.node AS l_node, l.rank AS l_rank, l.message AS l_message, l.text AS l_text,
                       hl.message AS head_message, coalesce(w.last_record > e.last_line, false) AS went_on
                FROM fatal_events e JOIN files f USING (file_id)
                LEFT JOIN lines l ON l.file_id = e.file_id AND l.line_no = e.exc_line
                LEFT JOIN lines hl ON hl.file_id = e.file_id AND hl.line_no = e.line_no AND hl.file_id BETWEEN $lo AND $hi
                -- the last log record its process wrote in the file (a line with a header of its
                -- own, outside any event): did the process go on after the exception?
                LEFT JOIN (SELECT file_id, pid, max(line_no) AS last_record FROM lines
                           WHERE header IS NOT NULL AND event_line IS NULL AND file_id BETWEEN $lo AND $hi {not_teardown}
                             AND file_id IN (SELECT file_id FROM fatal_events)
                           GROUP BY ALL) w ON w.file_id = e.file_id AND w.pid IS NOT DISTINCT FROM l.pid
                WHERE e.file_id BETWEEN $lo AND $hi
                ORDER BY e.file_id, e.line_no""", {"lo": lo, "hi": hi, **params})
        names = [d[0] for d in cur.description]
        yield [dict(zip(names, row)) for row in cur.fetchall()]


def _matched_frame_line(m: ExceptionMatch, e: dict) -> int | None:
    """For a traceback cut off before its exception line, the line of the first frame (or
    its source line) that the matcher's ``frames`` pattern names: what says what failed.
    Not when the event has a line that states the failure (a Ray task's failure header,
    `Scheduler hit an exception: ...`): that line is cited."""
    if not e["cut_off"] or not m.frames:
        return None
    frame_lines = {x for f in e.get("frames") or [] for x in (f.get("at"), f.get("code_at")) if x is not None}
    if e["exc_line"] not in frame_lines:
        return None
    for f in e.get("frames") or []:
        if re.search(m.frames, f"{f.get('file')}:{f.get('function')}") and f.get("at") is not None:
            return f["at"]
        if f.get("code") and re.search(m.frames, f["code"]) and f.get("code_at") is not None:
            return f["code_at"]
    return None


def _raised_hits(cat: Catalogue, e: dict) -> list[Hit]:
    """A traceback cut off before its exception line, whose innermost frame shows a
    ``raise X("...")``: the line rules read ``X: ...`` as the exception line the text lost."""
    if not e["cut_off"] or e["exc_type"] in (None, "unknown") or not e["message"]:
        return []
    text = f"{e['exc_type']}: {e['message']}"
    out = []
    for r in cat.rules:
        if not r.patterns or r.role not in ("cause", "fallback", "symptom"):
            continue
        if any(re.search(p, text) for p in r.patterns) and not any(re.search(p, text) for p in r.negative):
            h = Hit(rule=r, file_id=e["file_id"], path=e["path"], fmt=e["format"], line_no=e["exc_line"], ts=e["ts"],
                    ts_quality=e["ts_quality"], level=e["level"], header=e["header"], actor=e["l_actor"], pid=e["l_pid"],
                    node=e["l_node"], rank=e["l_rank"], event_line=e["line_no"], message=text, file_pid=e["file_pid"],
                    text=nccl_text(e["header"], e["l_text"]), line_message=e["l_message"])
            h.event = e
            extract(h)
            out.append(h)
    return out


def survived_events(con: duckdb.DuckDBPyConnection) -> set[tuple[int, int]]:
    """(file_id, first line) of the fatal events Python reported and went on from."""
    return set(con.execute(
        f"SELECT file_id, line_no FROM fatal_events WHERE wrapper IN ({', '.join(sql_str(w) for w in SURVIVED)})").fetchall())


def drop_survived(hits: list[Hit], survived: set[tuple[int, int]]) -> list[Hit]:
    """A line rule's cause or fallback on a line of such an event is no failure either (an
    engine's __del__ failing at interpreter exit)."""
    return [h for h in hits if h.rule.role not in ("cause", "fallback") or h.event_line is None
            or (h.file_id, h.event_line) not in survived or (h.rule.exception is not None and h.event is not None)]


def drop_explained_generic(hits: list[Hit]) -> list[Hit]:
    """A generic hit (an exception no class describes, a wrapper) gives way to a specific
    rule that matched the same event or line: the event is explained."""
    roles = ("cause", "fallback", "symptom", "stop", "finding")

    def key(h: Hit) -> tuple:
        return (h.file_id, h.event_line if h.event_line is not None else h.line_no)

    explained = {key(h) for h in hits if not h.rule.generic and h.rule.role in roles}
    return [h for h in hits if not (h.rule.generic and h.rule.role == "cause") or key(h) not in explained]
