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


def _q(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None) -> list[dict]:
    cur = con.execute(sql, params or [])
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def _median(xs: list) -> float | None:
    """The median of the values that are not null (None: there are none)."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _sources(rows: list[dict]) -> list[str]:
    """The distinct sources of ``rows``, sorted (a row without one names none)."""
    return sorted({r["source"] for r in rows if r["source"] is not None})


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
    return [{"file": r["path"], "line": r["line_no"], "text": r["text"]} for r in rows]


def straggler_findings(con: duckdb.DuckDBPyConnection, cfg: dict) -> list[dict]:
    """Ranks consistently slower than their peers in a phase (busy time, waits excluded)."""
    busy = _q(con, """
        SELECT rank, step, phase, any_value(source) AS source,
               sum(seconds) - coalesce(sum(wait_s), 0) AS busy_s, sum(seconds) AS seconds
        FROM phases WHERE rank IS NOT NULL AND phase = ANY(?)
        GROUP BY rank, step, phase""", [list(cfg["phases"])])
    if not busy:
        return []
    # the example collective: the one the rank reached latest (one answer whatever the threads)
    late = _q(con, """SELECT rank, step, sum(late_s) AS late_s, first(coll_name ORDER BY late_s DESC NULLS LAST, coll_name) AS coll
                      FROM phase_collectives GROUP BY rank, step""")
    late_by = {(r["rank"], r["step"]): r for r in late}
    # each rank's busy time against its peers' in the same (step, phase): the median of the
    # *other* ranks, exact for few ranks, the all-rank median otherwise
    groups: dict[tuple, list[dict]] = {}
    for r in busy:
        groups.setdefault((r["step"], r["phase"]), []).append(r)
    per: dict[tuple, list[dict]] = {}
    for grp in groups.values():
        if len(grp) < 2:
            continue
        all_med = _median([r["busy_s"] for r in grp])
        for r in grp:
            peer = statistics.median(o["busy_s"] for o in grp if o is not r) if len(grp) <= 4 else all_med
            gap = None if r["busy_s"] is None or peer is None else r["busy_s"] - peer
            flag = gap is not None and gap >= cfg["min_gap_s"] and (peer <= 0 or gap / peer >= cfg["min_rel_gap"])
            per.setdefault((r["rank"], r["phase"]), []).append({**r, "peer_s": peer, "gap_s": gap, "flag": flag})
    out: list[dict] = []
    for (rank, phase), rows in sorted(per.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        hit = [r for r in rows if r["flag"]]
        if len(hit) < cfg["min_steps"] or len(hit) / len(rows) < cfg["min_share_of_steps"]:
            continue
        flagged = sorted(r["step"] for r in hit)
        gap, mine, peer = (_median([r[k] for r in hit]) for k in ("gap_s", "busy_s", "peer_s"))
        sources = _sources(rows)
        detail = (
            f"rank {rank} is slower than its peers in {phase} in {len(flagged)} of {len(rows)} measured steps "
            f"(steps {_fmt_steps(flagged)}): {mine:.2f} s busy vs {peer:.2f} s "
            f"on the median peer, a gap of {gap:.2f} s per step"
        )
        lates = [late_by[(rank, s)]["late_s"] for s in flagged if (rank, s) in late_by]
        if lates:
            coll = next((late_by[(rank, s)]["coll"] for s in flagged if (rank, s) in late_by), None)
            detail += (f"; it reaches the collectives (e.g. {coll}) {statistics.median(lates):.2f} s after the first rank "
                       "(median per step), so the other ranks wait for it")
        detail += f" (source: {', '.join(sources)})"
        out.append({
            "id": "straggler", "rank": rank, "detail": detail, "phase": phase, "steps": flagged,
            "value": round(gap, 4), "source": ", ".join(sources), "evidence": [],
        })
    return out


def _first_max(rows: list[dict], key: str) -> dict:
    """The row with the largest ``key``, the first of equals."""
    return max(rows, key=lambda r: r[key])


def slow_sync_findings(con: duckdb.DuckDBPyConnection, cfg: dict) -> list[dict]:
    steps = _q(con, "SELECT step, source, step_s, sync_s FROM phase_run_steps WHERE step_s > 0 ORDER BY step")
    if not steps:
        return []
    shares = [r["sync_s"] / r["step_s"] for r in steps]
    med_share = statistics.median(shares)
    med_sync = statistics.median(r["sync_s"] for r in steps)
    if med_share < cfg["min_share"] or med_sync < cfg["min_s"]:
        return []
    worst = _first_max([{**r, "share": x} for r, x in zip(steps, shares)], "share")
    sources = ", ".join(_sources(steps))
    return [{
        "id": "slow_weight_sync", "rank": None, "phase": "sync",
        "detail": (f"weight sync takes {med_share:.0%} of the step in the median step ({med_sync:.2f} s of "
                   f"{statistics.median(r['step_s'] for r in steps):.2f} s); worst: step {worst['step']} "
                   f"({worst['share']:.0%}, {worst['sync_s']:.2f} s) (source: {sources})"),
        "steps": [r["step"] for r in steps], "value": round(med_share, 4), "source": sources,
        "evidence": _metric_evidence(con, worst["step"], "(?i)^timing(_s)?/(update_weights|sync)"),
    }]


def _slowest_rank_per_step(per_rank: list[dict]) -> list[tuple[float, int, int]]:
    """``(ratio, step, rank)`` for each step (in order) that has two ranks or more in ``per_rank``
    (step, rank, rollout_s) and whose other ranks' median is above 0: the slowest rank (the
    lowest rank among equals) and its rollout_s over the median of the other ranks."""
    by_step: dict[int, list[dict]] = {}
    for r in per_rank:
        by_step.setdefault(r["step"], []).append(r)
    out = []
    for step in sorted(by_step):
        rows = sorted(by_step[step], key=lambda r: (-r["rollout_s"], r["rank"]))  # slowest first
        if len(rows) < 2:
            continue
        # the median as statistics.median takes it: the mean of the two middle values (one
        # value twice when they are odd in number, which is exact in floating point)
        others = [r["rollout_s"] for r in rows[1:]]
        m = len(others)
        med = (others[(m - 1) // 2] + others[m // 2]) / 2
        if med > 0:
            out.append((rows[0]["rollout_s"] / med, step, rows[0]["rank"]))
    return out


def rollout_tail_findings(con: duckdb.DuckDBPyConnection, cfg: dict) -> list[dict]:
    out: list[dict] = []
    skip = int(cfg.get("skip_first_steps", 0))
    first = _q(con, "SELECT min(step) AS s FROM phase_run_steps")[0]["s"]
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
                "source": ", ".join(_sources(per_rank)), "evidence": [],
            })
    # across steps
    run = _q(con, "SELECT step, rollout_s, step_s, source FROM phase_run_steps WHERE step >= ? AND rollout_s > 0 ORDER BY step",
             [first + skip])
    if len(run) >= 3:
        med = statistics.median(r["rollout_s"] for r in run)
        top = _first_max(run, "rollout_s")
        if med > 0 and top["rollout_s"] / med >= cfg["step_ratio"]:
            long_steps = [r["step"] for r in run if r["rollout_s"] >= cfg["step_ratio"] * med]
            out.append({
                "id": "rollout_long_tail", "rank": None, "phase": "rollout",
                "detail": (f"rollout time has a long tail across steps: step {top['step']} generated for {top['rollout_s']:.2f} s, "
                           f"{top['rollout_s'] / med:.1f}x the median step's {med:.2f} s "
                           f"({len(long_steps)} step(s) at {cfg['step_ratio']}x or more: {_fmt_steps(long_steps)})"),
                "steps": long_steps, "value": round(top["rollout_s"] / med, 3),
                "source": ", ".join(_sources(run)),
                "evidence": _metric_evidence(con, top["step"], "(?i)^timing(_s)?/gen"),
            })
    # within a step: response lengths
    lengths = _q(con, """
        SELECT step, max(value) FILTER (WHERE key = 'response_length/max') AS mx,
               max(value) FILTER (WHERE key = 'response_length/mean') AS mean
        FROM metrics WHERE key IN ('response_length/max', 'response_length/mean') AND step >= ?
        GROUP BY step HAVING mx IS NOT NULL AND mean > 0""", [first + skip])
    if lengths and run:
        med_len_ratio = statistics.median(r["mx"] / r["mean"] for r in lengths)
        share = (statistics.median(r["rollout_s"] / r["step_s"] for r in run)
                 if all(r["step_s"] is not None and r["step_s"] > 0 for r in run) else 0.0)
        if med_len_ratio >= cfg["length_ratio"] and share >= cfg["min_rollout_share"]:
            out.append({
                "id": "rollout_long_tail", "rank": None, "phase": "rollout",
                "detail": (f"generation is dominated by a few long responses: response_length/max is {med_len_ratio:.1f}x "
                           f"response_length/mean in the median step while rollout takes {share:.0%} of the step"),
                "steps": [r["step"] for r in lengths], "value": round(med_len_ratio, 3), "source": "metrics", "evidence": [],
            })
    return out


def step_jump_findings(con: duckdb.DuckDBPyConnection, cfg: dict) -> list[dict]:
    run = _q(con, """SELECT step, step_s, rollout_s, reward_s, train_s, sync_s, other_s, idle_s, source
                     FROM phase_run_steps WHERE step_s IS NOT NULL ORDER BY step""")
    if len(run) < cfg["min_window"] + 1:
        return []
    rows = run
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
    with ph.cached(con, needed=("phases", "phase_collectives", "phase_steps", "phase_run_steps")):
        out = straggler_findings(con, cfg["straggler"])
        out += slow_sync_findings(con, cfg["slow_weight_sync"])
        out += rollout_tail_findings(con, cfg["rollout_long_tail"])
        out += step_jump_findings(con, cfg["step_time_jump"])
    return out
