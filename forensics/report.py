"""The post-mortem HTML report: one self-contained file (plotly.js inlined, no network).

Sections: the incident card (root cause, evidence lines with file:line, cascade, remediation),
performance findings, a per-rank timeline of phases (and GPU activity when profiler traces
exist) with a marker where each piece of evidence sits, stacked phase bars per step, training
metric plots with the failure step marked, and the inventory of ingested files.

Safety: every piece of text that comes from the logs is escaped. HTML is built here with
``html.escape``; plot data travels as JSON inside ``<script type="application/json">`` with
``<``, ``>`` and ``&`` written as ``\\u003c`` / ``\\u003e`` / ``\\u0026``; the page's own script
never assigns log text to ``innerHTML``; hover labels (which plotly renders as a subset of
HTML) get pre-escaped text.

Size: the timeline draws at most ``MAX_SEGMENTS`` spans one by one. Beyond that it becomes a
grid of ``GRID_BINS`` time bins per lane, each showing the phase that filled most of it (computed
in DuckDB, without fetching the spans), and the page says so, so runs with hundreds of thousands
of spans stay responsive.

Speed (bench/bench_report.py): the diagnosis runs on a second connection while the phase views
are materialised; in the page, the timeline (and any plot on the first screen) renders at once
and the plots further down when scrolled near.
"""
from __future__ import annotations

import html
import json
import math
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import polars as pl

from . import phases as ph
from .database import connect as db_connect
from .database import interruptible
from .store import (DB_MEMORY, REPORT_DB_MEMORY, NoSuchRun, attach_parts, diagnosable_runs, memory_limit, pick_run,
                    restrict_to_run, restricted_run, set_memory_limit)

MAX_SEGMENTS = 15_000  # spans drawn one by one on the timeline; beyond, a grid of time bins
EXACT_BARS = 3_000  # up to this many, each span is a hoverable bar; beyond, thin line segments
GRID_BINS = 2_000  # time bins per lane when the timeline is aggregated
MAX_STEP_BARS = 300  # steps drawn as stacked bars; more as a stacked area
# Up to this many log lines the diagnosis runs beside the phase views' materialisation; on a
# bigger database it runs first, on its own: the hits it holds in Python and the phase tables
# DuckDB holds would otherwise add up (bench/bench_memory.py: 1 GB of logs)
PARALLEL_DIAGNOSIS_MAX_LINES = 1_000_000
MAX_INVENTORY = 2_000
MAX_EVIDENCE = 40

PHASE_COLORS = {
    "rollout": "#4C78A8", "rollout/logprob": "#9ECAE9", "reward": "#B279A2", "train": "#F58518",
    "sync": "#E45756", "other": "#9D9D9D", "idle": "#E8E8E8", "gpu": "#54A24B", "nccl": "#8C564B",
}
PHASE_ORDER = ["rollout", "rollout/logprob", "reward", "train", "sync", "other", "idle"]

METRIC_PANELS = [
    ("loss", ["actor/pg_loss", "actor/loss", "actor/policy_loss", "train/loss", "loss"]),
    ("entropy", ["actor/entropy", "actor/entropy_loss", "entropy"]),
    ("grad norm", ["actor/grad_norm", "critic/grad_norm", "grad_norm"]),
    ("score", ["critic/score/mean", "critic/rewards/mean", "reward/mean", "score/mean"]),
    ("throughput", ["perf/throughput", "perf/tokens_per_second", "perf/tps"]),
]


def script_json(obj: Any) -> str:
    """JSON safe to place inside a <script> element: no `<`, `>`, `&`, U+2028/9 left raw."""
    text = json.dumps(_finite(obj), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _q(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None) -> pl.DataFrame:
    return pl.from_arrow(con.sql(sql, params=params).to_arrow_table())  # type: ignore[return-value]


@dataclass
class ReportResult:
    path: str
    bytes: int
    seconds: float
    spans: int  # phase spans and GPU intervals available
    segments: int  # bars drawn on the timeline
    aggregated: bool
    notes: list[str] = field(default_factory=list)


# -- diagnosis ------------------------------------------------------------------------------

def _diagnosis(con: duckdb.DuckDBPyConnection) -> tuple[dict | None, str | None]:
    """(diagnosis as the contract's dict, or None; a note when it is unavailable)."""
    try:
        from . import diagnose as dg
    except ImportError as exc:
        return None, f"diagnosis unavailable: forensics.diagnose cannot be imported ({exc})"
    try:
        # the report computes the performance findings itself, on the cached phase tables
        return dg.diagnose(con=con, performance=False).to_dict(), None
    except Exception as exc:  # the report must still show the timeline and files
        return None, f"diagnosis failed: {exc.__class__.__name__}: {exc}"


def _locate_evidence(con: duckdb.DuckDBPyConnection, items: list[dict]) -> list[dict]:
    """Add ts (µs since epoch), rank and ``ts_approx`` to evidence items.

    The time is the diagnosis' own estimate of the line (``ts``, and ``ts_hi`` for a line
    without a stamp of its own: forensics.diagnosis.times), so the page and ``forensics
    diagnose`` never disagree; a line without a stamp is drawn at the earliest time it can
    have happened and marked approximate. Items the diagnosis did not give (the error lines
    shown without one) take their line's stamp. The rank is the line's."""
    if not items:
        return []
    keys = pl.DataFrame({"i": list(range(len(items))), "path": [str(e.get("file")) for e in items],
                         "line_no": [e.get("line") for e in items]}, schema={"i": pl.Int64, "path": pl.String, "line_no": pl.Int64})
    con.register("_ev_keys", keys.to_arrow())
    try:
        found = _q(con, """
            SELECT k.i, l.rank, l.ts_quality = 'inherited' AS ts_approx, epoch_us(l.ts)::DOUBLE AS ts_us
            FROM _ev_keys k JOIN files f ON f.path = k.path
            JOIN lines l ON l.file_id = f.file_id AND l.line_no = k.line_no""")
    finally:
        con.unregister("_ev_keys")
    by_i = {r["i"]: r for r in found.iter_rows(named=True)}
    out = []
    for i, e in enumerate(items):
        r = by_i.get(i, {})
        ts_us, approx = r.get("ts_us"), bool(r.get("ts_approx"))
        if "ts" in e or "when" in e:  # the diagnosis' estimate
            ts_us, approx = _epoch_us(e.get("ts")), e.get("ts_quality") not in (None, "full", "year_inferred", "no_year")
        out.append({**e, "ts_us": ts_us, "ts_approx": approx,
                    "rank": r.get("rank") if r.get("rank") is not None else e.get("rank")})
    return out


def _epoch_us(ts: str | None) -> float | None:
    """µs since the epoch of a diagnosis time (``YYYY-MM-DD HH:MM:SS[.ffffff]``, UTC); None
    for a time without a year."""
    try:
        return datetime.fromisoformat(ts).replace(tzinfo=timezone.utc).timestamp() * 1e6 if ts else None
    except ValueError:
        return None


# -- timeline -------------------------------------------------------------------------------

def _lane_sql(rank: str, gpu: bool = False) -> str:
    """SQL for the lane name of a row, as the report writes it ('run', 'rank 3', 'rank 3 GPU')."""
    if gpu:
        return f"'rank ' || {rank} || ' GPU'"
    return f"CASE WHEN {rank} IS NULL THEN 'run' ELSE 'rank ' || {rank} END"


# How a span of a step known only from its timing metrics was placed (phase_timeline.placement)
PLACEMENT_TEXT = {
    "step start marker": "placement derived from durations: phases laid out from the step's start marker line by their timing metrics",
    "step line": "placement derived from durations: the step ends at its metric line's time stamp, phases laid out backwards by their timing metrics",
    "progress bar": "placement derived from durations: the step ends where the progress bar's elapsed time puts it, phases laid out backwards by their timing metrics",
    "step durations": "placement derived from durations: steps laid end to end by timing_s/step, phases laid out backwards by their timing metrics",
}

KIND_SQL = "CASE WHEN phase = 'rollout' AND sub_phase = 'logprob' THEN 'rollout/logprob' ELSE phase END"
GPU_KIND_SQL = "CASE WHEN is_nccl THEN 'nccl' ELSE 'gpu' END"


def _timeline_spans(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """Phase spans and GPU busy intervals, one frame: lane, kind, step, name, start_us, end_us,
    source, approximate."""
    spans = _q(con, f"""
        SELECT {_lane_sql('rank')} AS lane, {KIND_SQL} AS kind, step, name, start_us, end_us, source, approximate, placement
        FROM phase_timeline WHERE end_us > start_us""")
    gpu = _q(con, f"""SELECT {_lane_sql('rank', gpu=True)} AS lane, {GPU_KIND_SQL} AS kind, NULL::BIGINT AS step,
                             NULL::VARCHAR AS name, start_us, end_us, 'kineto' AS source, false AS approximate,
                             NULL::VARCHAR AS placement
                      FROM ({_gpu_lanes_sql(con, MAX_SEGMENTS // 2)})""")
    return pl.concat([spans, gpu], how="vertical_relaxed")


def _gpu_lanes_sql(con: duckdb.DuckDBPyConnection, budget: int, origin: float | None = None,
                   width: float | None = None) -> str:
    """A query of GPU activity per rank, compute and NCCL apart (rank, is_nccl, start_us, end_us).

    Given ``origin`` and ``width``: per time bin of that width, one bar from the bin's start as
    long as the GPU time of the events that start in the bin adds up to (at most the bin).
    Otherwise every event when there are at most ``budget``, else the same bars with bins as
    wide as keeps about ``budget`` of them."""
    if width is None:
        n, t0, t1, ranks = con.execute(
            "SELECT count(*), min(start_us), max(end_us), count(DISTINCT rank) FROM phase_gpu_events").fetchall()[0]
        if n <= budget:
            return "SELECT rank, is_nccl, start_us, end_us FROM phase_gpu_events WHERE end_us > start_us"
        origin, width = t0, max((t1 - t0) * 2 * max(ranks, 1) / budget, 1.0)
    o, w = repr(float(origin)), repr(float(width))  # literals: the query is pasted into others
    return f"""
        SELECT rank, is_nccl, {o} + bin * {w} AS start_us, {o} + bin * {w} + least(sum(end_us - start_us), {w}) AS end_us
        FROM (SELECT rank, is_nccl, start_us, end_us, floor((start_us - {o}) / {w}) AS bin FROM phase_gpu_events)
        GROUP BY rank, is_nccl, bin"""


def _grid(spans: pl.DataFrame | str, lanes: list[str], kinds: list[str], t0: float, t1: float, nbins: int,
          con: duckdb.DuckDBPyConnection | None = None) -> tuple[list[str], float]:
    """Cut the time axis into ``nbins`` bins; per lane and bin, the kind of span that fills most
    of the bin. ``spans``: a frame, or a query on ``con``, with lane, kind, start_us, end_us.
    Returns one string per lane, one character per bin (``.`` = nothing, ``a`` = ``kinds[0]``,
    ...), and the bin width in µs."""
    width = max((t1 - t0) / nbins, 1.0)
    own = con is None
    con = duckdb.connect() if own else con
    source = spans
    if isinstance(spans, pl.DataFrame):
        con.register("_report_grid_spans", spans.select("lane", "kind", "start_us", "end_us").to_arrow())
        source = "SELECT * FROM _report_grid_spans"
    try:
        # each span is cut at the bin edges it crosses; per lane and bin the kind with the
        # largest total overlap wins
        df = _q(con, f"""
            WITH s AS (
                SELECT lane, kind, start_us, end_us,
                       least(greatest(floor((start_us - $t0) / $w), 0), $last)::BIGINT AS b0,
                       least(greatest(floor((end_us - $t0) / $w), 0), $last)::BIGINT AS b1
                FROM ({source})
            ), cut AS (
                SELECT lane, kind, bin,
                       least(end_us, $t0 + (bin + 1) * $w) - greatest(start_us, $t0 + bin * $w) AS overlap
                FROM (SELECT *, unnest(range(b0, b1 + 1)) AS bin FROM s)
            ), per_kind AS (
                SELECT lane, bin, kind, sum(overlap) AS overlap FROM cut WHERE overlap > 0 GROUP BY lane, bin, kind
            )
            SELECT lane, bin, arg_max(kind, overlap) AS kind FROM per_kind GROUP BY lane, bin""",
                {"t0": float(t0), "w": float(width), "last": nbins - 1})
    finally:
        if isinstance(spans, pl.DataFrame):
            con.unregister("_report_grid_spans")
        if own:
            con.close()
    cells = np.full((len(lanes), nbins), ord("."), dtype=np.uint8)
    if df.height:
        lane_idx = df["lane"].replace_strict({lane: i for i, lane in enumerate(lanes)}, return_dtype=pl.Int64).to_numpy()
        kind_code = df["kind"].replace_strict({k: i for i, k in enumerate(kinds)}, return_dtype=pl.Int64).to_numpy()
        cells[lane_idx, df["bin"].to_numpy()] = 97 + kind_code
    return [bytes(r).decode("ascii") for r in cells], width


def _lane_order(lanes: list[str]) -> list[str]:
    def key(lane: str):
        if lane == "run":
            return (-1, 0)
        parts = lane.split()
        return (int(parts[1]), 1 if lane.endswith("GPU") else 0)
    return sorted(lanes, key=key)


def _timeline_present(con: duckdb.DuckDBPyConnection, spans: pl.DataFrame | None) -> pl.DataFrame:
    """The lanes and kinds that have spans, with their first start and last end: from the
    fetched ``spans``, or (``None``) from the views."""
    if spans is not None:
        return spans.group_by("lane", "kind").agg(pl.col("start_us").min(), pl.col("end_us").max())
    return _q(con, f"""
        SELECT {_lane_sql('rank')} AS lane, {KIND_SQL} AS kind, min(start_us) AS start_us, max(end_us) AS end_us
        FROM phase_timeline WHERE end_us > start_us GROUP BY rank, phase, sub_phase
        UNION ALL
        SELECT {_lane_sql('rank', gpu=True)}, {GPU_KIND_SQL}, min(start_us), max(end_us)
        FROM phase_gpu_events GROUP BY rank, is_nccl""")


def _lane_of(item: dict) -> str:
    return "run" if item.get("rank") is None else f"rank {item['rank']}"


def _timeline_figure(con: duckdb.DuckDBPyConnection, evidence: list[dict],
                     cascade: list[dict] = ()) -> tuple[dict | None, dict]:
    n_spans, n_gpu = con.execute("""SELECT (SELECT count(*) FROM phase_timeline WHERE end_us > start_us),
                                           (SELECT count(*) FROM phase_gpu_events)""").fetchall()[0]
    info: dict[str, Any] = {"spans": n_spans + n_gpu, "segments": 0, "aggregated": False, "bin_s": 0.0}
    # beyond MAX_SEGMENTS phase spans the grid is computed in the database: no span is fetched
    spans = _timeline_spans(con) if n_spans <= MAX_SEGMENTS else None
    present = _timeline_present(con, spans)
    placed = [e for e in [*evidence, *cascade] if e.get("ts_us") is not None]
    ev_ts = [e["ts_us"] for e in placed]
    if present.is_empty() and not ev_ts:
        return None, info
    t0 = min(([present["start_us"].min()] if present.height else []) + ev_ts)
    t1 = max(([present["end_us"].max()] if present.height else []) + ev_ts)
    lanes = _lane_order(sorted(set(present["lane"].to_list()) | {_lane_of(e) for e in placed}))
    row = {lane: i for i, lane in enumerate(lanes)}
    traces: list[dict] = []
    kinds = [k for k in PHASE_ORDER + ["gpu", "nccl"] if k in set(present["kind"].to_list())]
    labels = {"gpu": "GPU kernels", "nccl": "NCCL kernels"}
    if spans is None or spans.height > MAX_SEGMENTS:
        source: pl.DataFrame | str
        if spans is None:
            width = max((t1 - t0) / GRID_BINS, 1.0)
            source = f"""
                SELECT {_lane_sql('rank')} AS lane, {KIND_SQL} AS kind, start_us, end_us
                FROM phase_timeline WHERE end_us > start_us
                UNION ALL
                SELECT {_lane_sql('rank', gpu=True)}, {GPU_KIND_SQL}, start_us, end_us
                FROM ({_gpu_lanes_sql(con, 0, origin=t0, width=width)})"""
        else:
            source = spans
        rows, width = _grid(source, lanes, kinds, t0, t1, GRID_BINS, con=con)
        info.update(segments=GRID_BINS * len(lanes), aggregated=True, bin_s=width / 1e6)
        n = len(kinds)
        scale = []
        for i, k in enumerate(kinds):
            scale += [[i / n, PHASE_COLORS[k]], [(i + 1) / n, PHASE_COLORS[k]]]
        traces.append({"type": "heatmap", "_zrows": rows, "x0": round(width / 2e6, 6), "dx": round(width / 1e6, 6),
                       "y": list(range(len(lanes))), "zmin": -0.5, "zmax": n - 0.5, "colorscale": scale,
                       "zsmooth": False, "hoverongaps": False, "name": "phases",
                       "hovertemplate": "%{x:.2f} s<extra></extra>",
                       "colorbar": {"tickvals": list(range(n)), "ticktext": [labels.get(k, k) for k in kinds],
                                    "title": {"text": "dominant"}, "thickness": 14}})
    else:
        info.update(segments=spans.height)
        exact = spans.height <= EXACT_BARS
        for kind in kinds:
            sub = spans.filter(pl.col("kind") == kind).sort("start_us")
            start = ((sub["start_us"] - t0) / 1e6).round(6).to_list()
            end = ((sub["end_us"] - t0) / 1e6).round(6).to_list()
            rows = [row[x] for x in sub["lane"].to_list()]
            label = labels.get(kind, kind)
            if exact:
                text = [
                    esc(f"{label}{' step ' + str(s) if s is not None else ''}{' · ' + n if n else ''} · {(e - b):.4f} s · {src}"
                        + (f" ({PLACEMENT_TEXT.get(pl, 'approximate')})" if ap else ""))
                    for s, n, b, e, src, ap, pl in zip(sub["step"].to_list(), sub["name"].to_list(), start, end,
                                                       sub["source"].to_list(), sub["approximate"].to_list(),
                                                       sub["placement"].to_list())
                ]
                traces.append({"type": "bar", "orientation": "h", "name": label, "base": start,
                               "x": [round(e - b, 6) for b, e in zip(start, end)], "y": rows,
                               "marker": {"color": PHASE_COLORS[kind]}, "hovertext": text, "hoverinfo": "text",
                               "width": 0.8})
            else:
                traces.append({"type": "scatter", "mode": "lines", "name": label, "_segments": [start, end, rows],
                               "line": {"color": PHASE_COLORS[kind], "width": 6}, "hoverinfo": "skip"})
    marks = [e for e in evidence if e.get("ts_us") is not None]
    if marks:
        traces.append({
            "type": "scatter", "mode": "markers", "name": "evidence",
            "x": [round((e["ts_us"] - t0) / 1e6, 6) for e in marks],
            "y": [row[_lane_of(e)] for e in marks],
            "marker": {"symbol": ["x-open" if e.get("ts_approx") else "x" for e in marks], "size": 12, "color": "#D62728",
                       "line": {"width": 2}},
            "hovertext": [esc(f"{e.get('file')}:{e.get('line')}: {str(e.get('text') or '')[:300]}"
                              + (f" (no time stamp of its own: {e['when']})" if e.get("ts_approx") and e.get("when")
                                 else " (time estimated: the line has no time stamp)" if e.get("ts_approx") else "")
                              + " · click: the lines around it") for e in marks],
            "hoverinfo": "text", "customdata": [e.get("ctx") for e in marks],
        })
    for role, name, symbol, color, size in CASCADE_MARKERS:  # the root cause last: drawn on top
        sub = [e for e in cascade if e.get("ts_us") is not None and (e.get("role") == "root") == (role == "root")]
        if not sub:
            continue
        traces.append({
            "type": "scatter", "mode": "markers", "name": name,
            "x": [round((e["ts_us"] - t0) / 1e6, 6) for e in sub],
            "y": [row[_lane_of(e)] for e in sub],
            "marker": {"symbol": [symbol + ("-open" if e.get("ts_approx") else "") for e in sub], "size": size,
                       "color": color, "line": {"width": 1.5, "color": color}},
            "hovertext": [esc(_cascade_hover(e)) for e in sub],
            "hoverinfo": "text", "customdata": [e.get("ctx") for e in sub],
        })
    height = min(max(260, 60 + 22 * len(lanes)), 2400)
    layout = {
        "barmode": "overlay", "height": height, "margin": {"l": 90, "r": 20, "t": 30, "b": 50},
        "xaxis": {"title": {"text": f"seconds since {_iso(t0)} UTC"}, "zeroline": False},
        "yaxis": {"tickvals": list(range(len(lanes))), "ticktext": lanes, "autorange": "reversed", "zeroline": False},
        "legend": {"orientation": "h", "y": 1.08}, "hovermode": "closest",
    }
    return {"data": traces, "layout": layout}, info


# the root cause and what followed from it, drawn per rank: (role, legend name, symbol, color)
CASCADE_MARKERS = (("follow", "what followed", "diamond", "#FF7F0E", 10), ("root", "root cause", "star", "#D62728", 16))


def _cascade_hover(e: dict) -> str:
    who = "run/driver" if e.get("rank") is None else f"rank {e['rank']}"
    head = "ROOT CAUSE" if e.get("role") == "root" else "then"
    when = ""
    if e.get("ts_note"):
        when = f" ({e['ts_note']})"
    elif e.get("ts_approx"):
        when = " (time inherited from an earlier stamped line: a lower bound)"
    return (f"{head}: {e.get('class')} · {who} · {e.get('what')}{when} · {e.get('file')}:{e.get('line')}: "
            f"{str(e.get('text') or '')[:200]} · click: the lines around it")


def _iso(ts_us: float) -> str:
    return datetime.fromtimestamp(ts_us / 1e6, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


# -- steps and metrics ----------------------------------------------------------------------

def _steps_figure(con: duckdb.DuckDBPyConnection, failure_step: int | None) -> tuple[dict | None, pl.DataFrame]:
    run = _q(con, "SELECT * FROM phase_run_steps ORDER BY step")
    if run.is_empty():
        return None, run
    steps = run["step"].to_list()
    generate = (run["rollout_s"] - run["logprob_s"]).to_list()
    series = [("rollout", generate), ("rollout/logprob", run["logprob_s"].to_list()), ("reward", run["reward_s"].to_list()),
              ("train", run["train_s"].to_list()), ("sync", run["sync_s"].to_list()), ("other", run["other_s"].to_list()),
              ("idle", run["idle_s"].to_list())]
    traces = []
    sources = run["source"].to_list()
    for name, values in series:
        if not any(v and v > 0 for v in values):
            continue
        trace = {"name": name, "x": steps, "y": [round(v or 0, 6) for v in values],
                 "hovertext": [esc(f"step {s} · {name} · {v or 0:.3f} s · {src}") for s, v, src in zip(steps, values, sources)],
                 "hoverinfo": "text"}
        if len(steps) <= MAX_STEP_BARS:
            trace.update(type="bar", marker={"color": PHASE_COLORS[name]})
        else:  # thousands of bars render slowly: a stacked area says the same
            trace.update(type="scatter", mode="lines", stackgroup="phases", line={"width": 0.5, "color": PHASE_COLORS[name]},
                         fillcolor=PHASE_COLORS[name])
        traces.append(trace)
    shapes = _failure_shapes(failure_step)
    layout = {"barmode": "stack", "height": 360, "margin": {"l": 60, "r": 20, "t": 30, "b": 50},
              "xaxis": {"title": {"text": "step"}}, "yaxis": {"title": {"text": "seconds"}},
              "legend": {"orientation": "h", "y": 1.12}, "shapes": shapes, "bargap": 0.1 if len(steps) < 200 else 0}
    return {"data": traces, "layout": layout}, run


def _failure_shapes(step: int | None) -> list[dict]:
    if step is None:
        return []
    return [{"type": "line", "xref": "x", "yref": "paper", "x0": step, "x1": step, "y0": 0, "y1": 1,
             "line": {"color": "#D62728", "width": 2, "dash": "dash"}}]


def _metrics_figure(con: duckdb.DuckDBPyConnection, failure_step: int | None) -> dict | None:
    keys = [k for _, cands in METRIC_PANELS for k in cands]
    df = _q(con, """
        SELECT step, key, arg_min(value, CASE source WHEN 'jsonl' THEN 0 WHEN 'console' THEN 1 ELSE 2 END) AS value
        FROM metrics WHERE step IS NOT NULL AND key = ANY(?) GROUP BY step, key ORDER BY step""", [keys])
    if df.is_empty():
        return None
    present = set(df["key"].to_list())
    panels = []
    for title, cands in METRIC_PANELS:
        key = next((k for k in cands if k in present), None)
        if key:
            panels.append((title, key))
    n = len(panels)
    traces, layout = [], {"height": 170 * n + 60, "margin": {"l": 70, "r": 20, "t": 20, "b": 40}, "showlegend": False,
                          "shapes": [], "annotations": []}
    gap = 0.04
    h = (1 - gap * (n - 1)) / n
    for i, (title, key) in enumerate(panels):
        sub = df.filter(pl.col("key") == key)
        ax = "" if i == 0 else str(i + 1)
        y0 = 1 - (i + 1) * h - i * gap
        layout[f"yaxis{ax}"] = {"domain": [max(y0, 0), y0 + h], "title": {"text": esc(title)}, "anchor": f"x{ax}"}
        layout[f"xaxis{ax}"] = {"anchor": f"y{ax}", "matches": "x" if i else None, "showticklabels": i == n - 1,
                                "title": {"text": "step"} if i == n - 1 else None}
        values = [v if v is None or math.isfinite(v) else None for v in sub["value"].to_list()]
        traces.append({"type": "scattergl" if sub.height > 5000 else "scatter", "mode": "lines+markers" if sub.height < 200 else "lines",
                       "x": sub["step"].to_list(), "y": values, "name": esc(key), "xaxis": f"x{ax}", "yaxis": f"y{ax}",
                       "hovertemplate": esc(key) + " step %{x}: %{y}<extra></extra>", "marker": {"size": 4}})
        nonfinite = [s for s, v in zip(sub["step"].to_list(), sub["value"].to_list()) if v is not None and not math.isfinite(v)]
        if nonfinite:
            layout["annotations"].append({"xref": f"x{ax}", "yref": f"y{ax} domain", "x": nonfinite[0], "y": 0.9,
                                          "text": esc(f"{key} not finite from step {nonfinite[0]}"), "showarrow": True,
                                          "font": {"color": "#D62728"}})
        if failure_step is not None:
            layout["shapes"].append({"type": "line", "xref": f"x{ax}", "yref": f"y{ax} domain", "x0": failure_step,
                                     "x1": failure_step, "y0": 0, "y1": 1, "line": {"color": "#D62728", "width": 2, "dash": "dash"}})
    for k in list(layout):
        if k.startswith("xaxis"):
            layout[k] = {a: b for a, b in layout[k].items() if b is not None}
    if failure_step is not None:
        layout["annotations"].append({"xref": "x", "yref": "paper", "x": failure_step, "y": 1.0, "yanchor": "bottom",
                                      "text": f"failure step {failure_step}", "showarrow": False, "font": {"color": "#D62728"}})
    return {"data": traces, "layout": layout}


# -- HTML -----------------------------------------------------------------------------------

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#263238;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header .sub{opacity:.8;font-size:13px;margin-top:4px}
main{padding:12px 24px;max-width:1500px}
section{background:#fff;border:1px solid #ddd;border-radius:6px;margin:14px 0;padding:12px 16px}
h2{font-size:16px;margin:4px 0 10px}
.card.failed{border-left:6px solid #D62728}.card.healthy{border-left:6px solid #54A24B}
.verdict{font-weight:600;font-size:15px}
table{border-collapse:collapse;font-size:12px;width:100%}td,th{border-bottom:1px solid #eee;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f3f3f3}
pre.line{white-space:pre-wrap;word-break:break-all;margin:0;font-size:12px;background:#f7f7f7;padding:2px 4px}
.cite{font-family:monospace;font-size:12px;color:#555}
.note{font-size:12px;color:#666}
.tag{display:inline-block;background:#eee;border-radius:3px;padding:0 5px;margin:0 3px 0 0;font-size:12px}
ul{margin:4px 0 4px 18px;padding:0}
details.ctx summary,details.events summary{cursor:pointer;font-size:12px;color:#1f5fa8}
pre.ctx{white-space:pre-wrap;word-break:break-all;margin:2px 0 6px;font-size:11px;background:#f4f6f8;padding:4px 6px;border-left:3px solid #1f5fa8}
pre.ctx mark{background:#ffe08a;display:inline-block;width:100%}
details.ctx.flash{outline:2px solid #FF7F0E}
"""

RENDER_JS = """
(function(){
  var data = JSON.parse(document.getElementById('report-data').textContent);
  var config = {responsive: true, displaylogo: false, scrollZoom: true};
  function expand(fig){
    fig.data.forEach(function(t){
      if(t._zrows){
        t.z = t._zrows.map(function(r){
          var out = new Array(r.length);
          for(var i=0;i<r.length;i++){var c=r.charCodeAt(i); out[i] = c === 46 ? null : c - 97;}
          return out;
        });
        delete t._zrows;
      }
      if(!t._segments){return;}
      var s=t._segments[0], e=t._segments[1], r=t._segments[2], n=s.length;
      var x=new Array(3*n), y=new Array(3*n);
      for(var i=0;i<n;i++){x[3*i]=s[i];x[3*i+1]=e[i];x[3*i+2]=null;y[3*i]=r[i];y[3*i+1]=r[i];y[3*i+2]=null;}
      t.x=x; t.y=y; delete t._segments;
    });
    return fig;
  }
  // a marker's click opens the lines around the line it cites (a <details> in the incident card)
  function openContext(id){
    var el = document.getElementById(id);
    if(!el){ return; }
    for(var p = el; p; p = p.parentElement){ if(p.tagName === 'DETAILS'){ p.open = true; } }
    el.classList.add('flash');
    setTimeout(function(){ el.classList.remove('flash'); }, 2000);
    el.scrollIntoView({block: 'center'});
  }
  window.forensicsOpenContext = openContext;
  var plots = [];
  ['timeline','steps','metrics'].forEach(function(k){
    var div = document.getElementById('plot-' + k);
    if(data.figures[k] && div){plots.push({fig: data.figures[k], div: div, drawn: null});}
  });
  function draw(p){
    if(!p.drawn){
      var t0 = performance.now();
      p.drawn = Plotly.newPlot(p.div, expand(p.fig).data, p.fig.layout, config).then(function(){
        p.div.on('plotly_click', function(ev){
          var pt = ev && ev.points && ev.points[0];
          if(pt && typeof pt.customdata === 'string'){ openContext(pt.customdata); }
        });
        p.div.setAttribute('data-rendered', '1');
        p.div.setAttribute('data-render-ms', String(Math.round(performance.now() - t0)));
      });
    }
    return p.drawn;
  }
  // The first plot (the timeline) and whatever starts on the first screen render now; plots
  // further down when scrolled near (or before printing): a large run's page is usable sooner.
  var lazy = typeof IntersectionObserver === 'function';
  var now = plots.filter(function(p, i){
    return i === 0 || !lazy || p.div.getBoundingClientRect().top < window.innerHeight;
  });
  plots.forEach(function(p){ if(now.indexOf(p) < 0){p.div.setAttribute('data-deferred', '1');} });
  if(lazy){
    var seen = new IntersectionObserver(function(entries){
      entries.forEach(function(en){
        if(!en.isIntersecting){return;}
        seen.unobserve(en.target);
        plots.forEach(function(p){ if(p.div === en.target){draw(p);} });
      });
    }, {rootMargin: '300px 0px'});
    plots.forEach(function(p){ if(now.indexOf(p) < 0){seen.observe(p.div);} });
  }
  window.addEventListener('beforeprint', function(){ plots.forEach(draw); });
  Promise.all(now.map(draw)).then(function(){ document.body.setAttribute('data-report-ready', '1'); });
})();
"""


def _card_html(diag: dict | None, note: str | None, evidence: list[dict], cascade: list[dict] = ()) -> str:
    parts = []
    if diag is None:
        parts.append('<section class="card" id="incident"><h2>Incident</h2>')
        parts.append(f'<p class="note">{esc(note)}</p>')
        if evidence:
            parts.append("<p>Error lines in the logs (the first of each file), shown instead:</p>")
            parts.append(_evidence_list(evidence))
        parts.append("</section>")
        return "".join(parts)
    verdict = diag.get("verdict", "unknown")
    parts.append(f'<section class="card {esc(verdict)}" id="incident"><h2>Incident</h2>')
    causes = diag.get("root_causes") or []
    if not causes:
        parts.append(f'<p class="verdict">Verdict: {esc(verdict)}</p>')
        end = diag.get("end")
        if end:
            parts.append(f'<p>Why: <span class="cite">{esc(end.get("file"))}:{esc(end.get("line"))}</span></p>'
                         f'<pre class="line">{esc(end.get("text"))}</pre>')
    for i, rc in enumerate(causes):
        where = []
        for key in ("rank", "node", "phase", "step"):
            if rc.get(key) is not None:
                where.append(f'<span class="tag">{esc(key)} {esc(rc.get(key))}</span>')
        title = rc.get("title") or ""
        parts.append(f'<p class="verdict">{"Root cause" if i == 0 else "Also possible"}: {esc(rc.get("id"))}'
                     f'{" — " + esc(title) if title else ""} <span class="note">(confidence {esc(rc.get("confidence"))})</span></p>')
        if where:
            parts.append(f"<p>{''.join(where)}</p>")
        if rc.get("summary"):
            parts.append(f"<p>{esc(rc['summary'])}</p>")
        evs = [e for e in evidence if e.get("_cause") == i]
        if evs:
            parts.append("<p>Evidence:</p>" + _evidence_list(evs))
        cascade_text = list(rc.get("cascade") or []) + [f"symptom: {s}" for s in rc.get("symptoms") or []]
        if cascade_text:
            parts.append("<p>Cascade:</p><ul>" + "".join(f"<li>{esc(c)}</li>" for c in cascade_text) + "</ul>")
        if i == 0 and cascade:
            parts.append(_cascade_table(cascade))
        if rc.get("remediation"):
            parts.append("<p>Remediation:</p><ul>" + "".join(f"<li>{esc(r)}</li>" for r in rc["remediation"]) + "</ul>")
    for n in diag.get("notes") or []:
        parts.append(f'<p class="note">{esc(n)}</p>')
    parts.append("</section>")
    return "".join(parts)


def _evidence_list(evidence: list[dict]) -> str:
    rows = []
    for e in evidence[:MAX_EVIDENCE]:
        when = (f" · {esc(e['when'])}" if e.get("when") else
                f" · {'about ' if e.get('ts_approx') else ''}{esc(_iso(e['ts_us']))}" if e.get("ts_us") is not None else "")
        rank = f" · rank {esc(e['rank'])}" if e.get("rank") is not None else ""
        rows.append(f'<li><span class="cite">{esc(e.get("file"))}:{esc(e.get("line"))}{when}{rank}</span>'
                    f'<pre class="line">{esc(e.get("text"))}</pre>{_context_html(e)}</li>')
    more = f'<li class="note">{len(evidence) - MAX_EVIDENCE} more not shown</li>' if len(evidence) > MAX_EVIDENCE else ""
    return "<ul>" + "".join(rows) + more + "</ul>"


CONTEXT_LINES = 6  # lines of its file shown either side of a cited line
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def _cascade_items(diag: dict | None) -> list[dict]:
    """The first root cause's event and the events that followed it (the diagnosis's
    ``cascade_events``), with ``ts_us``. A root cause without a time of its own is drawn at
    the first event that followed it (the latest it can have happened), and says so."""
    rcs = (diag or {}).get("root_causes") or []
    items = []
    for e in (rcs[0].get("cascade_events") or []) if rcs else []:
        ts = e.get("ts")
        ts_us = datetime.fromisoformat(ts).replace(tzinfo=timezone.utc).timestamp() * 1e6 if ts else None
        items.append({**e, "ts_us": ts_us, "ts_approx": bool(ts) and not e.get("ts_precise")})
    if items and items[0].get("role") == "root" and items[0]["ts_us"] is None:
        later = [e["ts_us"] for e in items[1:] if e["ts_us"] is not None]
        if later:
            items[0].update(ts_us=min(later), ts_approx=True,
                            ts_note="its line has no time stamp: drawn at the first event that followed it, the latest it can have happened")
    return items


def _attach_context(con: duckdb.DuckDBPyConnection, items: list[dict], prefix: str) -> None:
    """Give each item citing a line (``file``, ``line``) an element id (``ctx``) and the
    ``CONTEXT_LINES`` lines of its file either side (``context``: (line_no, text) pairs), in one
    query."""
    keys = []
    for i, e in enumerate(items):
        e["ctx"] = f"ctx-{prefix}{i}"
        if e.get("file") is not None and isinstance(e.get("line"), int):
            keys.append((i, str(e["file"]), int(e["line"])))
    if not keys:
        return
    frame = pl.DataFrame({"i": [k[0] for k in keys], "path": [k[1] for k in keys], "line_no": [k[2] for k in keys]},
                         schema={"i": pl.Int64, "path": pl.String, "line_no": pl.Int64})
    con.register("_ctx_keys", frame.to_arrow())
    try:
        rows = con.execute(f"""
            WITH want AS (
                SELECT k.i, f.file_id, unnest(range(greatest(k.line_no - {CONTEXT_LINES}, 1), k.line_no + {CONTEXT_LINES + 1})) AS line_no
                FROM _ctx_keys k JOIN files f ON f.path = k.path
            )
            SELECT w.i, l.line_no, l.text FROM want w JOIN lines l USING (file_id, line_no)
            ORDER BY w.i, l.line_no""").fetchall()
    finally:
        con.unregister("_ctx_keys")
    for i, n, text in rows:
        items[i].setdefault("context", []).append((int(n), _ANSI.sub("", text or "")))


def _context_html(e: dict) -> str:
    """The lines around a cited line, folded: a <details> element the timeline's markers open."""
    ctx = e.get("context")
    if not ctx or not e.get("ctx"):
        return ""
    cited = e.get("line")
    width = len(str(ctx[-1][0]))
    body = "\n".join((f'<mark>{n:>{width}}  {esc(t)}</mark>' if n == cited else f"{n:>{width}}  {esc(t)}") for n, t in ctx)
    return (f'<details class="ctx" id="{esc(e["ctx"])}"><summary>{esc(e.get("file"))}:{esc(cited)} — lines '
            f'{ctx[0][0]}–{ctx[-1][0]} of the file</summary><pre class="ctx">{body}</pre></details>')


def _cascade_table(events: list[dict]) -> str:
    """Every event of the cascade, the root cause first: when, where, what, the line and its context."""
    rows = []
    for e in events:
        when = ""
        if e.get("ts_us") is not None:
            when = ("≤ " if e.get("ts_note") else "about " if e.get("ts_approx") else "") + _iso(e["ts_us"])
        who = "run/driver" if e.get("rank") is None else f"rank {e['rank']}"
        rows.append(f"<tr><td>{esc('root cause' if e.get('role') == 'root' else e.get('role'))}</td><td>{esc(when)}</td>"
                    f"<td>{esc(who)}</td><td>{esc(e.get('class'))}</td><td>{esc(e.get('what'))}"
                    f'<div class="cite">{esc(e.get("file"))}:{esc(e.get("line"))}</div>'
                    f'<pre class="line">{esc(e.get("text"))}</pre>{_context_html(e)}</td></tr>')
    return (f'<details class="events" id="cascade-events"><summary>The cascade event by event ({len(events)}; '
            "the timeline draws them per rank)</summary><table><tr><th>role</th><th>time (UTC)</th><th>where</th>"
            "<th>class</th><th>what</th></tr>" + "".join(rows) + "</table></details>")


def _findings_html(found: list[dict]) -> str:
    if not found:
        return '<section id="findings"><h2>Findings</h2><p class="note">No performance finding.</p></section>'
    rows = []
    for f in found:
        cites = "".join(f'<div class="cite">{esc(e.get("file"))}:{esc(e.get("line"))}</div>' for e in (f.get("evidence") or [])[:3])
        rows.append(f"<tr><td>{esc(f.get('id'))}</td><td>{esc(f.get('rank') if f.get('rank') is not None else '')}</td>"
                    f"<td>{esc(f.get('detail'))}{cites}</td></tr>")
    return ('<section id="findings"><h2>Findings</h2><table><tr><th>id</th><th>rank</th><th>detail</th></tr>'
            + "".join(rows) + "</table></section>")


def _inventory_html(con: duckdb.DuckDBPyConnection) -> str:
    files = _q(con, f"""SELECT path, format, kind, bytes, lines, status, message FROM files
                        ORDER BY path LIMIT {MAX_INVENTORY + 1}""")
    total = int(con.execute("SELECT count(*) FROM files").fetchall()[0][0])
    rows = "".join(
        f"<tr><td class=\"cite\">{esc(r['path'])}</td><td>{esc(r['format'])}</td><td>{esc(r['kind'])}</td>"
        f"<td>{esc(r['bytes'])}</td><td>{esc(r['lines'])}</td><td>{esc(r['status'])}</td><td>{esc(r['message'] or '')}</td></tr>"
        for r in files.head(MAX_INVENTORY).iter_rows(named=True))
    more = f'<p class="note">{total - MAX_INVENTORY} more file(s) not listed.</p>' if total > MAX_INVENTORY else ""
    return (f'<section id="inventory"><h2>Files ({total})</h2><table><tr><th>path</th><th>format</th><th>kind</th>'
            f"<th>bytes</th><th>lines</th><th>status</th><th>message</th></tr>{rows}</table>{more}</section>")


def _fallback_evidence(con: duckdb.DuckDBPyConnection) -> list[dict]:
    """Without a diagnosis: the first ERROR/FATAL line of each file."""
    df = _q(con, """
        SELECT f.path AS file, l.line_no AS line, l.text
        FROM lines l JOIN files f USING (file_id)
        WHERE l.level IN ('ERROR', 'FATAL')
        QUALIFY row_number() OVER (PARTITION BY l.file_id ORDER BY l.line_no) = 1
        ORDER BY l.ts NULLS LAST, f.path LIMIT 20""")
    return df.to_dicts()


def _failure_step(diag: dict | None, evidence: list[dict], con: duckdb.DuckDBPyConnection,
                  cascade: list[dict] = ()) -> int | None:
    """The diagnosis's step, else the step running when the root cause's first timed line (or
    its event on the timeline) was written: the last step started by then (marker lines, else
    the steps placed from durations), or the one after a placed step that had already ended."""
    if diag and diag.get("root_causes"):
        step = diag["root_causes"][0].get("step")
        if step is not None:
            return int(step)
        first = next((e for e in [*evidence, *cascade[:1]] if e.get("_cause", 0) == 0 and e.get("ts_us") is not None), None)
        if first:
            row = con.execute("""
                SELECT step, pref = 1 AND end_us < ? FROM (
                    SELECT step, start_us, end_us, 0 AS pref FROM phase_log_steps WHERE rank IS NULL
                    UNION ALL SELECT step, start_us, end_us, 1 FROM phase_step_placement)
                WHERE start_us <= ? ORDER BY pref, step DESC LIMIT 1""", [first["ts_us"], first["ts_us"]]).fetchall()
            if row and row[0][0] is not None:
                return int(row[0][0]) + (1 if row[0][1] else 0)
    return None


def build(con: duckdb.DuckDBPyConnection, title: str = "forensics post-mortem") -> tuple[str, ReportResult]:
    """Build the report HTML from an open database connection."""
    t_start = time.perf_counter()
    # The diagnosis reads log lines and metrics, not the phase views: it runs on a connection
    # of its own while this one materialises the phase views (DuckDB releases the GIL).
    # Two Python threads already keep two cores busy; DuckDB threads on top of them mostly
    # wait on each other (one aggregate of phase_steps: 0.3 CPU s with two, 0.05 with one).
    threads = con.execute("SELECT current_setting('threads')").fetchall()[0][0]
    con.execute("SET threads = 1")
    diag_con = interruptible(con.cursor())
    try:
        restrict_to_run(diag_con, restricted_run(con))  # a cursor has TEMP views of its own: the same run
        diag_con.execute("SET enable_progress_bar = false").fetchall()
        (n_lines,) = con.execute("SELECT count(*) FROM lines").fetchall()[0]
        if n_lines > PARALLEL_DIAGNOSIS_MAX_LINES:
            # under the diagnosis' own DuckDB limit (as `forensics diagnose`): the report's
            # larger one is for the phase views, and DuckDB would fill it while the hits are held
            with memory_limit(con, DB_MEMORY):
                diag, diag_note = _diagnosis(diag_con)
            with ph.cached(con):
                content = _content(con, diag, diag_note)
        else:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="forensics-report") as pool:
                diag_future = pool.submit(_diagnosis, diag_con)
                with ph.cached(con):
                    from .diagnosis.explain import result_awake

                    diag, diag_note = result_awake(diag_future)
                    content = _content(con, diag, diag_note)
    finally:
        diag_con.close()
        con.execute(f"SET threads = {int(threads)}")
    page = _page(title, con.execute("SELECT current_database()").fetchall()[0][0], content)
    tinfo = content["tinfo"]
    result = ReportResult(path="", bytes=len(page.encode("utf-8")), seconds=time.perf_counter() - t_start,
                          spans=tinfo["spans"], segments=tinfo["segments"], aggregated=tinfo["aggregated"],
                          notes=content["notes"])
    return page, result


def _content(con: duckdb.DuckDBPyConnection, diag: dict | None, diag_note: str | None) -> dict[str, Any]:
    """What the page shows, read from the database (inside ``ph.cached``)."""
    from . import findings as fd

    notes = [diag_note] if diag_note else []
    evidence: list[dict] = []
    if diag:
        for i, rc in enumerate(diag.get("root_causes") or []):
            evidence += [{**e, "_cause": i} for e in rc.get("evidence") or []]
    else:
        evidence = [{**e, "_cause": 0} for e in _fallback_evidence(con)]
    evidence = _locate_evidence(con, evidence)
    cascade = _cascade_items(diag)
    _attach_context(con, evidence, "e")
    _attach_context(con, cascade, "c")
    found = list(diag.get("findings") or []) if diag else []
    seen = {(f.get("id"), f.get("rank"), f.get("detail")) for f in found}
    for f in fd.findings(con):
        if (f["id"], f["rank"], f["detail"]) not in seen:
            found.append(f)
    failure_step = _failure_step(diag, evidence, con, cascade)
    timeline, tinfo = _timeline_figure(con, evidence, cascade)
    steps_fig, _ = _steps_figure(con, failure_step)
    if tinfo["aggregated"]:
        notes.append(f"The timeline has {tinfo['spans']:,} spans and GPU intervals; to stay responsive it shows them "
                     f"aggregated into bins of {tinfo['bin_s']:.3g} s per lane, each bin colored by the phase (or GPU "
                     "activity) that filled most of it; zooming in does not show finer detail. Query `phase_timeline` "
                     "and `phase_gpu_events` for every span.")
    figures = {"timeline": timeline, "steps": steps_fig, "metrics": _metrics_figure(con, failure_step)}
    for fig in figures.values():
        _allow_tick_overflow(fig)
    return {"diag": diag, "diag_note": diag_note, "evidence": evidence, "cascade": cascade, "findings": found, "tinfo": tinfo, "notes": notes,
            "figures": figures, "inventory": _inventory_html(con)}


def _allow_tick_overflow(fig: dict | None) -> None:
    """Let tick labels overflow the plot. Plotly's default for numeric axes hides the labels
    that would leave the div, and finds them by measuring every label in the browser: on the
    timeline's lane axis of a large run that is most of the page's drawing time."""
    for key, axis in (fig or {}).get("layout", {}).items():
        if key.startswith(("xaxis", "yaxis")):
            axis.setdefault("ticklabeloverflow", "allow")


def _plot_div(name: str, fig: dict | None, missing: str) -> str:
    """The element a figure renders into, as tall as the figure will be (so that the page does
    not move while plots render, and the script can tell which plots start off screen)."""
    if not fig:
        return f'<p class="note">{esc(missing)}</p>'
    return f'<div id="plot-{name}" class="plot" style="height:{int(fig["layout"]["height"])}px"></div>'


def _page(title: str, db_name: str, c: dict[str, Any]) -> str:
    import plotly.offline

    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    verdict = (c["diag"] or {}).get("verdict", "unknown")
    figures = c["figures"]
    body = [
        f"<header><h1>{esc(title)}</h1><div class=\"sub\">database {esc(db_name)} · generated {esc(generated)} · "
        f"verdict: {esc(verdict)}</div></header><main>",
        _card_html(c["diag"], c["diag_note"], c["evidence"], c["cascade"]),
        _findings_html(c["findings"]),
        '<section id="timeline"><h2>Timeline</h2>',
        "".join(f'<p class="note">{esc(n)}</p>' for n in c["notes"] if not n.startswith("diagnosis")),
        _plot_div("timeline", figures["timeline"], "No phase spans: no profiler trace, Ray timeline, marker lines or "
                  "timed metrics with time stamps."),
        '<p class="note">Drag to zoom, double-click to reset. Red crosses: evidence lines (open crosses: lines without '
        'a time stamp of their own, placed at the last stamped line of that rank\'s files). Star: the root cause; '
        'diamonds: what followed it, on the lane of their rank (open: time not printed on the line). Click a marker '
        'for the lines around it. Steps known only from timing metrics are placed from their durations (see the '
        'hover).</p></section>',
        '<section id="steps"><h2>Phases per step</h2>',
        _plot_div("steps", figures["steps"], "No per-step phase figures."),
        "</section>",
        '<section id="metrics"><h2>Training metrics</h2>',
        _plot_div("metrics", figures["metrics"], "No training metrics."),
        "</section>",
        c["inventory"],
        "</main>",
    ]
    # the scripts come last: the browser shows the incident card before it runs plotly.js
    return (
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
        + "".join(body)
        + f"<script>{plotly.offline.get_plotlyjs()}</script>"
        + f'<script type="application/json" id="report-data">{script_json({"figures": figures})}</script>'
        + f"<script>{RENDER_JS}</script></body></html>"
    )


def write_report(db: str | os.PathLike, out: str | os.PathLike, title: str | None = None,
                 run: str | None = None) -> ReportResult:
    """Write the report of database ``db`` to ``out`` (opened read-only). A database of
    several runs (table ``runs``) needs ``run``, the run to report (an id or a name:
    ``store.pick_run``), else it raises ``store.NoSuchRun`` listing them."""
    if not os.path.exists(db):
        raise FileNotFoundError(f"no database at {db}: run `forensics ingest PATH --db {db}` first")
    con = db_connect(str(db), read_only=True)
    try:
        attach_parts(con)  # a database of views over parts on object storage
        con.execute("SET enable_progress_bar = false").fetchall()
        set_memory_limit(con, REPORT_DB_MEMORY)  # DuckDB would cache up to 80% of RAM
        runs = diagnosable_runs(con)
        name = Path(db).name
        if run is not None or len(runs) > 1:
            if run is None:
                listed = ", ".join(r.name for r in runs[:10]) + (", ..." if len(runs) > 10 else "")
                raise NoSuchRun(f"{name} holds {len(runs)} runs ({listed}): pass --run NAME (or its id) for the report of one")
            picked = pick_run(runs, run)
            if len(runs) > 1:
                restrict_to_run(con, picked.run_id)
            name = f"{name}, run {picked.name}"
        return write_report_con(con, out, title or f"forensics post-mortem: {name}")
    finally:
        con.close()


def write_report_con(con: duckdb.DuckDBPyConnection, out: str | os.PathLike, title: str) -> ReportResult:
    """Write the report of the open database ``con`` to ``out``."""
    t0 = time.perf_counter()
    page, result = build(con, title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    result.path = str(out)
    result.seconds = time.perf_counter() - t0
    return result


def main(argv: list[str]) -> int:
    db = argv[0] if argv else "forensics.duckdb"
    out = argv[1] if len(argv) > 1 else "report.html"
    r = write_report(db, out)
    print(f"wrote {r.path} ({r.bytes / 1e6:.1f} MB) in {r.seconds:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
