"""Stage 3: from placed hits to events, and the choice of the root cause.

Hits of one failure seen through several files (a worker's ``.err`` file and the driver's
prefixed copy) become one :class:`Event`. The root cause is the earliest concrete cause
(role ``cause``, or a metric-trend alarm); a ``generic`` cause (an exception no class
describes) only when no specific one is there; only when there is no cause at all does a
``fallback`` (watchdog timeout, actor death, ...) become the root. What relates one failure
to another (teardown after the first collective timeout, noise after the end of the run,
stalls, causes that give way to others) is data: the catalogue's ``causality`` section.
"""
from __future__ import annotations

import functools
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from .. import detectors
from ..catalogue import Rule
from .context import Context
from .facts import RunFacts
from .matching import drop_explained_generic
from .model import Event, Hit

ROLE_RANK = {"cause": 0, "fallback": 1, "symptom": 2, "stop": 3, "end": 4, "finding": 5, "context": 6}


def resolve_classes(hits: list[Hit], traits: set[str] = frozenset()) -> list[Hit]:
    """Apply event_context / requires / class_if_present / class_by_phase; drop hits
    whose conditions fail, and generic causes of events a specific rule explains. A line
    matched by rules of several roles keeps the strongest role only (an OOM line is not
    also a watchdog's symptom). ``traits``: what the run is made of (``run:ray``), which
    ``requires`` and ``class_if_present`` may name as they name rules."""
    kept: list[Hit] = []
    for h in hits:
        r = h.rule
        if r.event_context:
            text = h.body or h.message
            if not any(re.search(p, text) for p in r.event_context):
                continue
        kept.append(h)
    present = {h.rule.id for h in kept} | set(traits)
    out = []
    for h in kept:
        r = h.rule
        if r.requires and not any(x in present for x in r.requires):
            continue
        cls = None
        for rid, c in r.class_if_present.items():
            if rid in present:
                cls = c
                break
        if cls is None and h.phase and h.phase in r.class_by_phase:
            cls = r.class_by_phase[h.phase]
        h.cls = cls or r.class_by_phase.get("default") or r.cls
        out.append(h)
    out = one_class_per_event(drop_explained_generic(out))
    best: dict[tuple[int, int | None], int] = {}
    for h in out:
        if h.rule.role in ("cause", "fallback", "symptom"):
            k = (h.file_id, h.line_no)
            best[k] = min(best.get(k, 9), ROLE_RANK[h.rule.role])
    return [h for h in out if h.rule.role not in ("cause", "fallback", "symptom")
            or ROLE_RANK[h.rule.role] == best[(h.file_id, h.line_no)]]


def one_class_per_event(hits: list[Hit]) -> list[Hit]:
    """The causes matched on one fatal event (or one line) are one failure: it keeps the
    class of its most specific (heaviest) cause. A segfault whose stack runs through CUDA
    graph capture is a capture failure, not also a bare actor death."""
    def key(h: Hit) -> tuple:
        return (h.file_id, h.event_line if h.event_line is not None else h.line_no)

    best: dict[tuple, tuple[float, str]] = {}
    for h in hits:
        if h.rule.role == "cause" and not h.rule.generic:
            k = key(h)
            if k not in best or h.rule.weight > best[k][0]:
                best[k] = (h.rule.weight, h.cls)
    return [h for h in hits if h.rule.role != "cause" or key(h) not in best or h.cls == best[key(h)][1]]


def events(hits: list[Hit], role: str) -> list[Event]:
    """The hits of one role grouped into events: one per (class, process), else per
    (class, traceback), else per line."""
    groups: dict[tuple, list[Hit]] = defaultdict(list)
    for h in hits:
        if h.rule.role != role:
            continue
        if h.proc is not None:
            key = (h.cls, "pid", h.proc)
        elif h.event_line is not None:
            key = (h.cls, "tb", h.file_id, h.event_line)
        else:
            key = (h.cls, "line", h.file_id, h.line_no)
        groups[key].append(h)
    return [Event(cls=k[0], hits=v, role=role) for k, v in groups.items()]


def order_key(e: Event):
    """Earliest first. A stamp inherited from an earlier line is a lower bound: at an equal
    time the line that carries its own stamp comes first (and within one file, the earlier
    line). Metric alarms without a time are ordered by step."""
    # a line before any stamp of its file happened at or before the file's first stamp
    # (its upper bound): ordered there, behind the lines that carry that stamp
    lo = e.lo if e.lo is not None else e.hi
    o = e.origin
    return (lo is None, lo or datetime.max, not e.precise_any, o.step if o.step is not None else math.inf,
            -e.weight, o.path, o.line_no or 0)


def compare(a: Event, b: Event) -> int:
    """Earlier first (see :func:`order_key`); at the same time, file order decides within
    one file (the earlier line happened first), the more specific line across files."""
    ka, kb = order_key(a)[:4], order_key(b)[:4]
    oa, ob = a.origin, b.origin
    if ka[:2] == kb[:2] and oa.path == ob.path and oa.line_no != ob.line_no:
        return -1 if (oa.line_no or 0) < (ob.line_no or 0) else 1  # one file, one moment: the earlier line
    if ka != kb:
        return -1 if ka < kb else 1
    ra, rb = order_key(a)[4:], order_key(b)[4:]
    return (ra > rb) - (ra < rb)


def alarm_event(ctx: Context, a: detectors.Alarm) -> Event:
    """A metric-trend alarm as a cause event (its line is the metrics line of the step)."""
    rule = Rule(id=f"metric_{a.detector}", cls=a.cls, role="cause", patterns=(".",), keywords=(), keywords_ci=(),
                weight=a.weight, title=a.detail, phase="train")
    row = ctx.con.execute("SELECT message FROM lines WHERE file_id = ? AND line_no = ?", [a.file_id, a.line_no]).fetchall()
    h = Hit(rule=rule, file_id=a.file_id, path=a.path, fmt="metrics", line_no=a.line_no, ts=a.ts,
            ts_quality="step_time" if a.ts else None, level=None, header=None, actor=None, pid=None, node=None,
            rank=None, event_line=None, message=row[0][0] if row else a.detail, cls=a.cls, phase="train",
            phase_source="metrics", step=a.step, alarm=a)
    return Event(cls=a.cls, hits=[h], role="cause")


@dataclass
class Choice:
    """The outcome of selection: the root event (None: healthy), and the pools the
    incident is built from."""

    root: Event | None
    causes: list[Event]
    fallbacks: list[Event]
    demoted: list[Event]  # causes that came after the first collective timeout: its consequences
    symptoms: list[Event]  # symptom events, and events that gave way to another (causality.gives_way)
    ends: list[Hit]
    stops: list[Hit]
    notes: list[str] = field(default_factory=list)


def training_went_on(e: Event, facts: RunFacts) -> bool:
    """More training steps were logged after the event (in its file, or later in time)."""
    h = e.origin
    if facts.last_metric_line.get(h.file_id, 0) > (h.line_no or 0):
        return True
    return bool(e.hi and facts.step_times and facts.step_times[-1][1] > e.hi)


def fallback_tier(e: Event) -> float:
    return round(e.weight, 2)


def prefer_simultaneous(ctx: Context, root: Event, pool: list[Event]) -> Event:
    """Among events of the root's class within a moment of it (one failure printed as
    several lines, e.g. the kernel's "invoked oom-killer" then "Killed process"), cite the
    most specific one (highest weight); a stamped line before an unstamped one."""
    if root.lo is None:
        return root
    same = [e for e in pool if e.cls == root.cls and e.lo is not None and abs(e.lo - root.lo) <= ctx.same_moment
            and (e.precise_any or not root.precise_any) and e.weight >= root.weight + ctx.causality.clearly_more_specific]
    if not same:
        return root
    return min(same, key=lambda e: (-e.weight, e.lo, e.origin.path, e.origin.line_no or 0))


def stalled(ctx: Context, hits: list[Hit], root_cls: str) -> tuple[Hit, str, str] | None:
    """A process that began something a stall rule names and never finished it, when the
    root is a class that stall explains: (its first line, the class it becomes, the note)."""
    for st in ctx.causality.stalls:
        if root_cls not in st.explains:
            continue
        started: dict[int, Hit] = {}
        done: set[int] = set()
        for h in hits:
            if h.proc is None:
                continue
            if h.rule.id == st.started:
                started.setdefault(h.proc, h)
            elif h.rule.id == st.finished:
                done.add(h.proc)
        waiting = [h for p, h in started.items() if p not in done]
        if len(waiting) == 1:
            h = waiting[0]
            return h, st.becomes, st.note.format(path=h.path, line=h.line_no)
    return None


def waited(ctx: Context, hits: list[Hit], facts: RunFacts) -> tuple[Hit, str, str] | None:
    """The run's logs end while it waits (``causality.waits``): the first line of a wait
    rule, when no step was logged at or after it (the caller asks only when there is no
    failure, no end and no stop): (that line, the class it becomes, the note)."""
    for w in ctx.causality.waits:
        waiting = [h for h in hits if h.rule.id == w.rule]
        if not waiting:
            continue
        first = min(waiting, key=lambda h: (h.ts is None, h.ts or datetime.min, h.path, h.line_no or 0))
        if w.finished and _wait_ended(waiting, [h for h in hits if h.rule.id in w.finished]):
            continue
        if first.ts is None:
            progressed = bool(facts.step_times)  # no time to compare: any step logged counts as progress
        else:
            progressed = any(t is not None and t >= first.ts for _, t in facts.step_times)
        if not progressed:
            return first, w.becomes, w.note.format(path=first.path, line=first.line_no)
    return None


def _wait_ended(waiting: list[Hit], finished: list[Hit]) -> bool:
    """A line that says the wait ended comes after the last wait line: by time when both
    are stamped, else by position in the same file."""
    last = max(waiting, key=lambda h: (h.ts or datetime.min, h.path, h.line_no or 0))
    for f in finished:
        if f.ts is not None and last.ts is not None:
            if f.ts >= last.ts:
                return True
        elif f.path == last.path and (f.line_no or 0) > (last.line_no or 0):
            return True
    return False


def _explains(f: Event, e: Event, window_s: float) -> bool:
    """``f`` was seen before ``e`` (or within ``window_s`` after it): by time when both are
    stamped, else by position when they are in one file."""
    if f.lo is not None and e.lo is not None:
        return f.lo <= e.lo + timedelta(seconds=window_s)
    fo, eo = f.origin, e.origin
    return fo.path == eo.path and (fo.line_no or 0) <= (eo.line_no or 0)


def give_way(ctx: Context, pool: list[Event]) -> tuple[list[Event], list[Event]]:
    """Split ``pool`` into the events that stand and those that give way to another event
    of the pool (``causality.gives_way``)."""
    gave: list[Event] = []
    gone: set[Event] = set()  # the same events, for membership (an event is equal only to itself)
    for gw in ctx.causality.gives_way:
        for e in pool:
            if e.cls != gw.cls or e in gone:
                continue
            if any(f is not e and f not in gone and f.cls != e.cls and ("any" in gw.to or f.cls in gw.to)
                   and _explains(f, e, gw.window_s) for f in pool):
                gave.append(e)
                gone.add(e)
    return [e for e in pool if e not in gone], gave


def choose(ctx: Context, hits: list[Hit], alarms: list[detectors.Alarm], facts: RunFacts) -> Choice:
    """Sort the events into root, causes, fallbacks and symptoms."""
    causality = ctx.causality
    notes: list[str] = []
    ends = sorted((h for h in hits if h.rule.role == "end"), key=lambda h: (h.ts or datetime.min, h.path, h.line_no or 0))
    stops = sorted((h for h in hits if h.rule.role == "stop"), key=lambda h: (h.ts or datetime.max, h.path, h.line_no or 0))
    causes = events(hits, "cause")
    fallbacks = events(hits, "fallback")
    symptoms = events(hits, "symptom")
    causes += [alarm_event(ctx, a) for a in alarms]  # metric alarms are causes too

    # a generic exception after which training went on (more steps logged) was handled
    fallbacks = [e for e in fallbacks if e.weight > 0.3 or not training_went_on(e, facts)]
    causes = [e for e in causes if not (e.generic and training_went_on(e, facts))]
    standing, gave = give_way(ctx, causes + fallbacks)
    stand = set(standing)
    causes = [e for e in causes if e in stand]
    fallbacks = [e for e in fallbacks if e in stand]
    symptoms = symptoms + gave
    end_ts = max((h.ts for h in ends if h.ts is not None), default=None)
    stop_ts = stops[0].ts if stops else None
    noise = set(causality.shutdown_noise)
    if ends:
        # a run that reached its end: generic wrappers, fallbacks after the end and peers
        # dropping connections / actors exiting during shutdown are noise
        fallbacks = [e for e in fallbacks if not (end_ts and e.lo and e.lo >= end_ts) and e.weight > 0.3]
        causes = [e for e in causes if not (end_ts and e.lo and e.lo >= end_ts and e.cls in noise)]
    if stops:
        fallbacks = [e for e in fallbacks if not (stop_ts is None or e.lo is None or e.lo >= stop_ts - timedelta(seconds=5))]
        causes = [e for e in causes if not (stop_ts and e.lo and e.lo > stop_ts)]
    if not causes and not fallbacks and symptoms and not ends and not stops:
        # only consequences are visible (a DistBackendError, an aborted communicator): the
        # failure they follow from is the root, for lack of anything earlier
        fallbacks, symptoms = [Event(cls=e.cls, hits=e.hits, role="fallback") for e in symptoms], []
    if not causes and not fallbacks and not ends and not stops:
        wait = waited(ctx, hits, facts)
        if wait is not None:
            # nothing failed and nothing ended: the run was still waiting when its logs end
            h, becomes, note = wait
            h.cls = becomes
            fallbacks = [Event(cls=becomes, hits=[h], role="fallback")]
            notes.append(note)
    if not causes and not fallbacks:
        return Choice(None, [], [], [], symptoms, ends, stops, notes)

    # a concrete cause explains a collective timeout only if it could have come before it:
    # one that is stamped clearly after the first collective timeout is part of the teardown
    demoted: list[Event] = []
    timeouts = set(causality.collective_timeouts)
    first_timeout = min((h.ts for h in hits if h.rule.id in timeouts and h.precise), default=None)
    if first_timeout is not None:
        explaining = [e for e in causes if e.lo is None or e.lo <= first_timeout + ctx.same_moment]
        if not explaining and causes:
            notes.append("concrete errors were logged only after the first collective timeout "
                         f"({first_timeout:%Y-%m-%d %H:%M:%S}); they are treated as its consequences")
            demoted.extend(causes)
            causes = []
    if causes:
        causes.sort(key=functools.cmp_to_key(compare))
        # a generic cause (an exception no class describes) only when no specific one is seen
        pool = [e for e in causes if not e.generic] or causes
        root = prefer_simultaneous(ctx, pool[0], pool)
    else:
        fallbacks.sort(key=lambda e: (-fallback_tier(e), *order_key(e)))
        root = fallbacks[0]
        root = prefer_simultaneous(ctx, root, [e for e in fallbacks if fallback_tier(e) == fallback_tier(root)])
        stall = stalled(ctx, hits, root.cls)
        if stall is not None:
            # the others waited in a collective while this process never finished
            h, becomes, note = stall
            h.cls = becomes
            root = Event(cls=becomes, hits=[h], role="cause")
            notes.append(note)
    return Choice(root, causes, fallbacks, demoted, symptoms, ends, stops, notes)
