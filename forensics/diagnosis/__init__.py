"""Diagnosis: from matched signatures and metric trends to root cause, cascade and remediation.

Stages, one module each, every one reading the database through SQL and the catalogue
(``forensics.catalogue``) for what it knows of failures:

1. :mod:`.matching` — which rules match which lines (inside DuckDB) and which fatal events
   (the ``fatal_events`` table): :class:`~.model.Hit` records;
2. :mod:`.facts` — what the run says about itself (pid -> rank/node, config, steps);
3. :mod:`.placement` — each hit's process, rank, node, phase, traceback and time interval;
4. :mod:`.selection` — hits grouped into events; the root cause chosen;
5. :mod:`.incident` — the root cause's rank/node/phase/step, evidence, symptoms;
6. :mod:`.explain` — notes, summary, cascade, remediation, findings and the text report.

The result is a :class:`~.model.Diagnosis`; ``to_dict()`` gives the ``forensics diagnose
--json`` shape of ``../shared/contract.md``.
"""
from __future__ import annotations

import os
import time
from typing import Iterable

import duckdb

from .. import catalogue as sig
from .. import detectors
from ..catalogue import Catalogue
from ..store import SettingError, attach_parts, set_memory_limit
from . import explain, incident, matching, placement, selection
from .context import Context
from .explain import render
from .facts import RunConfig, RunFacts
from .model import FAILED, HEALTHY, INCOMPLETE, Diagnosis, Event, Evidence, Finding, Hit, RootCause

__all__ = ["diagnose", "headline", "render", "Diagnosis", "RootCause", "Evidence", "Finding", "NothingToDiagnose",
           "ensure_views", "RunFacts", "RunConfig", "Hit", "Event"]


class NothingToDiagnose(ValueError):
    """The database holds no log lines and no metrics."""


DIAG_VIEWS = ("tracebacks", "ray_task_errors", "actor_deaths", "watchdog_timeouts", "watchdog_progress", "rank_pids")


def ensure_views(con: duckdb.DuckDBPyConnection) -> None:
    """Databases written by another forensics version lack the diagnosis views or hold old
    ones: the connection gets this version's as TEMP views (forensics/sql/diag_*.sql and
    what they depend on), whether it is read-only or not."""
    from .. import sql_modules

    sql_modules.ensure(con, DIAG_VIEWS)


def diagnose(db: str | os.PathLike | None = None, signature_dirs: Iterable[str] = (), *,
             con: duckdb.DuckDBPyConnection | None = None, catalogue: Catalogue | None = None,
             performance: bool = True, context: int = 0) -> Diagnosis:
    """Diagnose the run(s) in the database ``db`` (or the open connection ``con``).
    ``performance``: also compute the performance findings (stragglers, slow sync, ...).
    ``context``: give each root cause's first evidence line the ``context`` lines of its
    file before and after it."""
    t0 = time.perf_counter()
    cat = catalogue or sig.load(signature_dirs)
    own = con is None
    if own:
        if db is None or not os.path.exists(db):
            raise FileNotFoundError(f"no database at {db}: run `forensics ingest PATH --db {db}` first")
        con = duckdb.connect(str(db), read_only=True)
        attach_parts(con)  # a database of views over parts on object storage
        con.execute("SET enable_progress_bar = false")  # the CLI prints its own output
        try:
            set_memory_limit(con)
        except SettingError:
            con.close()
            raise
    try:
        d = run(Context(con, cat, performance))
        if context > 0:
            explain.add_context(con, d, context)
    finally:
        if own:
            con.close()
    d.seconds = time.perf_counter() - t0
    d.rules = len(cat.rules)
    return d


def headline(db_path: str | os.PathLike) -> str:
    """One line: the verdict, the root cause with its rank/phase and the evidence line."""
    try:
        return diagnose(db_path, performance=False).headline()
    except NothingToDiagnose as exc:
        return f"nothing to diagnose ({exc})"


def run(ctx: Context) -> Diagnosis:
    """The stages, in order, on one connection."""
    con = ctx.con
    if not con.execute("SELECT EXISTS (SELECT 1 FROM lines) OR EXISTS (SELECT 1 FROM metrics)").fetchall()[0][0]:
        raise NothingToDiagnose("the database holds no log lines and no metrics: ingest the run's logs first")
    ensure_views(con)
    hits = matching.line_hits(con, ctx.cat) + matching.event_hits(con, ctx.cat)
    hits = matching.drop_survived(hits, matching.survived_events(con))
    facts = RunFacts(con, ctx.cat)
    placement.attach_task_pids(ctx, hits)
    placement.attach_bodies(ctx, hits)
    placement.attach_ts_hi(ctx, hits)
    placement.place(ctx, hits, facts)
    hits = selection.resolve_classes(hits)
    alarms = detectors.run(con, ctx.cat.metric_detectors)
    notes: list[str] = []
    findings = explain.line_findings(ctx, hits) + (explain.performance_findings(ctx, notes) if ctx.performance else [])
    choice = selection.choose(ctx, hits, alarms, facts)
    if choice.root is None:
        ends, stops = choice.ends, choice.stops
        end_ev = (ends[-1].evidence() if ends else (stops[0].evidence() if stops else None))
        if not ends and not stops:
            last = f" at step {facts.max_step}" if facts.max_step is not None else ""
            notes.insert(0, f"no failure found; the logs stop{last} without an end-of-run marker (still running, or cut off)")
            return Diagnosis(INCOMPLETE, [], findings, notes=notes)
        if stops and not ends:
            notes.append("the run was stopped on purpose (SIGINT/SIGTERM) with no failure before it")
        return Diagnosis(HEALTHY, [], findings, notes=notes, end_evidence=end_ev)
    notes.extend(choice.notes)
    root = choice.root
    inc = incident.build(ctx, root, choice.causes, choice.fallbacks + choice.demoted, choice.symptoms, facts, hits)
    others = incident.alternatives(ctx, root, choice.causes or choice.demoted, inc)
    return Diagnosis(FAILED, [inc, *others], findings, notes=notes)
