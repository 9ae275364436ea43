"""What a diagnosis is made of: the result it returns (``to_dict()`` is the ``forensics
diagnose --json`` object of ../shared/contract.md) and the records the stages pass along
(a :class:`Hit` is one rule matching one line or one fatal event; an :class:`Event` is one
failure seen through one or more hits)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from datetime import datetime, timedelta
from typing import Any, Iterable

from .. import detectors
from ..catalogue import Rule
from ..parsers.conventions import YEARLESS

# File formats that are a process's own output (not a copy on the driver), as their
# declarations say (parsers.base.Format.own_output): their lines are cited before a
# driver's prefixed copy of the same failure.
PRECISE = ("full", "year_inferred", "no_year")  # stamps printed on the line itself

# The verdicts of ../shared/contract.md (a labelled bundle's root cause is HEALTHY when no
# failure is expected).
FAILED, HEALTHY, INCOMPLETE = "failed", "healthy", "incomplete"


def clip(s: str, n: int) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 1] + "\u2026"


# -- result types -------------------------------------------------------------------------

@dataclass
class Evidence:
    file: str
    line: int | None
    text: str
    ts: str | None = None
    ts_quality: str | None = None
    rule: str | None = None
    context: list[tuple[int, str]] | None = None  # (line, text) around it, when asked for
    ts_hi: str | None = None  # a line without a stamp of its own: before this (times.When)
    when: str | None = None  # the time estimate in words ("between A and B", ...)
    year: str | None = None  # where the year comes from when not printed: inferred | file_mtime | unknown

    def to_dict(self) -> dict:
        d = {"file": self.file, "line": self.line, "text": self.text}
        if self.context:
            d["context"] = [{"line": n, "text": t} for n, t in self.context]
        if self.ts:
            d["ts"] = self.ts
        if self.ts_hi:
            d["ts_hi"] = self.ts_hi
        if self.when:
            d["when"] = self.when
        if self.year:
            d["year"] = self.year
        if self.ts_quality:
            d["ts_quality"] = self.ts_quality
        if self.rule:
            d["rule"] = self.rule
        return d


@dataclass
class RootCause:
    id: str
    confidence: float
    rank: int | None
    node: str | None
    phase: str | None
    step: int | None
    evidence: list[Evidence]
    symptoms: list[str]
    remediation: list[str]
    title: str = ""
    summary: str = ""
    cascade: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rank_source: str | None = None
    exception: dict | None = None  # the root cause's fatal event: type, message, wrapper, frames that matter
    # the root cause's event and the events of its cascade, one dict each (explain.cascade_events)
    cascade_events: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = {
            "id": self.id, "confidence": round(self.confidence, 2), "rank": self.rank, "node": self.node,
            "phase": self.phase, "step": self.step, "evidence": [e.to_dict() for e in self.evidence],
            "symptoms": self.symptoms, "remediation": self.remediation,
            "title": self.title, "summary": self.summary, "cascade": self.cascade, "notes": self.notes,
            "rank_source": self.rank_source,
        }
        if self.exception is not None:
            d["exception"] = self.exception
        if self.cascade_events:
            d["cascade_events"] = self.cascade_events
        return d


@dataclass
class Finding:
    id: str
    rank: int | None
    detail: str
    evidence: list[Evidence] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. phase, steps, value, source

    def to_dict(self) -> dict:
        d = {"id": self.id, "rank": self.rank, "detail": self.detail, **self.extra}
        if self.evidence:
            d["evidence"] = [e.to_dict() for e in self.evidence]
        return d


@dataclass
class Diagnosis:
    verdict: str  # FAILED | HEALTHY | INCOMPLETE (no failure, no end-of-run marker)
    root_causes: list[RootCause]
    findings: list[Finding]
    notes: list[str] = field(default_factory=list)
    end_evidence: Evidence | None = None  # what says a healthy run ended well
    seconds: float = 0.0
    rules: int = 0

    def to_dict(self) -> dict:
        d = {
            "verdict": self.verdict,
            "root_causes": [r.to_dict() for r in self.root_causes],
            "findings": [f.to_dict() for f in self.findings],
            "notes": self.notes,
        }
        if self.end_evidence is not None:
            d["end"] = self.end_evidence.to_dict()
        return d

    def headline(self) -> str:
        if self.verdict == HEALTHY:
            why = f" ({self.end_evidence.file}:{self.end_evidence.line}: {clip(self.end_evidence.text, 80)})" if self.end_evidence else ""
            return f"{HEALTHY}{why}"
        if not self.root_causes:  # incomplete
            return f"{self.verdict}: " + (self.notes[0] if self.notes else "no failure found and no end-of-run marker")
        r = self.root_causes[0]
        where = []
        if r.rank is not None:
            where.append(f"rank {r.rank}")
        if r.node:
            where.append(f"node {r.node}")
        if r.phase:
            where.append(f"phase {r.phase}")
        if r.step is not None:
            where.append(f"step {r.step}")
        ev = r.evidence[0] if r.evidence else None
        cite = f" — {ev.file}:{ev.line}: {clip(ev.text, 100)}" if ev else ""
        return f"failed: {r.id} ({r.confidence:.2f})" + (f" on {', '.join(where)}" if where else "") + cite


# -- time estimates (forensics.diagnosis.times uses them; here, where Event needs them) -----

# where the year of a time comes from
PRINTED, INFERRED, FILE_MTIME, UNKNOWN = "printed", "inferred", "file_mtime", "unknown"


@dataclass(frozen=True)
class When:
    lo: datetime | None  # at or after
    hi: datetime | None  # before (None: open)
    stamped: bool  # printed on the line (lo == hi)
    year: str = PRINTED

    def _fmt(self, t: datetime) -> str:
        return f"{t:%m-%d %H:%M:%S}" if self.year == UNKNOWN else f"{t:%Y-%m-%d %H:%M:%S}"

    def text(self) -> str | None:
        """The estimate in words: a time, ``between A and B``, ``at or after A``; None without one."""
        if self.lo is None:
            return f"before {self._fmt(self.hi)}" if self.hi is not None else None
        if self.stamped:
            return self._fmt(self.lo)
        if self.hi is not None and self._fmt(self.hi) == self._fmt(self.lo):
            return f"about {self._fmt(self.lo)}"
        if self.hi is not None:
            return f"between {self._fmt(self.lo)} and {self._fmt(self.hi)}"
        return f"at or after {self._fmt(self.lo)}"

    def year_note(self) -> str | None:
        return {INFERRED: "the year was inferred from other stamps of the run",
                FILE_MTIME: "the year was taken from the file's modification time",
                UNKNOWN: "the year is unknown (the run prints none and the file has no modification time)"}.get(self.year)

    def iso(self, t: datetime | None) -> str | None:
        if t is None:
            return None
        return f"{t:%m-%d %H:%M:%S.%f}" if self.year == UNKNOWN else t.isoformat(sep=" ")


def _placeholder(h: "Hit") -> bool:
    return h.ts is not None and h.ts.year == YEARLESS and h.ts_quality in ("no_year", "inherited")


def of_hits(hits: Iterable["Hit"]) -> When:
    """The estimate of one event from its hits (or of one line: a list of one)."""
    hits = list(hits)
    precise = [h for h in hits if h.precise]
    if precise:
        first = min(precise, key=lambda h: h.ts)
        year = INFERRED if first.ts_quality in ("year_inferred", "no_year") else PRINTED
        return When(first.ts, first.ts, True, year)
    inherited = [h for h in hits if h.ts is not None]
    his = [h.ts_hi for h in hits if h.ts_hi is not None]
    lo = max((h.ts for h in inherited), default=None)
    year = PRINTED if not any(_placeholder(h) for h in inherited) else INFERRED
    return When(lo, min(his) if his else None, False, year)


# -- internal records --------------------------------------------------------------------

# slots: a run with many failing files holds hundreds of thousands of hits at once, and a
# per-instance __dict__ cost about as much as the strings they carry
@dataclass(slots=True)
class Hit:
    rule: Rule
    file_id: int
    path: str
    fmt: str | None
    line_no: int | None
    ts: datetime | None
    ts_quality: str | None
    level: str | None
    header: str | None
    actor: str | None
    pid: int | None
    node: str | None
    rank: int | None
    event_line: int | None
    message: str
    file_pid: int | None = None
    text: str | None = None  # the raw line, of an NCCL line only (cuda_dev reads its header); None for others
    task_pid: int | None = None  # the worker named by the Ray task header this traceback is printed under
    groups: dict[str, str] = field(default_factory=dict)
    ts_hi: datetime | None = None
    body: str | None = None  # the traceback the line belongs to
    phase: str | None = None
    phase_source: str | None = None
    cls: str = ""
    rank_source: str | None = None
    step: int | None = None
    alarm: detectors.Alarm | None = None
    event: dict | None = None  # fields of the fatal_events row an exception rule matched (matching.EVENT_KEPT; None: a line rule's hit)
    line_message: str | None = None  # the physical line's message when ``message`` is a hard-wrapped line joined
    own_file: bool = False  # the file is one process's own output (its format's ``own_output``): cited first

    @property
    def proc(self) -> int | None:
        """The process the line is about (a killed pid named in the text wins)."""
        g = self.groups.get("pid")
        if g and g.isdigit():
            return int(g)
        if self.task_pid is not None:
            return self.task_pid
        return self.pid if self.pid is not None else self.file_pid

    @property
    def cuda_dev(self) -> int | None:
        """The local CUDA device of an NCCL line (``host:pid:tid [dev] NCCL ...``)."""
        if self.header != "nccl" or not self.text:
            return None
        m = re.search(r"[\w.\-]+:\d+:\d+ \[(\d+)\] ", self.text)
        return int(m.group(1)) if m else None

    @property
    def precise(self) -> bool:
        return self.ts is not None and self.ts_quality in PRECISE

    @property
    def reported(self) -> tuple | None:
        """What the line reports, when it names one collective of one rank (its rule, rank and
        SeqNum): a second line with the same (the watchdog's timeout repeated as its thread
        takes the process down) shows nothing new. None for other lines."""
        seq = self.groups.get("seq")
        return (self.rule.id, self.rank, seq) if seq else None

    def evidence(self) -> Evidence:
        shown = self.line_message if self.line_message is not None else self.message  # the physical line
        return Evidence(self.path, self.line_no, shown.strip() if shown else "",
                        ts=self.ts.isoformat(sep=" ") if self.ts else None, ts_quality=self.ts_quality, rule=self.rule.id)


@dataclass(eq=False)  # an event is itself: `e in events` must not compare every hit of every event
class Event:
    """One failure as seen through one or more files (copies of the same lines)."""

    cls: str
    hits: list[Hit]
    role: str

    @property
    def weight(self) -> float:
        return max(h.rule.weight for h in self.hits)

    @cached_property
    def when(self) -> "When":
        """The event's time estimate (:func:`of_hits`, the one source of it; its hits are
        placed, and their times known, before events are made)."""
        return of_hits(self.hits)

    @property
    def lo(self) -> datetime | None:
        return self.when.lo

    @property
    def hi(self) -> datetime | None:
        return self.when.hi

    @property
    def origin(self) -> Hit:
        """The line to cite: in the process's own file before a driver copy, the earliest
        line, unless a clearly more specific line of the same moment follows it."""
        def own(h: Hit) -> int:
            return 0 if (h.own_file or (h.file_pid is not None and h.file_pid == h.proc)) else 1
        best_own = min(own(h) for h in self.hits)
        pool = [h for h in self.hits if own(h) == best_own]
        first = min(pool, key=lambda h: (h.ts or datetime.max, h.path, h.line_no or 0))
        # a line of the same file above it that has no stamp of its own (an NCCL WARN before
        # the first stamped record) happened before it: a file is written in time order
        above = [h for h in pool if h.path == first.path and h.ts is None and (h.line_no or 0) < (first.line_no or 0)]
        if above:
            first = min(above, key=lambda h: h.line_no or 0)
        better = [h for h in pool if h.path == first.path and h.rule.weight >= first.rule.weight + 0.2
                  and (h.ts is None or first.ts is None or abs(h.ts - first.ts) <= timedelta(seconds=2))]
        return max(better, key=lambda h: h.rule.weight) if better else first

    @property
    def rank(self) -> int | None:
        for h in sorted(self.hits, key=lambda h: h.rank_source != "line"):
            if h.rank is not None:
                return h.rank
        return None

    @property
    def generic(self) -> bool:
        """Every line of it is a generic rule's (an exception no class describes, a wrapper)."""
        return all(h.rule.generic for h in self.hits)

    @property
    def precise_any(self) -> bool:
        return any(h.precise for h in self.hits)

