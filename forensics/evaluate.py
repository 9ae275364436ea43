"""Corpus evaluation: ingest every labelled bundle, diagnose it, score it against its label.

    python -m forensics.evaluate ../shared/corpus [--work DIR] [--json]
    forensics evaluate ../shared/corpus

A bundle is a folder with a ``label.json`` (``../shared/corpus/README.md``); the label file
itself is never ingested. Figures:

* **top-1**: the first root cause's class equals ``root_cause`` (``healthy`` when the
  verdict is healthy);
* **evidence (first)**: the first evidence line of the top root cause is in the labelled
  file within +-3 lines of ``first_failure`` or of an ``also_accept`` entry; **evidence
  (any)** accepts any evidence line of the top root cause. The first figure is the one the
  tests hold to;
* **rank**: the root cause's rank equals ``rank``, over the labels that name one;
* **healthy false failures**: healthy bundles diagnosed as failed;
* **failures called healthy**: failed bundles diagnosed healthy or incomplete (a crash
  must never pass for a healthy run).

A verdict ``incomplete`` (no failure found, no end-of-run marker) counts as right for a
healthy label: the logs show no failure, and say they may not be whole.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from . import diagnose as dg
from .diagnosis.model import HEALTHY, INCOMPLETE
from . import pipeline

LINE_TOLERANCE = 3
NOT_FAILED = (HEALTHY, INCOMPLETE)  # verdicts of a diagnosis that found no failure


@dataclass
class CaseResult:
    name: str
    expected: str
    got: str
    top1: bool
    evidence_first: bool | None = None  # None: the label has no first_failure (healthy)
    evidence_any: bool | None = None
    rank_expected: int | None = None
    rank_got: int | None = None
    rank_ok: bool | None = None  # None: the label names no rank
    phase_expected: str | None = None
    phase_got: str | None = None
    evidence: list[dict] = field(default_factory=list)
    wanted: list[dict] = field(default_factory=list)
    ingest_s: float = 0.0
    diagnose_s: float = 0.0
    error: str | None = None


@dataclass
class EvalReport:
    cases: list[CaseResult]

    def _rate(self, values: Iterable[bool | None]) -> tuple[int, int]:
        vals = [v for v in values if v is not None]
        return sum(1 for v in vals if v), len(vals)

    @property
    def top1(self) -> tuple[int, int]:
        return self._rate(c.top1 for c in self.cases)

    @property
    def evidence_first(self) -> tuple[int, int]:
        return self._rate(c.evidence_first for c in self.cases)

    @property
    def evidence_any(self) -> tuple[int, int]:
        return self._rate(c.evidence_any for c in self.cases)

    @property
    def rank(self) -> tuple[int, int]:
        return self._rate(c.rank_ok for c in self.cases)

    @property
    def healthy_false_failures(self) -> tuple[int, int]:
        healthy = [c for c in self.cases if c.expected == HEALTHY]
        return sum(1 for c in healthy if c.got not in NOT_FAILED), len(healthy)

    @property
    def failures_called_healthy(self) -> tuple[int, int]:
        failed = [c for c in self.cases if c.expected != HEALTHY]
        return sum(1 for c in failed if c.got in NOT_FAILED), len(failed)

    @property
    def phase(self) -> tuple[int, int]:
        return self._rate(c.phase_got == c.phase_expected if c.phase_expected else None for c in self.cases)

    def to_dict(self) -> dict:
        def frac(t: tuple[int, int]) -> dict:
            return {"right": t[0], "of": t[1], "rate": round(t[0] / t[1], 4) if t[1] else None}

        return {
            "summary": {
                "cases": len(self.cases),
                "top1": frac(self.top1),
                "evidence_first": frac(self.evidence_first),
                "evidence_any": frac(self.evidence_any),
                "rank": frac(self.rank),
                "phase": frac(self.phase),
                "healthy_false_failures": {"failed": self.healthy_false_failures[0], "of": self.healthy_false_failures[1]},
                "failures_called_healthy": {"not_failed": self.failures_called_healthy[0], "of": self.failures_called_healthy[1]},
                "diagnose_seconds_max": round(max((c.diagnose_s for c in self.cases), default=0.0), 3),
            },
            "cases": [asdict(c) for c in self.cases],
        }


def bundles(corpus_dir: str | os.PathLike) -> list[Path]:
    """Every folder under ``corpus_dir`` that holds a label.json, sorted."""
    root = Path(corpus_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"no corpus folder at {root}")
    return sorted(p.parent for p in root.rglob("label.json"))


def _near(ev: dict, wanted: list[dict]) -> bool:
    return any(ev.get("file") == w.get("file") and ev.get("line") is not None and w.get("line") is not None
               and abs(int(ev["line"]) - int(w["line"])) <= LINE_TOLERANCE for w in wanted)


def score(name: str, label: dict[str, Any], diagnosis: dg.Diagnosis) -> CaseResult:
    """Compare one diagnosis with its label."""
    top = diagnosis.root_causes[0] if diagnosis.root_causes else None
    got = top.id if top else diagnosis.verdict  # healthy / incomplete
    expected = label["root_cause"]
    ff = label.get("first_failure")
    wanted = ([ff] if ff else []) + list(label.get("also_accept") or [])
    right = got == expected or (expected == HEALTHY and got in NOT_FAILED)
    res = CaseResult(name=name, expected=expected, got=got, top1=right,
                     rank_expected=label.get("rank"), phase_expected=label.get("phase"), wanted=wanted)
    if top is not None:
        res.rank_got, res.phase_got = top.rank, top.phase
        res.evidence = [e.to_dict() for e in top.evidence]
    if ff:
        evs = res.evidence
        res.evidence_first = bool(evs) and _near(evs[0], wanted)
        res.evidence_any = any(_near(e, wanted) for e in evs)
    if label.get("rank") is not None:
        res.rank_ok = top is not None and top.rank == label["rank"]
    return res


def evaluate(corpus_dir: str | os.PathLike, work_dir: str | os.PathLike | None = None,
             signature_dirs: Iterable[str] = (), only: Iterable[str] = ()) -> EvalReport:
    """Ingest (fresh) and diagnose every labelled bundle of ``corpus_dir``."""
    from . import catalogue as sig

    cat = sig.load(signature_dirs)
    only = list(only)
    own_tmp = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="forensics-eval-")) if own_tmp else Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    root = Path(corpus_dir)
    results: list[CaseResult] = []
    try:
        for case in bundles(root):
            name = str(case.relative_to(root)).replace(os.sep, "/")
            if only and not any(o in name for o in only):
                continue
            label = json.loads((case / "label.json").read_text())
            db = work / (name.replace("/", "-") + ".duckdb")
            for p in (db, Path(str(db) + ".wal")):
                if p.exists():
                    p.unlink()
            t0 = time.perf_counter()
            pipeline.ingest([str(case)], str(db), workers=1, exclude=["label.json"])
            t1 = time.perf_counter()
            d = dg.diagnose(db, catalogue=cat)
            if isinstance(d, dg.RunDiagnoses):  # a labelled bundle is one run: found as several, it is scored wrong
                seconds = d.seconds
                d = dg.Diagnosis(f"split into {len(d.runs)} runs", [], [], notes=[r.name for r, _, _ in d.runs])
                d.seconds = seconds
            res = score(name, label, d)
            res.ingest_s, res.diagnose_s = round(t1 - t0, 3), round(d.seconds, 3)
            results.append(res)
    finally:
        if own_tmp:
            shutil.rmtree(work, ignore_errors=True)
    return EvalReport(results)


def render(report: EvalReport) -> str:
    lines = []
    for c in report.cases:
        flags = []
        if not c.top1:
            flags.append(f"class {c.got} (want {c.expected})")
        if c.evidence_first is False:
            first = c.evidence[0] if c.evidence else {}
            want = ", ".join(f"{w.get('file')}:{w.get('line')}" for w in c.wanted[:3])
            flags.append(f"evidence {first.get('file')}:{first.get('line')} (want {want})")
        if c.rank_ok is False:
            flags.append(f"rank {c.rank_got} (want {c.rank_expected})")
        mark = "ok  " if not flags else "MISS"
        lines.append(f"{mark} {c.name:55s} {c.got:20s} {c.diagnose_s:6.2f}s  {'; '.join(flags)}")

    def pct(t: tuple[int, int]) -> str:
        return f"{t[0]}/{t[1]} ({100 * t[0] / t[1]:.1f}%)" if t[1] else "n/a"

    hf = report.healthy_false_failures
    lines += [
        "",
        f"top-1 class accuracy   {pct(report.top1)}",
        f"evidence located       {pct(report.evidence_first)} first evidence line; {pct(report.evidence_any)} any evidence line (+-{LINE_TOLERANCE} lines of first_failure / also_accept)",
        f"rank right             {pct(report.rank)} of the labels that name a rank",
        f"phase right            {pct(report.phase)}",
        f"healthy called failed  {hf[0]} of {hf[1]}",
        f"failed called healthy  {report.failures_called_healthy[0]} of {report.failures_called_healthy[1]} (verdict healthy or incomplete)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m forensics.evaluate", description=__doc__.split("\n")[0])
    ap.add_argument("corpus_dir")
    ap.add_argument("--work", help="folder for the per-bundle databases (default: temporary)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--signatures", action="append", default=[], help="extra signature folder (repeatable)")
    ap.add_argument("--only", action="append", default=[], help="only bundles whose name contains this (repeatable)")
    a = ap.parse_args(argv)
    rep = evaluate(a.corpus_dir, a.work, a.signatures, a.only)
    print(json.dumps(rep.to_dict(), indent=2, default=str) if a.json else render(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
