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
from dataclasses import dataclass
from typing import Iterable

import duckdb

from .. import catalogue as sig
from .. import detectors
from ..catalogue import Catalogue
from ..database import RunRow, SettingError, attach_parts, connect, diagnosable_runs, pick_run, restrict_to_run, set_memory_limit
from . import explain, incident, matching, placement, selection, times
from .context import Context
from .explain import render as render_one
from .facts import RunConfig, RunFacts
from .model import FAILED, HEALTHY, INCOMPLETE, Diagnosis, Event, Evidence, Finding, Hit, RootCause

__all__ = ["diagnose", "headline", "render", "RunDiagnoses", "Diagnosis", "RootCause", "Evidence", "Finding", "NothingToDiagnose",
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
             performance: bool = True, context: int = 0, run: str | None = None) -> "Diagnosis | RunDiagnoses":
    """Diagnose the run(s) in the database ``db`` (or the open connection ``con``).
    ``performance``: also compute the performance findings (stragglers, slow sync, ...).
    ``context``: give each root cause's first evidence line the ``context`` lines of its
    file before and after it. ``run``: the run to diagnose (id or name, ``store.pick_run``).

    A database with one run gives its :class:`Diagnosis`; one with several runs (table
    ``runs``) gives a :class:`RunDiagnoses`, each run diagnosed on its own over its own
    files, unless ``run`` picks one."""
    t0 = time.perf_counter()
    cat = catalogue or sig.load(signature_dirs)
    own = con is None
    if own:
        if db is None or not os.path.exists(db):
            raise FileNotFoundError(f"no database at {db}: run `forensics ingest PATH --db {db}` first")
        con = connect(str(db), read_only=True)
        attach_parts(con)  # a database of views over parts on object storage
        con.execute("SET enable_progress_bar = false")  # the CLI prints its own output
        try:
            set_memory_limit(con)
        except SettingError:
            con.close()
            raise
    try:
        runs = diagnosable_runs(con)
        if run is not None:
            picked = pick_run(runs, run)
            result = _diagnose_run(con, cat, performance, context, picked.run_id if len(runs) > 1 else None)
        elif len(runs) <= 1:
            result = _diagnose_run(con, cat, performance, context, None)
        else:
            result = RunDiagnoses([])
            for r in runs:
                try:
                    result.runs.append((r, _diagnose_run(con, cat, performance, context, r.run_id), None))
                except NothingToDiagnose as exc:
                    result.runs.append((r, None, str(exc)))
    finally:
        if own:
            con.close()
    result.seconds = time.perf_counter() - t0
    result.rules = len(cat.rules)
    return result


def _diagnose_run(con: duckdb.DuckDBPyConnection, cat: Catalogue, performance: bool, context: int,
                  run_id: int | None) -> Diagnosis:
    """One run's diagnosis: over the files of ``run_id`` only (None: the whole database)."""
    if run_id is not None:
        restrict_to_run(con, run_id)
    try:
        d = run(Context(con, cat, performance))
        if context > 0:
            explain.add_context(con, d, context)
        return d
    finally:
        if run_id is not None:
            restrict_to_run(con, None)


@dataclass
class RunDiagnoses:
    """The diagnoses of a database that holds several runs: (run, its diagnosis or None,
    why there is none), in the order of ``runs.run_id``."""

    runs: list[tuple[RunRow, Diagnosis | None, str | None]]
    seconds: float = 0.0
    rules: int = 0

    def to_dict(self) -> dict:
        """``{"runs": [{"run": name, "run_id": id, "root": PATH, <the one-run object>}, ...]}``;
        a run with nothing to diagnose has ``"verdict": null`` and ``"error"``."""
        out = []
        for r, d, why in self.runs:
            head = {"run": r.name, "run_id": r.run_id, "root": r.root}
            out.append({**head, **d.to_dict()} if d is not None else {**head, "verdict": None, "error": why})
        return {"runs": out}

    def headline(self) -> str:
        """One line per run under a first line that counts them."""
        lines = [f"{len(self.runs)} runs (diagnose --run NAME for one)"]
        for r, d, why in self.runs:
            lines.append(f"  {r.name}: {d.headline() if d is not None else 'nothing to diagnose (' + str(why) + ')'}")
        return "\n".join(lines)


def render(d: "Diagnosis | RunDiagnoses", verbose: bool = False) -> str:
    """The readable report of ``forensics diagnose``: one block per run when there are several."""
    if not isinstance(d, RunDiagnoses):
        return render_one(d, verbose=verbose)
    blocks = []
    for r, one, why in d.runs:
        title = f"== run {r.name} (--run {r.run_id}; {r.files} file(s) from {r.root}) =="
        blocks.append(title + "\n" + (render_one(one, verbose=verbose) if one is not None else f"nothing to diagnose: {why}"))
    return f"{len(d.runs)} runs in the database, each diagnosed on its own\n\n" + "\n\n".join(blocks)


def headline(db_path: str | os.PathLike) -> str:
    """One line: the verdict, the root cause with its rank/phase and the evidence line."""
    try:
        return diagnose(db_path, performance=False).headline()
    except NothingToDiagnose as exc:
        return f"nothing to diagnose ({exc})"


def run(ctx: Context) -> Diagnosis:
    """The stages, in order, on one connection; the performance findings (which read the
    phase views only) on a second one at the same time (:class:`.explain.PendingFindings`)."""
    con = ctx.con
    if not con.execute("SELECT EXISTS (SELECT 1 FROM lines) OR EXISTS (SELECT 1 FROM metrics)").fetchall()[0][0]:
        raise NothingToDiagnose("the database holds no log lines and no metrics: ingest the run's logs first")
    ensure_views(con)
    pending = explain.PendingFindings.start(con) if ctx.performance else None
    try:
        return _stages(ctx, pending)
    finally:
        if pending is not None:
            pending.close()


def _stages(ctx: Context, pending: "explain.PendingFindings | None") -> Diagnosis:
    """Matching to explanation (the module docstring's stages 1-6); ``pending``: the
    performance findings under way, None without them."""
    con = ctx.con
    hits = matching.line_hits(con, ctx.cat) + matching.event_hits(con, ctx.cat)
    hits = matching.drop_survived(hits, matching.survived_events(con))
    facts = RunFacts(con, ctx.cat)
    for h in hits:
        h.own_file = h.fmt in facts.format_facts.own_output
    placement.attach_task_pids(ctx, hits, facts)
    placement.attach_bodies(ctx, hits)
    times.attach_ts_hi(con, hits, lambda *a: placement.keyed_rows(ctx, *a))
    placement.place(ctx, hits, facts)
    hits = selection.resolve_classes(hits, facts.traits)
    alarms = detectors.run(con, ctx.cat.metric_detectors)
    notes: list[str] = []
    findings = explain.line_findings(ctx, hits) + (pending.result(notes) if pending is not None else [])
    choice = selection.choose(ctx, hits, alarms, facts)
    if choice.root is None:
        ends, stops = choice.ends, choice.stops
        end_hit = ends[-1] if ends else (stops[0] if stops else None)
        end_ev = times.evidence(con, end_hit) if end_hit is not None else None
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
