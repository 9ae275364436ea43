"""Metric-trend detectors: training divergence and policy collapse from the `metrics` table.

The thresholds are data (``signatures/metrics.yaml``, section ``metric_detectors``). Each
(file, metric) pair is a series of its own: the same numbers often arrive through several
files (console ``step:N - ...`` lines, ``metrics.jsonl``, per-rank stdout) and an alarm
cites the file and line of the step where the trend crosses into the failure.

Detectors of ``training_divergence``: ``nonfinite`` (NaN/Inf loss, gradient norm, entropy),
``spike`` (gradient norm far above its recent median), ``regime_change`` (a learning-rate
jump followed by the statistics breaking away from their history), ``score_collapse``
(mean score far below its best, sustained). ``policy_collapse``: entropy falling towards
zero from where it started, mostly monotonically, without exploding gradients.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from statistics import median
from typing import Any

SOURCE_PREFERENCE = {"jsonl": 0, "console": 1}


@dataclass
class Alarm:
    cls: str  # taxonomy class (the detector family's `class`)
    detector: str
    step: int
    key: str
    value: float | None
    file_id: int
    line_no: int | None
    path: str
    source: str | None
    detail: str
    ts: Any = None
    also: list[tuple[str, int]] = field(default_factory=list)  # the same step in other files
    weight: float = 0.75  # how specific the evidence is (the family's `weights`)


def _finite(x: float | None) -> bool:
    return x is not None and not math.isnan(x) and not math.isinf(x)


def _keys_regex(patterns: list[str]) -> str:
    return "|".join(f"(?:{p})" for p in patterns)


def _fmt(x: float | None) -> str:
    if x is None:
        return "null"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.4g}"


class Series:
    """One metric from one file: steps ascending, first value per step."""

    def __init__(self, key: str, file_id: int, path: str, source: str | None, rows: list[tuple]):
        self.key, self.file_id, self.path, self.source = key, file_id, path, source
        seen: set[int] = set()
        self.steps: list[int] = []
        self.values: list[float | None] = []
        self.lines: list[int | None] = []
        self.ts: list[Any] = []
        for step, value, line_no, ts in rows:
            if step in seen:
                continue
            seen.add(step)
            self.steps.append(step)
            self.values.append(value)
            self.lines.append(line_no)
            self.ts.append(ts)

    @classmethod
    def from_columns(cls, key: str, file_id: int, path: str, source: str | None, steps: list[int],
                     values: list[float | None], lines: list[int | None], ts: list[Any] | None = None) -> "Series":
        """A series from columns whose steps are already ascending and distinct. Without
        ``ts`` its alarms have no time (:func:`run` looks it up for the alarms it keeps)."""
        s = cls.__new__(cls)
        s.key, s.file_id, s.path, s.source = key, file_id, path, source
        s.steps, s.values, s.lines, s.ts = steps, values, lines, ts
        return s

    def alarm(self, cls: str, detector: str, i: int, detail: str) -> Alarm:
        return Alarm(cls=cls, detector=detector, step=self.steps[i], key=self.key, value=self.values[i],
                     file_id=self.file_id, line_no=self.lines[i], path=self.path, source=self.source,
                     detail=detail, ts=self.ts[i] if self.ts is not None else None)


CHUNK_POINTS = 400_000  # metric points held in Python at a time (memory is bounded by this, not the run)


def _watched_keys(con, patterns: list[str]) -> list[str]:
    if not patterns:
        return []
    rx = re.compile(_keys_regex(patterns))
    return [k for (k,) in con.execute("SELECT DISTINCT key FROM metrics WHERE key IS NOT NULL").fetchall() if rx.search(k)]


def _file_chunks(con, keys: list[str], limit: int) -> list[tuple[int, int]]:
    """Ranges of file ids whose watched points number about ``limit`` or fewer (a file
    with more points is a range of its own)."""
    counts = con.execute(
        f"""SELECT file_id, count(*) FROM metrics WHERE step >= 1 AND key IN ({", ".join("?" for _ in keys)})
            GROUP BY file_id ORDER BY file_id""", keys).fetchall()
    out: list[tuple[int, int]] = []
    lo = hi = None
    n = 0
    for file_id, c in counts:
        if lo is not None and n + c > limit:
            out.append((lo, hi))
            lo, n = None, 0
        if lo is None:
            lo = file_id
        hi, n = file_id, n + c
    if lo is not None:
        out.append((lo, hi))
    return out


def load_series(con, patterns: list[str], keys: list[str] | None = None,
                files: tuple[int, int] | None = None) -> list[Series]:
    """The series of the metrics whose key matches one of ``patterns`` (or is in
    ``keys``), of all files or of the file ids in the range ``files``."""
    if keys is None:
        keys = _watched_keys(con, patterns)
    if not keys:
        return []
    # first value of each (file, key, step): a file that repeats a step (several ranks,
    # a resumed run) keeps the earliest line. No timestamps: millions of datetime objects
    # would double the memory, and only the few alarms kept need theirs (_alarm_times)
    where = "" if files is None else f" AND file_id BETWEEN {int(files[0])} AND {int(files[1])}"
    # the steps of a (file, key) are distinct and ascending (one row per step, then listed in order)
    grouped = con.execute(
        f"""WITH p AS (SELECT file_id, source, key, step, arg_min(value, line_no) AS value, min(line_no) AS line_no
                       FROM metrics WHERE step >= 1 AND key IN ({", ".join("?" for _ in keys)}){where}
                       GROUP BY ALL)
            SELECT file_id, source, key, list(step ORDER BY step), list(value ORDER BY step), list(line_no ORDER BY step)
            FROM p GROUP BY file_id, source, key ORDER BY file_id, key, min(step), source""", keys).fetchall()
    ids = sorted({g[0] for g in grouped})
    paths = dict(con.execute(f"SELECT file_id, path FROM files WHERE file_id IN ({', '.join(map(str, ids)) or 'NULL'})").fetchall())
    return [Series.from_columns(key, file_id, paths[file_id], source, steps, values, lines)
            for file_id, source, key, steps, values, lines in grouped]


def _alarm_times(con, alarms: list[Alarm]) -> None:
    """The time of the metrics line each alarm points at (when the line has one)."""
    for a in alarms:
        if a.ts is None and a.line_no is not None:
            row = con.execute("SELECT min(ts) FROM metrics WHERE file_id = ? AND line_no = ? AND key = ? AND step = ?",
                              [a.file_id, a.line_no, a.key, a.step]).fetchone()
            a.ts = row[0] if row else None


def _matching(series: list[Series], patterns: list[str]) -> list[Series]:
    rxs = [re.compile(p) for p in patterns]
    keys = {s.key for s in series}  # a few hundred names across thousands of series
    wanted = {k for k in keys if any(r.search(k) for r in rxs)}
    return [s for s in series if s.key in wanted]


# -- training divergence ----------------------------------------------------------------

def nonfinite(series: list[Series], conf: dict) -> list[Alarm]:
    out = []
    for s in _matching(series, conf.get("nonfinite_keys") or []):
        for i, v in enumerate(s.values):
            if v is not None and (math.isnan(v) or math.isinf(v)):
                out.append(s.alarm(conf.get("class"), "nonfinite", i, f"{s.key} is {_fmt(v)} at step {s.steps[i]}"))
                break
    return out


def spike(series: list[Series], conf: dict) -> list[Alarm]:
    if not conf:
        return []
    factor, window, min_hist = float(conf["factor"]), int(conf["window"]), int(conf["min_history"])
    sustain = int(conf.get("sustain", 1))
    out = []
    for s in _matching(series, conf.get("keys") or []):
        hist: list[float] = []
        for i, v in enumerate(s.values):
            if not _finite(v):
                continue
            if len(hist) >= min_hist:
                m = median(hist[-window:])
                if m > 0 and v >= factor * m:
                    after = [x for x in s.values[i + 1:i + 1 + window] if x is not None]
                    held = len(after) >= sustain - 1 and all(_finite(x) and x >= factor * m for x in after[:sustain - 1])
                    blew_up = any(not _finite(x) for x in after)
                    if held or blew_up:
                        out.append(s.alarm(conf.get("class"), "spike", i,
                                           f"{s.key} = {_fmt(v)} at step {s.steps[i]}, {v / m:.0f}x its recent median {_fmt(m)}"))
                        break
                    continue  # a lone spike that recovered: not part of the history either
            hist.append(v)
    return out


def _by_file(series: list[Series]) -> dict[int, list[Series]]:
    out: dict[int, list[Series]] = {}
    for s in series:
        out.setdefault(s.file_id, []).append(s)
    return out


def _mad(xs: list[float]) -> float:
    m = median(xs)
    return median([abs(x - m) for x in xs])


def regime_change(series: list[Series], conf: dict) -> list[Alarm]:
    if not conf:
        return []
    f = float(conf["trigger_factor"])
    within, base_n = int(conf["within"]), int(conf["baseline"])
    min_rel, min_z = float(conf["min_relative"]), float(conf["min_z"])
    watch = _by_file(_matching(series, conf.get("watch_keys") or []))
    out = []
    for trig in _matching(series, conf.get("trigger_keys") or []):
        for i in range(1, len(trig.values)):
            a, b = trig.values[i - 1], trig.values[i]
            if not (_finite(a) and _finite(b)) or a <= 0 or b <= 0:
                continue
            if max(a, b) / min(a, b) < f:
                continue
            t_step = trig.steps[i]
            best: Alarm | None = None
            for w in watch.get(trig.file_id, ()):
                base = [v for st, v in zip(w.steps, w.values) if t_step - base_n <= st < t_step and _finite(v)]
                if len(base) < 3:
                    continue
                bm, mad = median(base), _mad(base)
                scale = max(1.4826 * mad, 1e-12)
                for j, (st, v) in enumerate(zip(w.steps, w.values)):
                    if not (t_step < st <= t_step + within) or not _finite(v):
                        continue
                    rel = abs(v - bm) / abs(bm) if bm else math.inf
                    if rel >= min_rel and abs(v - bm) / scale >= min_z:
                        if best is None or st < best.step:
                            best = w.alarm(conf.get("class"), "regime_change", j,
                                           f"{trig.key} jumped {max(a, b) / min(a, b):.0f}x at step {t_step} ({_fmt(a)} -> {_fmt(b)}); "
                                           f"at step {st} {w.key} = {_fmt(v)} vs {_fmt(bm)} before")
                        break
            if best is not None:
                out.append(best)
            break  # the first large jump of this series is the one that matters
    return out


def score_collapse(series: list[Series], conf: dict) -> list[Alarm]:
    if not conf:
        return []
    window, drop, sustain, min_best = int(conf["window"]), float(conf["drop"]), int(conf["sustain"]), float(conf["min_best"])
    out = []
    for s in _matching(series, conf.get("keys") or []):
        vals = [(i, v) for i, v in enumerate(s.values) if _finite(v)]
        if len(vals) <= window:
            continue
        # exact shortcut: the best median is at most the largest value, so a series whose
        # later values all stay above (1 - drop) x its largest value cannot collapse
        hi = max(v for _, v in vals)
        if sustain >= 1 and 0 <= drop <= 1 and (
                hi < min_best or hi <= 0 or min(v for _, v in vals[window:]) > (1 - drop) * hi):
            continue
        best = -math.inf
        for k in range(len(vals)):
            if k >= window:
                best = max(best, median([v for _, v in vals[k - window:k]]))
            if best < min_best or best <= 0:
                continue
            thr = (1 - drop) * best
            run = vals[k:k + sustain]
            if len(run) == sustain and all(v <= thr for _, v in run):
                i = vals[k][0]
                out.append(s.alarm(conf.get("class"), "score_collapse", i,
                                   f"{s.key} fell to {_fmt(vals[k][1])} at step {s.steps[i]} from a best of {_fmt(best)} and stayed down"))
                break
    return out


# -- policy collapse ---------------------------------------------------------------------------

def entropy_collapse(series: list[Series], conf: dict) -> list[Alarm]:
    if not conf:
        return []
    floor, start_min, max_frac = float(conf["floor"]), float(conf["start_min"]), float(conf["max_fraction"])
    window, monotone = int(conf["window"]), float(conf["monotone"])
    gfactor = float(conf.get("grad_norm_factor", 10))
    grads = _by_file(_matching(series, conf.get("grad_norm_keys") or []))
    out = []
    for s in _matching(series, conf.get("entropy_keys") or []):
        if any(v is not None and not _finite(v) for v in s.values):
            continue  # NaN/Inf entropy is divergence, not collapse
        vals = [(i, v) for i, v in enumerate(s.values) if v is not None]
        if len(vals) < window + 2 or min(v for _, v in vals) >= floor:  # never below the floor
            continue
        start = median([v for _, v in vals[:window]])
        if start < start_min:
            continue
        for k, (i, v) in enumerate(vals):
            if v < floor and v <= max_frac * start:
                prior = [b for _, b in vals[:k + 1]]
                steps = list(zip(prior, prior[1:]))
                downs = sum(1 for a, b in steps if b < a)
                if steps and downs / len(steps) < monotone:
                    break
                exploding = False
                for g in grads.get(s.file_id, ()):
                    gv = [x for x in g.values if _finite(x)]
                    if len(gv) > window and max(gv) > gfactor * median(gv[:window]):
                        exploding = True
                if exploding:
                    break
                out.append(s.alarm(conf.get("class"), "entropy_collapse", i,
                                   f"{s.key} fell to {_fmt(v)} at step {s.steps[i]} from {_fmt(start)} at the start"))
                break
    return out


DIVERGENCE = (("nonfinite", nonfinite), ("spike", spike), ("regime_change", regime_change), ("score_collapse", score_collapse))


def run(con, settings: dict[str, Any]) -> list[Alarm]:
    """All alarms, one per (detector, series) at most, the preferred file's first."""
    div = settings.get("divergence") or {}
    col = settings.get("entropy") or {}
    patterns: list[str] = []
    patterns += div.get("nonfinite_keys") or []
    for name in ("spike", "score_collapse"):
        patterns += (div.get(name) or {}).get("keys") or []
    rc = div.get("regime_change") or {}
    patterns += (rc.get("trigger_keys") or []) + (rc.get("watch_keys") or [])
    patterns += (col.get("entropy_keys") or []) + (col.get("grad_norm_keys") or [])
    keys = _watched_keys(con, patterns)
    if not keys:
        return []
    alarms: list[Alarm] = []
    # every detector looks at one series, or at the series of one file, so the files are
    # taken a chunk at a time and memory does not grow with the run
    for files in _file_chunks(con, keys, CHUNK_POINTS):
        series = load_series(con, patterns, keys, files)
        # each detector's settings carry the family's class
        alarms += nonfinite(series, div)
        alarms += spike(series, _with_class(div.get("spike"), div))
        alarms += regime_change(series, _with_class(rc, div))
        alarms += score_collapse(series, _with_class(div.get("score_collapse"), div))
        alarms += entropy_collapse(series, col)
        del series
    alarms.sort(key=lambda a: (a.step, SOURCE_PREFERENCE.get(a.source or "", 9), a.path))
    # one alarm per detector: its earliest step, from the preferred kind of file
    first: dict[tuple[str, str], Alarm] = {}
    for a in alarms:
        first.setdefault((a.cls, a.detector), a)
    alarms = list(first.values())
    for a in alarms:  # how specific each detector's evidence is
        family = div if a.cls == div.get("class") and a.detector in (div.get("weights") or {}) else col
        a.weight = float((family.get("weights") or {}).get(a.detector, 0.75))
    _corroborate(con, alarms)
    _alarm_times(con, alarms)
    _step_times(con, alarms)
    return alarms


def _with_class(conf: dict | None, family: dict) -> dict:
    """A detector's settings with its family's class (empty settings: the detector is off)."""
    return {**conf, "class": family.get("class")} if conf else {}


def _corroborate(con, alarms: list[Alarm]) -> None:
    """Same-step lines of the same metric in other files corroborate an alarm (the first
    line of that step in each (file, source) series, in file order)."""
    for a in alarms:
        rows = con.execute(
            """SELECT f.path, min(m.line_no) FROM metrics m JOIN files f USING (file_id)
               WHERE m.key = ? AND m.step = ? AND m.file_id <> ?
               GROUP BY m.file_id, m.source, f.path HAVING min(m.line_no) IS NOT NULL
               ORDER BY m.file_id, m.source""", [a.key, a.step, a.file_id]).fetchall()
        a.also.extend((path, line) for path, line in rows)


def _step_times(con, alarms: list[Alarm]) -> None:
    """Give alarms without a time the time of a console line of the same step, if any, so
    they can be ordered against log evidence."""
    need = sorted({a.step for a in alarms if a.ts is None})
    if not need:
        return
    rows = con.execute(
        f"""SELECT m.step, min(l.ts) FROM metrics m JOIN lines l ON l.file_id = m.file_id AND l.line_no = m.line_no
            WHERE m.step IN ({", ".join(str(int(s)) for s in need)}) AND l.ts IS NOT NULL GROUP BY m.step""").fetchall()
    when = dict(rows)
    for a in alarms:
        if a.ts is None:
            a.ts = when.get(a.step)
