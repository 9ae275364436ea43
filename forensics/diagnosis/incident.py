"""Stage 4: the incident — the root cause's rank, node, phase and step, its evidence,
the cascade it set off (its symptoms), and the other concrete causes seen beside it."""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from datetime import datetime

import duckdb

from . import explain, times
from .context import Context
from .facts import RunFacts, table_exists
from .model import Event, Evidence, Hit, RootCause, clip
from .selection import order_key


def build(ctx: Context, root: Event, causes: list[Event], fallbacks: list[Event], symptom_events: list[Event],
              facts: RunFacts, hits: list[Hit]) -> RootCause:
    origin = root.origin
    cls = root.cls
    derived_note = None
    derived_source = "missing_from_cascade"
    # a watchdog cascade in which exactly one rank of the world never timed out is a
    # rank that hung (or died silently) outside the collective
    missing = None
    derive = next((mr for mr in ctx.causality.missing_rank if root.role == "fallback" and cls == mr.source), None)
    if derive is not None:
        missing = missing_rank(ctx, hits, facts, derive.timeouts)
        if missing is not None:
            derived_note = (f"every rank but {missing} reported the collective timeout; rank {missing} never reached "
                            f"the collective (stuck outside it, or died without a trace)")
        else:
            missing = lagging_rank(ctx, root)
            if missing is None:
                missing = behind_by_counters(ctx)
            if missing is not None:
                derived_source = "lagging"
                derived_note = (f"rank {missing} never enqueued the collective the other ranks timed out in "
                                "(its watchdog counters / the desync analysis show it behind): it was stuck outside the collective")
        if missing is not None:
            cls = derive.becomes
    if derived_note:
        rank, rank_source = missing, derived_source
    else:
        rank, rank_source = root_rank(ctx, root, hits, facts, [*causes, *fallbacks])
    node = origin.node or next((h.node for h in root.hits if h.node), None)
    if node is None and rank is not None:
        node = next((facts.pid_node[p] for p, r in facts.pid_rank.items() if r == rank and p in facts.pid_node), None)
    phase = origin.phase or next((h.phase for h in root.hits if h.phase), None)
    if phase is None:  # other lines of the same failure (the killed worker, the driver's copy)
        phases = Counter(h.phase for e in [*causes, *fallbacks] if e.cls == cls for h in e.hits
                         if h.phase and h.phase_source in ("frames", "ray_task", "rule"))
        if phases:
            phase = phases.most_common(1)[0][0]
    if phase is None:  # the step phase the workers' failing Ray tasks were in
        run_phases = {ctx.phase_of(m) for m in facts.task_methods.values()} - {None}
        if len(run_phases) == 1:
            phase = run_phases.pop()
    step = origin.step
    if step is None:
        last = None
        for h in root.hits:
            s = facts.last_step_before(h)
            if s is not None:
                last = s if last is None else max(last, s)
        if last is not None and phase != "init":
            step = last + 1

    when = times.with_year(ctx.con, root.when, root.hits)  # the one estimate: evidence, notes, report
    evidence = evidence_lines(ctx, root, causes + fallbacks, cls, when)
    if derived_note:  # the lagging rank's own lines, when it printed any, come first
        own = sorted((h for h in hits if h.rank == rank and h.rule.role in ("fallback", "cause")),
                     key=lambda h: (h.ts or datetime.max, h.path, h.line_no or 0))
        if own:
            evidence = [times.evidence(ctx.con, own[0]), *[e for e in evidence if (e.file, e.line) != (own[0].path, own[0].line_no)]][:6]
    # symptoms: the other classes seen after the root
    root_keys = {id(h) for h in root.hits}
    sym_classes: list[str] = []
    cascade_hits: list[Hit] = []
    cascade_evts: list[Event] = []
    for e in [*fallbacks, *symptom_events, *causes]:
        if any(id(h) in root_keys for h in e.hits):
            continue
        if e.cls == cls and e.role != "fallback":
            continue
        if e.lo and root.lo and e.hi and e.hi < root.lo:
            continue  # clearly before the root: not its effect
        cascade_hits.extend(e.hits)
        cascade_evts.append(e)
        if e.role in ("fallback", "symptom") and any(h.rule.symptom for h in e.hits) and e.cls != cls and e.cls not in sym_classes:
            sym_classes.append(e.cls)
    info = ctx.cat.classes.get(cls)
    title = info.title if info else cls
    conf = confidence(ctx, root, cls, derived_note is not None)
    notes: list[str] = []
    if derived_note:
        notes.append(derived_note)
    if root.role == "fallback":
        notes.append("no concrete cause (OOM, crash, hardware, network, data error) was found before this; "
                     "it is reported as the root cause for lack of an earlier one")
    supported: set[str] = set()
    for h in hits:  # lines that support the reading (the interface NCCL chose, the ROCm platform, ...)
        if h.rule.role == "context" and h.cls == cls and h.rule.id not in supported and len(supported) < 3:
            supported.add(h.rule.id)
            notes.append(f"supporting: {h.rule.title or h.rule.id} ({h.path}:{h.line_no}: {clip(h.message, 120)})")
    notes.extend(explain.time_notes(ctx, root, origin, when))
    notes.extend(explain.missing_evidence_notes(ctx, cls, facts, root))
    summary = explain.summary(ctx, root, cls, rank, origin)
    cascade = explain.cascade(ctx, cascade_hits, cls, rank)
    remediation = explain.remediation(ctx, cls, root, phase, facts.config)
    return RootCause(id=cls, confidence=conf, rank=rank, node=node, phase=phase, step=step, evidence=evidence,
                     symptoms=sym_classes, remediation=remediation, title=title, summary=summary,
                     cascade=cascade, notes=notes, rank_source=rank_source, exception=exception_of(ctx, root),
                     cascade_events=explain.cascade_events(ctx, root, rank, cascade_evts, cls))


MAX_FRAMES = 10


def fatal_event_of(ctx: Context, root: Event) -> tuple[dict, str] | None:
    """The fatal event the root cause shows in (an exception rule's event, else the event
    whose lines hold the cited line), with the path of its file."""
    o = root.origin
    cols = ", ".join(("file_id", "line_no", "last_line", "exc_line", "kind", "exc_type", "message", "wrapper",
                      "wrapped_type", "frames", "package", "user_frame", "outer_type", "outer_message"))
    for h in [o, *root.hits]:
        if h.event is not None:  # its hits keep a few fields of the event (matching.EVENT_KEPT): the row
            rows = ctx.con.execute(f"SELECT {cols} FROM fatal_events WHERE file_id = ? AND line_no = ?",
                                   [h.event["file_id"], h.event["line_no"]]).fetchall()
            return (dict(zip(cols.split(", "), rows[0])) if rows else h.event), h.path
    if o.line_no is None:
        return None
    rows = ctx.con.execute(f"SELECT {cols} FROM fatal_events WHERE file_id = ? AND ? BETWEEN line_no AND last_line "
                           "ORDER BY line_no DESC LIMIT 1", [o.file_id, o.line_no]).fetchall()
    if not rows:
        return None
    return dict(zip(cols.split(", "), rows[0])), o.path


def exception_of(ctx: Context, root: Event) -> dict | None:
    """What ``diagnose -v`` shows of the root cause's traceback: type, message, how it was
    reported, where it was raised, and the frames that matter (the innermost ones and the
    code that is not a library's)."""
    found = fatal_event_of(ctx, root)
    if found is None:
        return None
    e, path = found
    frames = list(e.get("frames") or [])
    keep = {i for i in range(max(0, len(frames) - 6), len(frames))}
    keep |= {i for i, f in enumerate(frames) if f.get("package") == "user"}
    shown = [frames[i] for i in sorted(keep)][-MAX_FRAMES:]
    out = {
        "type": e.get("exc_type"), "message": (e.get("message") or "")[:600] or None,
        "wrapper": e.get("wrapper"), "wrapped_type": e.get("wrapped_type"),
        "raised_in": e.get("package"), "user_frame": e.get("user_frame"),
        "file": path, "line": e.get("exc_line"), "first_line": e.get("line_no"), "last_line": e.get("last_line"),
        "frames": [f"{f.get('file')}:{f.get('line')} in {f.get('function')} [{f.get('package')}]" for f in shown],
        "frames_left_out": len(frames) - len(shown),
    }
    if e.get("outer_type"):
        out["outer"] = f"{e['outer_type']}: {(e.get('outer_message') or '')[:200]}"
    return {k: v for k, v in out.items() if v not in (None, [], 0)}


def lagging_rank(ctx: Context, root: Event) -> int | None:
    """The one rank the desync analysis (``desync`` view, when present) finds behind the
    others in the timed-out group: it never enqueued the collective or a desync report
    named it."""
    if not table_exists(ctx.con, "desync"):
        return None
    try:
        rows = ctx.con.execute("SELECT DISTINCT rank FROM desync WHERE status = 'behind' AND rank IS NOT NULL").fetchall()
    except duckdb.Error as exc:
        if "does not exist" in str(exc) or "not found" in str(exc):
            return None
        raise
    behind = {r for (r,) in rows}
    timed_out = {h.rank for h in root.hits if h.rank is not None}
    if len(behind) == 1 and not behind & timed_out:
        return behind.pop()
    return None


def behind_by_counters(ctx: Context) -> int | None:
    """The one rank whose watchdog counters show it never enqueued the collective the
    others timed out in (``last enqueued NCCL work`` below that work's sequence number)."""
    rows = ctx.con.execute(
        "SELECT coalesce(pg, '0'), rank, work, last_enqueued FROM watchdog_progress WHERE rank IS NOT NULL AND work IS NOT NULL").fetchall()
    by_pg: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for pg, rank, work, enq in rows:
        by_pg[pg].append((rank, work, enq))
    behind: set[int] = set()
    for pg, items in by_pg.items():
        seq = Counter(w for _, w, _ in items).most_common(1)[0][0]
        lag = {r for r, _, enq in items if enq is not None and enq < seq}
        ok = {r for r, _, enq in items if enq is not None and enq >= seq}
        if lag and ok and not lag & ok:
            behind |= lag
    return behind.pop() if len(behind) == 1 else None


def timeout_rules(ctx: Context) -> set[str]:
    """The rules whose lines are collective timeouts (``causality``)."""
    return set(ctx.causality.collective_timeouts).union(*(mr.timeouts for mr in ctx.causality.missing_rank))


def missing_rank(ctx: Context, hits: list[Hit], facts: RunFacts, timeouts: tuple[str, ...] | set[str] | None = None) -> int | None:
    """The one rank of the world that is not among the ranks reporting a collective timeout."""
    world = facts.world_size()
    timeouts = timeout_rules(ctx) if timeouts is None else set(timeouts)
    timed_out = {h.rank for h in hits if h.rule.id in timeouts and h.rank is not None}
    if not world or not timed_out or len(timed_out) != world - 1 or max(timed_out) >= world:
        return None
    (missing,) = set(range(world)) - timed_out
    return missing


# a rank written into an exception's message: c10d's "[PG ID 0 PG GUID 0(default_pg) Rank 5]"
# (older: "[PG 0 Rank 5]"), "[Rank 5]", "[rank5]". A process group's prefix prints the rank in
# that group: only the default group's (id 0) is the global rank.
_RANK_IN_MESSAGE = re.compile(r"\[(?:PG (?:ID )?(?P<pg>\d+)\b[^\]]*?\b)?[Rr]ank[ _]?(?P<rank>\d+)\]")


def rank_in_exception(ctx: Context, root: Event) -> int | None:
    """The one global rank the root cause's exception message names (a C++ ``what()``
    carried into the Python exception names its process group's rank), or None."""
    found = fatal_event_of(ctx, root)
    if found is None:
        return None
    e, _ = found
    text = " ".join(filter(None, (e.get("message"), e.get("outer_message"))))
    ranks = {int(m["rank"]) for m in _RANK_IN_MESSAGE.finditer(text) if m["pg"] in (None, "0")}
    return ranks.pop() if len(ranks) == 1 else None


def root_rank(ctx: Context, root: Event, hits: list[Hit], facts: RunFacts, pool: list[Event]) -> tuple[int | None, str | None]:
    """The global rank of the root cause, from the most direct evidence available."""
    origin = root.origin
    ordered = [origin, *(h for h in root.hits if h is not origin)]
    for h in ordered:  # printed on the line or named in its text
        if h.rank is not None and h.rank_source in ("line", "text"):
            return h.rank, h.rank_source
    r = rank_in_exception(ctx, root)  # a rank the exception names ("[PG 3 Rank 5] Watchdog caught ...")
    if r is not None:
        return r, "text"
    for h in ordered:  # the nearest line of the same process that prints a rank
        r = facts.nearest_rank(h)
        if r is not None:
            return r, "same_process"
    for h in ordered:  # what the run says about the process elsewhere
        if h.rank is not None:
            return h.rank, h.rank_source
    # other lines of the same failure (the killed worker named by Ray, the driver's copy)
    same = {h.rank for e in pool if e.cls == root.cls and e is not root for h in e.hits if h.rank is not None}
    if len(same) == 1:
        return same.pop(), "same_failure"
    for h in ordered:  # torchrun's failure box names the child that failed first
        r = facts.first_failed_child(h)
        if r is not None:
            return r, "torchrun_summary"
    timeouts = timeout_rules(ctx)
    watchdog = [(h.rank, h.node) for h in hits if h.rule.id in timeouts and h.rank is not None]
    # the local device of an NCCL line, or the GPU index of an OOM message, on its node
    # (under Ray every worker sees its one GPU as device 0: only informative when the
    # run shows processes on other devices)
    for h in ordered:
        local = h.cuda_dev
        if local is None and h.groups.get("gpu", "").isdigit():
            local = int(h.groups["gpu"])
        gpn = facts.gpus_per_node()
        if local is not None and (gpn is None or local < gpn) and (local > 0 or facts.devices_vary):
            base = facts.node_base(h.node, watchdog)
            if base is not None:
                return base + local, "local_device"
    missing = missing_rank(ctx, hits, facts)
    procs = {h.proc for h in root.hits if h.proc is not None}
    if missing is not None and not any(p in facts.pid_rank for p in procs):
        return missing, "missing_from_cascade"
    for h in ordered:
        if h.proc is not None:
            r, source = facts.rank_by_pid_order(h.proc, h.node)
            if r is not None:
                return r, source
    return None, None


def confidence(ctx: Context, root: Event, cls: str, derived: bool) -> float:
    c = root.weight
    if root.role == "fallback":
        c = min(c + 0.1, 0.7)
    if len({h.path for h in root.hits}) > 1:
        c += 0.03
    if not root.precise_any and root.lo is None and root.role == "cause":
        c -= 0.05
    if derived:
        c = 0.6
    return max(0.05, min(0.99, c))


def evidence_lines(ctx: Context, root: Event, pool: list[Event], cls: str, when: "times.When | None" = None) -> list[Evidence]:
    """The root cause's evidence: its cited line first (with the event's time estimate ``when``), then
    other lines of it and of the same class, in other files first."""
    first = root.origin
    out = [first]
    seen_files = {first.path}
    rest = sorted((h for h in root.hits if h is not first), key=lambda h: (h.path, h.line_no or 0))
    # other lines of the same class (other ranks, the driver's final exception)
    for e in sorted((e for e in pool if e.cls == cls and e is not root), key=order_key):
        rest.extend(sorted(e.hits, key=lambda h: (h.path, h.line_no or 0)))
    for h in rest:
        if len(out) >= 6:
            break
        if h.path in seen_files and len(out) >= 3:
            continue
        if any(h.path == o.path and h.line_no == o.line_no for o in out):
            continue
        if h.reported is not None and any(h.reported == o.reported for o in out):
            continue  # the same collective's timeout again
        out.append(h)
        seen_files.add(h.path)
    ev = [times.evidence(ctx.con, h, when if h is first else None) for h in out]
    if first.alarm is not None:
        for p, ln in first.alarm.also[:3]:
            row = ctx.con.execute("SELECT l.message FROM lines l JOIN files f USING (file_id) WHERE f.path = ? AND l.line_no = ?",
                                   [p, ln]).fetchall()
            ev.append(Evidence(p, ln, row[0][0] if row else "", rule=first.rule.id))
    return ev


def alternatives(ctx: Context, root: Event, causes: list[Event], incident: RootCause) -> list[RootCause]:
    """Other concrete causes of a different class: listed after the root cause with a
    lower confidence (they may be consequences or a second, independent failure)."""
    out: list[RootCause] = []
    seen = {incident.id}
    for e in sorted(causes, key=order_key):
        if e is root or e.cls in seen:
            continue
        seen.add(e.cls)
        o = e.origin
        info = ctx.cat.classes.get(e.cls)
        out.append(RootCause(
            id=e.cls, confidence=max(0.05, min(0.5, e.weight * 0.5)), rank=e.rank, node=o.node, phase=o.phase,
            step=o.step, evidence=[times.evidence(ctx.con, o, e.when)], symptoms=[], remediation=[], title=info.title if info else e.cls,
            summary=explain.describe(o) or o.rule.title or e.cls,
            notes=["also seen; later than (or as early as) the root cause above"],
        ))
        if len(out) >= 3:
            break
    return out

