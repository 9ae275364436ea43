"""Stage 5: the explanation — notes on time and on missing evidence, the one-line summary,
the cascade, remediation that quotes the run's own config values, findings, and the
readable report of ``forensics diagnose``."""
from __future__ import annotations

import re
from collections import defaultdict
from datetime import datetime
from typing import Any

import duckdb

from ..catalogue import ConfigOverride, Remedy
from ..database import interruptible
from . import times
from .context import Context
from .facts import RunConfig, RunFacts
from .model import HEALTHY, INCOMPLETE, Diagnosis, Event, Evidence, Finding, Hit, clip


def time_notes(ctx: Context, root: Event, origin: Hit, when: "times.When") -> list[str]:
    """What to know of the root cause's time (``when``: its estimate, as its evidence shows it)."""
    if origin.alarm is not None:
        return []
    year = when.year_note()
    if when.stamped:
        return [f"the root cause's time is printed without a year; {year}"] if year else []
    if when.lo is not None or when.hi is not None:
        return [f"the root-cause line carries no timestamp of its own: it happened {when.text()} "
                "(times taken from neighbouring lines; the order was decided with that uncertainty)"
                + (f"; {year}" if year else "")]
    return ["the root-cause line has no timestamp and none could be inferred; the order of events was taken from file positions"]


def missing_evidence_notes(ctx: Context, cls: str, facts: RunFacts, root: Event) -> list[str]:
    """What evidence would have shown more (the catalogue's ``causality.evidence_notes``,
    then the class's debugging switches not already named)."""
    notes = []
    for n in ctx.causality.evidence_notes:
        if n.classes and cls not in n.classes:
            continue
        if all(_holds(cond, value, facts, root) for cond, value in n.when):
            notes.append(n.text.format(dedup_lines=facts.dedup_lines))
    info = ctx.cat.classes.get(cls)
    if info:
        for d in info.debug:
            names = set(re.findall(r"[A-Za-z_]+(?:[._=][A-Za-z_]+)+", d))
            if not any(name in n for n in notes for name in names):
                notes.append(d)
    return notes


def _holds(cond: str, value: Any, facts: RunFacts, root: Event) -> bool:
    """One condition of an evidence note (catalogue.NOTE_CONDITIONS) on the run's facts."""
    if cond == "no_nccl_lines":
        return (not facts.has_nccl_lines) == bool(value)
    if cond == "missing_format":
        return not facts.formats.get(value)
    if cond == "dedup_lines":
        return bool(facts.dedup_lines) == bool(value)
    if cond == "root_role":
        return root.role == value
    if cond == "config":
        return all(facts.config.get(k) == v and type(facts.config.get(k)) is type(v) for k, v in value.items())
    raise ValueError(f"unknown evidence-note condition {cond!r}")


def summary(ctx: Context, root: Event, cls: str, rank: int | None, origin: Hit) -> str:
    what = describe(origin) or origin.rule.title or cls
    who = f"rank {rank}" if rank is not None else (f"pid {origin.proc}" if origin.proc is not None else "the run")
    event = next((h.event for h in (origin, *root.hits) if h.event is not None), None)
    if event is not None:  # where it was raised: the innermost code that is not a library's
        if event.get("user_frame"):
            what += f" (in {event['user_frame']})"
        elif event.get("package") not in (None, "user", "python"):
            what += f" (raised in {event['package']})"
    return f"{who}: {what}"


def describe(h: Hit) -> str | None:
    tpl = h.rule.describe
    if not tpl:
        return None
    vals = dict(h.groups)
    for k, v in list(vals.items()):
        if k.endswith("_ms") and v.isdigit():
            vals[k[:-3] + "_s"] = f"{int(v) / 1000:g}"
    try:
        return tpl.format_map(defaultdict(lambda: "?", vals))
    except (ValueError, IndexError):
        return tpl


def cascade(ctx: Context, hits: list[Hit], cls: str, rank: int | None) -> list[str]:
    by_desc: dict[str, list[Hit]] = defaultdict(list)
    for h in hits:
        d = describe(h) or h.rule.title or h.rule.id
        by_desc[d].append(h)
    lines = []
    cause = f"{cls}" + (f" on rank {rank}" if rank is not None else "")
    ordered = sorted(by_desc.items(), key=lambda kv: min((h.ts or datetime.max) for h in kv[1]))
    for desc, hs in ordered[:12]:
        ranks = sorted({h.rank for h in hs if h.rank is not None})
        files = sorted({h.path for h in hs})
        who = (_ranks_text(ranks) if ranks else "driver" if all(h.fmt == "driver" for h in hs)
               else files[0] if len(files) == 1 else f"{len(files)} files")
        same = all(h.cls == cls for h in hs)
        lines.append(f"{who}: {desc}" + (" (the same failure seen by other processes)" if same else f" — caused by {cause}"))
    return lines


MAX_CASCADE_EVENTS = 200


def cascade_events(ctx: Context, root: Event, rank: int | None, events: list[Event], cls: str) -> list[dict]:
    """The root cause's event and the events of its cascade, earliest first, one dict each:
    ``class``, ``role`` (``root`` for the root cause, else the event's role), ``what`` (the
    rule's description of it), ``rank``, the line it cites (``file``, ``line``, ``text``),
    ``ts`` (the event's time as the diagnosis placed it: its earliest own stamp, else the
    latest stamp its lines inherited; None when unknown) and ``ts_precise`` (the time was
    printed on one of its lines). The times are the diagnosis' one estimate of each event
    (:mod:`.times`), never with the parsers' placeholder year. The report draws them per rank."""
    def one(e: Event, role: str, r: int | None) -> dict:
        o = e.origin
        shown = o.line_message if o.line_message is not None else o.message
        w = times.with_year(ctx.con, times.of_hits(e.hits), e.hits)
        lo = w.lo if w.year != times.UNKNOWN else None
        return {"class": e.cls, "role": role, "what": describe(o) or o.rule.title or o.rule.id, "rank": r,
                "file": o.path, "line": o.line_no, "text": clip(shown or "", 300),
                "ts": lo.isoformat(sep=" ") if lo else None, "ts_precise": e.precise_any}
    out = [one(root, "root", rank)]
    shown = {root.origin.reported} - {None}
    for e in sorted(events, key=lambda e: (e.lo is None, e.lo or datetime.max, e.origin.path, e.origin.line_no or 0)):
        if e.origin.reported is not None and e.origin.reported in shown:
            continue  # a line that repeats an earlier one's collective timeout
        shown.add(e.origin.reported)
        out.append(one(e, e.role, e.rank))
    return out[:MAX_CASCADE_EVENTS]


def remediation(ctx: Context, cls: str, root: Event, phase: str | None, config: RunConfig) -> list[str]:
    items: list[Remedy] = []
    for h in root.hits:
        for r in h.rule.remediation:
            if r not in items:
                items.append(r)
    info = ctx.cat.classes.get(cls)
    if info:
        items.extend(r for r in info.remediation if r not in items)
    out: list[str] = []
    keys: set[str] = set()
    for r in items:
        if r.key and r.key in keys:
            continue  # the rule's own advice on this key comes first
        text = _remedy_text(r, config, ctx.cat.config_overrides)
        if text and text not in out:
            out.append(text)
            if r.key:
                keys.add(r.key)
    return out[:8]


def performance_findings(con: duckdb.DuckDBPyConnection, notes: list[str]) -> list[Finding]:
    """Stragglers, slow weight sync, rollout long tail, step-time jumps
    (:mod:`forensics.findings`, over the phase-attribution views)."""
    try:
        from .. import findings as findings_mod
        from .. import phases as phases_mod
    except ImportError as exc:
        notes.append(f"performance findings unavailable: {exc}")
        return []
    try:
        phases_mod.attach(con)
        rows = findings_mod.findings(con)
    except (duckdb.Error, ValueError, KeyError, OSError) as exc:
        notes.append(f"performance findings unavailable: {exc.__class__.__name__}: {exc}")
        return []
    out = []
    for r in rows:
        r = dict(r)
        ev = [Evidence(e.get("file"), e.get("line"), e.get("text", "")) for e in r.pop("evidence", None) or []]
        out.append(Finding(str(r.pop("id")), r.pop("rank", None), str(r.pop("detail", "")), ev, r))
    return out


# Up to this many log lines the performance findings (the phase views materialised, then
# read) are computed on a connection of their own while the rest of the diagnosis runs; on
# a bigger database after it: the phase tables DuckDB holds and the hits the diagnosis holds
# in Python would otherwise add up (as the report's PARALLEL_DIAGNOSIS_MAX_LINES).
PARALLEL_FINDINGS_MAX_LINES = 1_000_000


def result_awake(future):
    """``future.result()``, waking up every fifth of a second: polars, once imported, handles
    SIGINT itself with SA_RESTART, and a wait with no end would sleep through Ctrl-C."""
    from concurrent.futures import TimeoutError as Pending

    while True:
        try:
            return future.result(timeout=0.2)
        except Pending:
            continue


class PendingFindings:
    """The performance findings of ``con``'s run, started by :meth:`start` and collected by
    :meth:`result`; :meth:`close` (always) ends the work and the connection it used."""

    def __init__(self, con: duckdb.DuckDBPyConnection):
        self.con = con
        self.notes: list[str] = []
        self._pool = self._future = self._cursor = None

    @classmethod
    def start(cls, con: duckdb.DuckDBPyConnection) -> "PendingFindings":
        p = cls(con)
        (n_lines,) = con.execute("SELECT count(*) FROM lines").fetchall()[0]
        if n_lines <= PARALLEL_FINDINGS_MAX_LINES:
            from concurrent.futures import ThreadPoolExecutor

            from ..database import restrict_to_run, restricted_run

            # a cursor has TEMP views and macros of its own: the same run, its own phase rules
            p._cursor = interruptible(con.cursor())
            run_id = restricted_run(con)
            if run_id is not None:
                restrict_to_run(p._cursor, run_id)
            p._cursor.execute("SET enable_progress_bar = false").fetchall()
            p._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forensics-findings")
            p._future = p._pool.submit(performance_findings, p._cursor, p.notes)
        return p

    def result(self, notes: list[str]) -> list[Finding]:
        """The findings (computed now when they were not started beside the diagnosis); the
        notes they left are added to ``notes``."""
        if self._future is None:
            out = performance_findings(self.con, self.notes)
        else:
            out = result_awake(self._future)
        notes.extend(self.notes)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._cursor is not None:
            self._cursor.close()
            self._cursor = None


def line_findings(ctx: Context, hits: list[Hit]) -> list[Finding]:
    by_id: dict[str, list[Hit]] = defaultdict(list)
    for h in hits:
        if h.rule.role == "finding":
            by_id[h.rule.finding or h.rule.id].append(h)
    out = []
    for fid, hs in by_id.items():
        hs.sort(key=lambda h: (h.ts or datetime.max, h.path, h.line_no or 0))
        ranks = {h.rank for h in hs if h.rank is not None}
        detail = (describe(hs[0]) or hs[0].rule.title or fid) + f" ({len(hs)} line(s))"
        out.append(Finding(fid, next(iter(ranks)) if len(ranks) == 1 else None, detail, [times.evidence(ctx.con, hs[0])]))
    return out


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    parts, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return "ranks " + ",".join(parts)


def _fmt_value(v: Any) -> str:
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _remedy_text(r: Remedy, config: RunConfig, overrides: list[ConfigOverride] = ()) -> str | None:
    why = f" ({r.why})" if r.why else ""
    if r.key is None:
        return r.text
    for o in overrides:  # an engine argument the run set makes the key act no more: advise the one that acts
        if o.key == r.key:
            got = config.engine_arg(o.engine, o.arg, o.config)
            if got is not None:
                return _override_text(r, o, got[0], got[1], config)
    cur = config.get(r.key) if config.has(r.key) else None
    suggestion = None
    if r.to is not None:
        suggestion = r.to
    elif r.scale is not None and isinstance(cur, (int, float)) and not isinstance(cur, bool):
        new = cur * r.scale
        if r.min is not None:
            new = max(new, r.min)
        if r.max is not None:
            new = min(new, r.max)
        suggestion = max(1, int(round(new))) if isinstance(cur, int) else round(new, 4)
    if config.has(r.key):
        if suggestion is not None and _fmt_value(suggestion) == _fmt_value(cur):
            return None  # already what we would suggest
        if suggestion is not None:
            return f"{r.key} is {_fmt_value(cur)} here; try {_fmt_value(suggestion)}{why}"
        return f"{r.key} is {_fmt_value(cur)} here{why}"
    if suggestion is not None:
        return f"{r.key}: try {_fmt_value(suggestion)}{why}"
    if r.scale is not None:
        direction = "lower" if r.scale < 1 else "raise"
        return f"{r.key}: {direction} it{why}"
    return f"{r.key}{why}" if why else r.key


def _override_text(r: Remedy, o: ConfigOverride, value: Any, where: str, config: RunConfig) -> str:
    """Advice on ``r.key`` turned into advice on the engine argument ``o.arg`` that overrides it."""
    cur = config.get(r.key) if config.has(r.key) else o.default
    if r.scale is not None:
        up = r.scale > 1
    elif r.to is not None and isinstance(r.to, (int, float)) and isinstance(cur, (int, float)):
        up = r.to > cur
    else:
        up = None

    def shown(v: Any) -> str:
        if o.unit == "bytes" and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 2**20:
            return f"{_fmt_value(v)} ({v / 2**30:.2f} GiB)" if v >= 2**30 else f"{_fmt_value(v)} ({v / 2**20:.0f} MiB)"
        return _fmt_value(v)

    head = f"{o.arg} is {shown(value)} here ({where}), which overrides {r.key}"
    why = f" ({o.why})" if o.why else (f" ({r.why})" if r.why else "")
    if up is None or not isinstance(value, (int, float)) or isinstance(value, bool):
        return f"{head}: change {o.arg}, not {r.key}{why}"
    new = value * (o.raise_scale if up else o.lower_scale)
    new = int(round(new)) if isinstance(value, int) else round(new, 4)
    return f"{head}: {'raise' if up else 'lower'} {o.arg}, not {r.key}; try {shown(new)}{why}"


def add_context(con: duckdb.DuckDBPyConnection, d: Diagnosis, n: int) -> None:
    """The ``n`` lines before and after each root cause's first evidence line (its file's
    physical lines, as stored: the text without the recognised prefixes)."""
    for rc in d.root_causes:
        if not rc.evidence or rc.evidence[0].line is None:
            continue
        e = rc.evidence[0]
        e.context = [(int(a), b or "") for a, b in con.execute(
            """SELECT l.line_no, l.text FROM lines l JOIN files f USING (file_id)
               WHERE f.path = ? AND l.line_no BETWEEN ? AND ? ORDER BY l.line_no""",
            [e.file, max(1, e.line - n), e.line + n]).fetchall()]


# -- text output ---------------------------------------------------------------------------

def render(d: Diagnosis, verbose: bool = False) -> str:
    """The readable report of ``forensics diagnose``."""
    lines: list[str] = []
    if d.verdict == INCOMPLETE:
        lines.append(f"verdict: {INCOMPLETE}")
    elif d.verdict == HEALTHY:
        lines.append("verdict: healthy")
        if d.end_evidence:
            e = d.end_evidence
            lines.append(f"  ended: {e.file}:{e.line}: {clip(e.text, 160)}")
    else:
        lines.append("verdict: failed")
        for i, r in enumerate(d.root_causes):
            label = "root cause" if i == 0 else "also"
            lines.append("")
            lines.append(f"{label}: {r.id} — {r.title} (confidence {r.confidence:.2f})")
            how = {"pid_order": "by pid order", "start_order": "by worker start order", "lowest_free_rank": "guessed",
                   "missing_from_cascade": "the rank missing from the timeouts", "lagging": "behind in the collectives",
                   "local_device": "from the local GPU index", "torchrun_summary": "from torchrun's failure summary",
                   "same_process": "from the process's other lines", "pid": "from the process's pid"}.get(r.rank_source or "")
            where = [(f"rank {r.rank}" + (f" ({how})" if how else "")) if r.rank is not None else "rank unknown",
                     f"node {r.node}" if r.node else None, f"phase {r.phase}" if r.phase else None,
                     f"step {r.step}" if r.step is not None else None]
            lines.append("  " + ", ".join(w for w in where if w))
            if r.summary:
                lines.append(f"  {r.summary}")
            for j, e in enumerate(r.evidence if (i == 0 or verbose) else r.evidence[:1]):
                shown_ts = e.when or e.ts
                year = {"file_mtime": "year from the file's modification time", "unknown": "year unknown",
                        "inferred": "year inferred"}.get(e.year or "")
                ts = f" [{shown_ts}{'' if e.ts_quality in (None, 'full') else ', ' + e.ts_quality}{', ' + year if year else ''}]" if shown_ts else ""
                lines.append(f"  {'evidence' if j == 0 else '        '}: {e.file}:{e.line}{ts}")
                if e.context:
                    for n, text in e.context:
                        lines.append(f"      {'>' if n == e.line else ' '} {n:>6} | {text if verbose else clip(text, 200)}")
                else:
                    lines.append(f"            {e.text if verbose else clip(e.text, 200)}")
            if verbose and r.exception:
                x = r.exception
                lines.append(f"  traceback: {x.get('file')}:{x.get('first_line')}-{x.get('last_line')}"
                             + (f" (reported through {x['wrapper']})" if x.get("wrapper") else ""))
                lines.append(f"    {x.get('type')}" + (f": {x['message']}" if x.get("message") else " (no message in the text)"))
                if x.get("outer"):
                    lines.append(f"    raised on as {x['outer']}")
                if x.get("frames_left_out"):
                    lines.append(f"    ... {x['frames_left_out']} outer frame(s) left out")
                for f in x.get("frames") or []:
                    lines.append(f"    at {f}")
            if r.symptoms:
                lines.append(f"  symptoms: {', '.join(r.symptoms)}")
            if r.cascade:
                lines.append("  cascade:")
                for c in r.cascade:
                    lines.append(f"    - {c}")
            if r.remediation:
                lines.append("  remediation:")
                for m in r.remediation:
                    lines.append(f"    - {m}")
            if r.notes and i == 0:
                lines.append("  notes:")
                for n in r.notes:
                    lines.append(f"    - {n}")
    if d.findings:
        lines.append("")
        lines.append("findings:")
        for f in d.findings:
            lines.append(f"  - {f.id}{'' if f.rank is None else f' (rank {f.rank})'}: {f.detail}")
    for n in d.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)
