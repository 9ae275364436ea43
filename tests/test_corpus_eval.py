"""The labelled corpus, scored: top-1 class, evidence location, rank, healthy runs.

Evidence is scored on the *first* evidence line of the top root cause (the stricter of the
two figures forensics.evaluate reports). Skips when ../shared/corpus is absent.
"""
from __future__ import annotations

import json

import pytest

from forensics import diagnose as dg
from forensics import evaluate as ev
from forensics import catalogue as sig


@pytest.fixture(scope="module")
def report(ingested_corpus) -> ev.EvalReport:
    cat = sig.load()
    results = []
    for case, db in ingested_corpus.items():
        label = json.loads((case / "label.json").read_text())
        d = dg.diagnose(db, catalogue=cat)
        r = ev.score(f"{case.parent.name}/{case.name}", label, d)
        r.diagnose_s = d.seconds
        results.append(r)
    rep = ev.EvalReport(results)
    print("\n" + ev.render(rep))
    return rep


def _misses(rep: ev.EvalReport, attr: str) -> str:
    return "; ".join(f"{c.name}: got {c.got} rank {c.rank_got} evidence {c.evidence[:1]}"
                     for c in rep.cases if getattr(c, attr) is False)


def test_top1_class_accuracy(report):
    right, total = report.top1
    assert total >= 40
    assert right / total >= 0.95, _misses(report, "top1")


def test_evidence_located(report):
    right, total = report.evidence_first
    assert right / total >= 0.90, _misses(report, "evidence_first")


def test_rank_where_labelled(report):
    right, total = report.rank
    assert total > 0
    assert right / total >= 0.90, _misses(report, "rank_ok")


def test_no_healthy_run_called_failed(report):
    failed, total = report.healthy_false_failures
    assert total > 0
    assert failed == 0, [c.name for c in report.cases if c.expected == "healthy" and c.got != "healthy"]


def test_diagnosis_is_quick(report):
    assert max(c.diagnose_s for c in report.cases) < 10
