"""Performance findings: straggler ranks, slow weight sync, rollout long tail, step time jumps.

:func:`findings` reads the phase views (the SQL modules ``forensics/sql/phases*.sql``) and returns plain
dicts that ``forensics diagnose`` puts in the ``findings`` list of its JSON
(``{"id", "rank", "detail", ...}``). Thresholds are data: ``signatures/findings.yaml``.

Extra keys besides the contract's ``id`` / ``rank`` / ``detail``: ``phase``, ``steps`` (the
steps that show it), ``value`` (the headline number, seconds or a ratio), ``source`` (which
data measured it) and ``evidence`` (``[{file, line, text}]`` where a line shows it).
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import duckdb
import polars as pl

from . import phases as ph
from .catalogue import load_yaml

FINDINGS_YAML = ph.SIGNATURES / "findings.yaml"


def load_thresholds(path: str | Path = FINDINGS_YAML) -> dict[str, dict[str, Any]]:
    doc = load_yaml(Path(path).read_text()) or {}
    needed = ("straggler", "slow_weight_sync", "rollout_long_tail", "step_time_jump")
    missing = [k for k in needed if not isinstance(doc.get(k), dict)]
    if missing:
        raise ValueError(f"{path}: missing section(s) {', '.join(missing)}")
    return doc


def _q(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None) -> pl.DataFrame:
    return pl.from_arrow(con.sql(sql, params=params).to_arrow_table())  # type: ignore[return-value]


def _fmt_steps(steps: list[int]) -> str:
    steps = sorted(steps)
    if len(steps) > 6:
        return f"{steps[0]}-{steps[-1]} ({len(steps)} steps)"
    return ", ".join(str(s) for s in steps)


def _metric_evidence(con: duckdb.DuckDBPyConnection, step: int, key_regex: str) -> list[dict]:
    """The log/JSONL line that reported a step's timing metric, as contract evidence."""
    rows = _q(con, """
        SELECT f.path, m.line_no, l.text
        FROM metrics m JOIN files f USING (file_id)
        LEFT JOIN lines l ON l.file_id = m.file_id AND l.line_no = m.line_no
        WHERE m.step = ? AND regexp_matches(m.key, ?) AND m.line_no IS NOT NULL
        ORDER BY CASE m.source WHEN 'jsonl' THEN 0 ELSE 1 END, f.path, m.line_no LIMIT 1""", [step, key_regex])
    return [{"file": r["path"], "line": r["line_no"], "text": r["text"]} for r in rows.iter_rows(named=True)]


def straggler_findings(con: duckdb.DuckDBPyConnection, cfg: dict) -> list[dict]:
    """Ranks consistently slower than their peers in a phase (busy time, waits excluded)."""
    busy = _q(con, """
        SELECT rank, step, phase, any_value(source) AS source,
               sum(seconds) - coalesce(sum(wait_s), 0) AS busy_s, sum(seconds) AS seconds
        FROM phases WHERE rank IS NOT NULL AND phase = ANY(?)
        GROUP BY rank, step, phase""", [list(cfg["phases"])])
    if busy.is_empty():
        return []
    late = _q(con, "SELECT rank, step, sum(late_s) AS late_s, any_value(coll_name) AS coll FROM phase_collectives GROUP BY rank, step")
    late_by = {(r["rank"], r["step"]): r for r in late.iter_rows(named=True)}
    # the median of the *other* ranks: exact for few ranks, the all-rank median otherwise
    busy = busy.with_columns(
        pl.len().over("step", "phase").alias("n"),
        pl.col("busy_s").median().over("step", "phase").alias("all_med"),
        pl.col("busy_s").sum().over("step", "phase").alias("all_sum"),
    ).filter(pl.col("n") >= 2)
    few = busy.filter(pl.col("n") <= 4)
    if few.height:
        peers = {}
        for (step, phase), grp in few.group_by(["step", "phase"]):
            vals = grp.select("rank", "busy_s").rows()
            for rank, _ in vals:
                peers[(step, phase, rank)] = statistics.median(v for r, v in vals if r != rank)
        busy = busy.with_columns(
            pl.struct("step", "phase", "rank").map_elements(
                lambda k: peers.get((k["step"], k["phase"], k["rank"])), return_dtype=pl.Float64).alias("few_med"))
    else:
        busy = busy.with_columns(pl.lit(None, pl.Float64).alias("few_med"))
    busy = busy.with_columns(pl.coalesce("few_med", "all_med").alias("peer_s"))
    busy = busy.with_columns((pl.col("busy_s") - pl.col("peer_s")).alias("gap_s"))
    busy = busy.with_columns(
        ((pl.col("gap_s") >= cfg["min_gap_s"])
         & ((pl.col("peer_s") <= 0) | (pl.col("gap_s") / pl.col("peer_s") >= cfg["min_rel_gap"]))).alias("flag"))
    per = busy.group_by("rank", "phase").agg(
        pl.len().alias("measured"), pl.col("flag").sum().alias("flagged"),
        pl.col("step").filter(pl.col("flag")).sort().alias("steps"),
        pl.col("gap_s").filter(pl.col("flag")).median().alias("gap"),
        pl.col("busy_s").filter(pl.col("flag")).median().alias("mine"),
        pl.col("peer_s").filter(pl.col("flag")).median().alias("peer"),
        pl.col("source").unique().sort().alias("sources"),
    ).filter((pl.col("flagged") >= cfg["min_steps"])
             & (pl.col("flagged") / pl.col("measured") >= cfg["min_share_of_steps"])).sort("phase", "rank")
    out: list[dict] = []
    for r in per.iter_rows(named=True):
        rank, phase, flagged = r["rank"], r["phase"], r["steps"]
        detail = (
            f"rank {rank} is slower than its peers in {phase} in {len(flagged)} of {r['measured']} measured steps "
            f"(steps {_fmt_steps(flagged)}): {r['mine']:.2f} s busy vs {r['peer']:.2f} s "
            f"on the median peer, a gap of {r['gap']:.2f} s per step"
        )
        lates = [late_by[(rank, s)]["late_s"] for s in flagged if (rank, s) in late_by]
        if lates:
            coll = next((late_by[(rank, s)]["coll"] for s in flagged if (rank, s) in late_by), None)
            detail += (f"; it reaches the collectives (e.g. {coll}) {statistics.median(lates):.2f} s after the first rank "
                       "(median per step), so the other ranks wait for it")
        detail += f" (source: {', '.join(r['sources'])})"
        out.append({
            "id": "straggler", "rank": rank, "detail": detail, "phase": phase, "steps": list(flagged),
            "value": round(r["gap"], 4), "source": ", ".join(r["sources"]), "evidence": [],
        })
    return out


def slow_sync_findings(con: duckdb.DuckDBPyConnection, cfg: dict) -> list[dict]:
    steps = _q(con, "SELECT step, source, step_s, sync_s FROM phase_run_steps WHERE step_s > 0 ORDER BY step")
    if steps.is_empty():
        return []
    shares = [r["sync_s"] / r["step_s"] for r in steps.iter_rows(named=True)]
    med_share = statistics.median(shares)
    med_sync = statistics.median(steps["sync_s"].to_list())
    if med_share < cfg["min_share"] or med_sync < cfg["min_s"]:
        return []
    worst = steps.with_columns((pl.col("sync_s") / pl.col("step_s")).alias("share")).sort("share", descending=True).row(0, named=True)
    return [{
        "id": "slow_weight_sync", "rank": None, "phase": "sync",
        "detail": (f"weight sync takes {med_share:.0%} of the step in the median step ({med_sync:.2f} s of "
                   f"{statistics.median(steps['step_s'].to_list()):.2f} s); worst: step {worst['step']} "
                   f"({worst['share']:.0%}, {worst['sync_s']:.2f} s) (source: {', '.join(sorted(set(steps['source'].to_list())))})"),
        "steps": steps["step"].to_list(), "value": round(med_share, 4), "source": ", ".join(sorted(set(steps["source"].to_list()))),
        "evidence": _metric_evidence(con, worst["step"], "(?i)^timing(_s)?/(update_weights|sync)"),
    }]


def _slowest_rank_per_step(per_rank: pl.DataFrame) -> list[tuple[float, int, int]]:
    """``(ratio, step, rank)`` for each step (in order) that has two ranks or more in ``per_rank``
    (step, rank, rollout_s) and whose other ranks' median is above 0: the slowest rank (the
    lowest rank among equals) and its rollout_s over the median of the other ranks."""
    # the median as statistics.median takes it: the mean of the two middle values (one value
    # twice when they are odd in number, which is exact in floating point)
    others = pl.col("rollout_s").slice(1)  # sorted: slowest first
    m = pl.len() - 1
    per_step = (
        per_rank.filter(pl.len().over("step") >= 2)
        .sort(["step", "rollout_s", "rank"], descending=[False, True, False])
        .group_by("step", maintain_order=True)
        .agg(pl.col("rank").first().alias("top_rank"), pl.col("rollout_s").first().alias("top_s"),
             ((others.get((m - 1) // 2) + others.get(m // 2)) / 2).alias("med"))
        .filter(pl.col("med") > 0)
    )
    return [(top_s / med, step, rank) for step, rank, top_s, med
            in per_step.select("step", "top_rank", "top_s", "med").iter_rows()]


def rollout_tail_findings(con: duckdb.DuckDBPyConnection, cfg: dict) -> list[dict]:
    out: list[dict] = []
    skip = int(cfg.get("skip_first_steps", 0))
    first = _q(con, "SELECT min(step) AS s FROM phase_run_steps")["s"][0]
    first = first if first is not None else 0
    # across ranks, within a step
    per_rank = _q(con, "SELECT step, rank, rollout_s, source FROM phase_steps WHERE rank IS NOT NULL AND rollout_s > 0 AND step >= ?",
                  [first + skip])
    ratios = _slowest_rank_per_step(per_rank)
    slowest = [r[2] for r in ratios]
    if ratios:
        med_ratio = statistics.median(r[0] for r in ratios)
        if med_ratio >= cfg["rank_ratio"]:
            rank = statistics.mode(slowest)
            out.append({
                "id": "rollout_long_tail", "rank": rank, "phase": "rollout",
                "detail": (f"rollout is unbalanced across ranks: in the median step the slowest rank's generation takes "
                           f"{med_ratio:.1f}x the other ranks' median; rank {rank} is the slowest in "
                           f"{slowest.count(rank)} of {len(slowest)} steps and the others wait for it"),
                "steps": sorted(r[1] for r in ratios if r[0] >= cfg["rank_ratio"]), "value": round(med_ratio, 3),
                "source": ", ".join(sorted(set(per_rank["source"].to_list()))), "evidence": [],
            })
    # across steps
    run = _q(con, "SELECT step, rollout_s, step_s, source FROM phase_run_steps WHERE step >= ? AND rollout_s > 0 ORDER BY step",
             [first + skip])
    if run.height >= 3:
        med = statistics.median(run["rollout_s"].to_list())
        top = run.sort("rollout_s", descending=True).row(0, named=True)
        if med > 0 and top["rollout_s"] / med >= cfg["step_ratio"]:
            long_steps = run.filter(pl.col("rollout_s") >= cfg["step_ratio"] * med)["step"].to_list()
            out.append({
                "id": "rollout_long_tail", "rank": None, "phase": "rollout",
                "detail": (f"rollout time has a long tail across steps: step {top['step']} generated for {top['rollout_s']:.2f} s, "
                           f"{top['rollout_s'] / med:.1f}x the median step's {med:.2f} s "
                           f"({len(long_steps)} step(s) at {cfg['step_ratio']}x or more: {_fmt_steps(long_steps)})"),
                "steps": long_steps, "value": round(top["rollout_s"] / med, 3),
                "source": ", ".join(sorted(set(run["source"].to_list()))),
                "evidence": _metric_evidence(con, top["step"], "(?i)^timing(_s)?/gen"),
            })
    # within a step: response lengths
    lengths = _q(con, """
        SELECT step, max(value) FILTER (WHERE key = 'response_length/max') AS mx,
               max(value) FILTER (WHERE key = 'response_length/mean') AS mean
        FROM metrics WHERE key IN ('response_length/max', 'response_length/mean') AND step >= ?
        GROUP BY step HAVING mx IS NOT NULL AND mean > 0""", [first + skip])
    if lengths.height and run.height:
        med_len_ratio = statistics.median((lengths["mx"] / lengths["mean"]).to_list())
        share = statistics.median((run["rollout_s"] / run["step_s"]).to_list()) if (run["step_s"] > 0).all() else 0.0
        if med_len_ratio >= cfg["length_ratio"] and share >= cfg["min_rollout_share"]:
            out.append({
                "id": "rollout_long_tail", "rank": None, "phase": "rollout",
                "detail": (f"generation is dominated by a few long responses: response_length/max is {med_len_ratio:.1f}x "
                           f"response_length/mean in the median step while rollout takes {share:.0%} of the step"),
                "steps": lengths["step"].to_list(), "value": round(med_len_ratio, 3), "source": "metrics", "evidence": [],
            })
    return out


def step_jump_findings(con: duckdb.DuckDBPyConnection, cfg: dict) -> list[dict]:
    run = _q(con, """SELECT step, step_s, rollout_s, reward_s, train_s, sync_s, other_s, idle_s, source
                     FROM phase_run_steps WHERE step_s IS NOT NULL ORDER BY step""")
    if run.height < cfg["min_window"] + 1:
        return []
    rows = run.to_dicts()
    skip = int(cfg.get("skip_first_steps", 0))
    jumps = []
    for i, r in enumerate(rows):
        if i < skip:
            continue
        prev = rows[max(skip, i - cfg["window"]):i]
        if len(prev) < cfg["min_window"]:
            continue
        med = statistics.median(p["step_s"] for p in prev)
        if med > 0 and r["step_s"] >= cfg["ratio"] * med and r["step_s"] - med >= cfg["min_extra_s"]:
            grew = max(("rollout", "reward", "train", "sync", "other", "idle"),
                       key=lambda k: r[f"{k}_s"] - statistics.median(p[f"{k}_s"] for p in prev))
            extra = r[f"{grew}_s"] - statistics.median(p[f"{grew}_s"] for p in prev)
            jumps.append((r, med, grew, extra))
    out = []
    for r, med, grew, extra in jumps[: cfg["max_listed"]]:
        out.append({
            "id": "step_time_jump", "rank": None, "phase": grew,
            "detail": (f"step {r['step']} took {r['step_s']:.2f} s, {r['step_s'] / med:.1f}x the median {med:.2f} s of the "
                       f"steps before it; {grew} grew the most (+{extra:.2f} s) (source: {r['source']})"),
            "steps": [r["step"]], "value": round(r["step_s"] / med, 3), "source": r["source"],
            "evidence": _metric_evidence(con, r["step"], "(?i)^timing(_s)?/step$"),
        })
    if len(jumps) > cfg["max_listed"]:
        rest = [j[0]["step"] for j in jumps[cfg["max_listed"]:]]
        out.append({
            "id": "step_time_jump", "rank": None, "phase": None,
            "detail": f"{len(rest)} more step(s) took {cfg['ratio']}x their recent median or longer: steps {_fmt_steps(rest)}",
            "steps": rest, "value": None, "source": rows[0]["source"], "evidence": [],
        })
    return out


def findings(con: duckdb.DuckDBPyConnection, thresholds: dict | None = None) -> list[dict]:
    """Performance findings of the ingested run, most specific first (see the module docstring)."""
    cfg = thresholds or load_thresholds()
    with ph.cached(con):
        out = straggler_findings(con, cfg["straggler"])
        out += slow_sync_findings(con, cfg["slow_weight_sync"])
        out += rollout_tail_findings(con, cfg["rollout_long_tail"])
        out += step_jump_findings(con, cfg["step_time_jump"])
    return out
