"""The post-mortem HTML report (forensics/report.py) without a browser: content, escaping,
aggregation of large timelines, the `forensics report` command."""
from __future__ import annotations

import json
import re
import shutil
import sys
import threading
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from forensics import report as rp
from forensics.cli import app
from tests.test_phases import FIXTURES, build_db

PAYLOADS = ("<script>window.__pwned=1", "<img src=x onerror=")
EVIL_NAME = "evil<img src=x onerror=window.__pwned=3>.log"


def xss_db(tmp_path: Path) -> Path:
    """The straggler fixture plus a log whose ERROR lines carry HTML/JS, and a file whose name does."""
    evil = tmp_path / "extra" / EVIL_NAME
    evil.parent.mkdir()
    evil.write_text("2026-01-01 00:00:04,900 ERROR [rank0] trainer: <svg onload=window.__pwned=4>\n")
    return build_db(tmp_path, "phase_straggler", extra=[FIXTURES / "report_xss" / "trainer-rank1.log", evil])


def crafted_diagnosis(monkeypatch) -> dict:
    """A diagnosis in the contract's shape whose every text field carries markup."""
    lines = (FIXTURES / "report_xss" / "trainer-rank1.log").read_text().splitlines()
    diag = {
        "verdict": "failed",
        "root_causes": [{
            "id": "reward_error<b>", "confidence": 0.9, "rank": 1, "node": "<i>node</i>", "phase": "reward", "step": 3,
            "title": "bad <u>reward</u>", "summary": "summary <script>window.__pwned=5</script>",
            "evidence": [{"file": "trainer-rank1.log", "line": 2, "text": lines[1]},
                         {"file": "trainer-rank1.log", "line": 3, "text": lines[2]},
                         {"file": EVIL_NAME, "line": 1, "text": "<svg onload=window.__pwned=4>"}],
            "symptoms": ["nccl_timeout<script>"], "cascade": ["rank 1 <b>fails</b>", "rank 0 waits"],
            "remediation": ["set x: 1 -> 2 <img src=y onerror=window.__pwned=6>"],
        }],
        "findings": [{"id": "custom", "rank": None, "detail": "detail <img src=z onerror=window.__pwned=7>"}],
        "notes": ["note <script>window.__pwned=8</script>"],
    }
    monkeypatch.setattr(rp, "_diagnosis", lambda con: (diag, None))
    return diag


def embedded_data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    assert m, "report data block missing"
    return json.loads(m.group(1))


def test_script_json_cannot_close_the_script():
    text = rp.script_json({"a": "</script><img src=x onerror=alert(1)>&\u2028", "n": float("nan")})
    assert not set("<>&") & set(text) and "\u2028" not in text
    assert json.loads(text) == {"a": "</script><img src=x onerror=alert(1)>&\u2028", "n": None}


def test_report_escapes_every_log_text(tmp_path, monkeypatch):
    db = xss_db(tmp_path)
    crafted_diagnosis(monkeypatch)
    out = tmp_path / "r.html"
    result = rp.write_report(db, out)
    page = out.read_text()
    assert result.bytes == len(page.encode()) and result.bytes < 15e6
    # no raw markup from the logs, the diagnosis or file names
    for raw in ("<script>window.__pwned", "<img src=x onerror", "<svg onload", "<img src=y", "<img src=z",
                "<b>fails", "<i>node", "<u>reward", "</pre></section>"):
        assert raw not in page, raw
    assert "&lt;img src=x onerror=&quot;window.__pwned=2" in page  # the evidence line, as text
    assert html_escaped(EVIL_NAME) in page  # the inventory row
    # self-contained: no external scripts, styles or frames
    assert not re.search(r"<(script|link|iframe|img)[^>]+(src|href)=", page, re.I)
    data = embedded_data(page)
    timeline = data["figures"]["timeline"]
    names = [t.get("name") for t in timeline["data"]]
    assert {"rollout", "train", "GPU kernels", "NCCL kernels", "evidence"} <= set(names)
    ev = next(t for t in timeline["data"] if t["name"] == "evidence")
    assert len(ev["x"]) == 3 and all("<" not in h for h in ev["hovertext"])
    lanes = timeline["layout"]["yaxis"]["ticktext"]
    assert lanes[:3] == ["run", "rank 0", "rank 0 GPU"] and "rank 1 GPU" in lanes
    assert data["figures"]["steps"]["layout"]["shapes"][0]["x0"] == 3  # failure step marked
    assert data["figures"]["metrics"]["layout"]["annotations"][-1]["text"] == "failure step 3"


def html_escaped(text: str) -> str:
    import html

    return html.escape(text, quote=True)


def test_report_without_diagnose_module_lists_error_lines(tmp_path, monkeypatch):
    db = xss_db(tmp_path)
    monkeypatch.setitem(sys.modules, "forensics.diagnose", None)  # `import` raises ImportError
    import forensics

    # `from . import diagnose` also finds the submodule as an attribute of the package once
    # another test imported it: hide that too, so the test does not depend on test order
    monkeypatch.delattr(forensics, "diagnose", raising=False)
    page, result = rp.build(__import__("duckdb").connect(str(db), read_only=True))
    assert any("diagnosis unavailable" in n for n in result.notes)
    assert "Error lines in the logs" in page and "&lt;script&gt;window.__pwned=1" in page
    assert "<script>window.__pwned" not in page
    assert embedded_data(page)["figures"]["steps"] is not None


def test_large_timelines_become_a_grid():
    n = 200_000
    spans = pl.DataFrame({
        "lane": [f"rank {i % 64}" for i in range(n)],
        "kind": [["rollout", "train", "sync", "idle"][(i // 64) % 4] for i in range(n)],
        "start_us": [float(i // 64) * 250.0 for i in range(n)],
        "end_us": [float(i // 64) * 250.0 + 240.0 for i in range(n)],
    })
    lanes = [f"rank {i}" for i in range(64)] + ["rank 99"]
    kinds = ["rollout", "train", "sync", "idle"]
    rows, width = rp._grid(spans, lanes, kinds, 0.0, spans["end_us"].max(), 1000)
    assert len(rows) == 65 and all(len(r) == 1000 for r in rows)
    assert width == pytest.approx(spans["end_us"].max() / 1000)
    assert rows[-1] == "." * 1000  # a lane with nothing (an evidence-only lane)
    # each bin spans ~3 cycles of the 4 kinds, 250 µs each: the dominant one wins, never a gap
    assert set(rows[0]) <= set("abcd") and len(set(rows[0])) > 1
    # one long span covering everything wins every bin of its lane
    long = pl.DataFrame({"lane": ["rank 0"], "kind": ["sync"], "start_us": [0.0], "end_us": [spans["end_us"].max()]})
    rows, _ = rp._grid(long, ["rank 0"], kinds, 0.0, spans["end_us"].max(), 100)
    assert rows == ["c" * 100]


@pytest.mark.parametrize("max_segments, fetched", [(10, False), (41, True)], ids=["grid-in-db", "grid-of-fetched-spans"])
def test_large_report_is_aggregated_and_says_so(tmp_path, monkeypatch, max_segments, fetched):
    """The fixture has 41 phase spans (36 measured, and the untimed part of each of its 5 metric
    steps) and 24 GPU events. Beyond MAX_SEGMENTS phase spans the
    grid is computed in the database; with fewer, but too many together with the GPU bars, the
    fetched spans are gridded."""
    db = build_db(tmp_path, "phase_straggler")
    monkeypatch.setattr(rp, "MAX_SEGMENTS", max_segments)
    monkeypatch.setattr(rp, "MAX_STEP_BARS", 2)
    fetches = []
    spans = rp._timeline_spans
    monkeypatch.setattr(rp, "_timeline_spans", lambda con: fetches.append(1) or spans(con))
    out = tmp_path / "big.html"
    result = rp.write_report(db, out)
    page = out.read_text()
    assert bool(fetches) == fetched
    assert result.aggregated and "aggregated into bins" in page and result.spans == 41 + 24
    figs = embedded_data(page)["figures"]
    heat = [t for t in figs["timeline"]["data"] if t["type"] == "heatmap"]
    lanes = figs["timeline"]["layout"]["yaxis"]["ticktext"]
    assert len(heat) == 1 and len(heat[0]["_zrows"]) == len(lanes)
    # every lane with spans has cells: phases on the rank lanes, GPU activity on the GPU lanes
    kinds = heat[0]["colorbar"]["ticktext"]
    for lane, cells in zip(lanes, heat[0]["_zrows"]):
        drawn = {kinds[ord(c) - 97] for c in set(cells) - {"."}}
        assert drawn and (drawn <= {"GPU kernels", "NCCL kernels"}) == lane.endswith("GPU"), (lane, drawn)
    assert {t["type"] for t in figs["steps"]["data"]} == {"scatter"}  # stacked area, not thousands of bars


def test_cli_report(tmp_path):
    db = build_db(tmp_path, "phase_ray")
    out = tmp_path / "out" / "report.html"
    res = CliRunner().invoke(app, ["report", "--db", str(db), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert out.exists() and "wrote" in res.output
    data = embedded_data(out.read_text())
    assert [t["name"] for t in data["figures"]["steps"]["data"]][:2] == ["rollout", "rollout/logprob"]
    res = CliRunner().invoke(app, ["report", "--db", str(tmp_path / "missing.duckdb"), "-o", str(out)])
    assert res.exit_code == 2 and "no database" in res.output


def test_api_report(tmp_path):
    from forensics.api import Run

    db = build_db(tmp_path, "phase_straggler")
    with Run(db) as run:
        result = run.report(tmp_path / "api.html")
    assert Path(result.path).exists() and result.segments > 0
    shutil.rmtree(tmp_path / "run")


def test_every_evidence_line_opens_its_context(tmp_path, monkeypatch):
    """Each evidence line in the card folds out the lines around it (file:line, the cited line
    marked, all of it escaped), and each evidence marker on the timeline names that element."""
    db = xss_db(tmp_path)
    crafted_diagnosis(monkeypatch)
    out = tmp_path / "r.html"
    rp.write_report(db, out)
    page = out.read_text()
    blocks = dict(re.findall(r'<details class="ctx" id="(ctx-e\d+)">(.*?)</details>', page, re.S))
    assert set(blocks) == {"ctx-e0", "ctx-e1", "ctx-e2"}
    first = blocks["ctx-e0"]
    assert "<summary>trainer-rank1.log:2 — lines 1–4 of the file</summary>" in first
    # the neighbours are there, the cited line is marked, hostile text stays text
    assert "loading batch" in first and "continuing" in first
    assert re.search(r"<mark>2  [^<]*reward fn rejected sample &lt;script&gt;window.__pwned=1", first)
    assert "&lt;img src=x onerror=&quot;window.__pwned=2" in first and "<img" not in first and "</pre></section>" not in first
    assert f"{html_escaped(EVIL_NAME)}:1" in blocks["ctx-e2"]
    ev = next(t for t in embedded_data(page)["figures"]["timeline"]["data"] if t["name"] == "evidence")
    assert ev["customdata"] == ["ctx-e0", "ctx-e1", "ctx-e2"]
    assert "openContext(pt.customdata)" in page  # a click on a marker opens it


def test_diagnosis_first_on_a_big_database_gives_the_same_page(tmp_path, monkeypatch):
    """Over PARALLEL_DIAGNOSIS_MAX_LINES lines the diagnosis runs before the phase views
    instead of beside them (memory: bench/bench_memory.py): the page says the same."""
    import duckdb

    from forensics.store import DB_MEMORY, REPORT_DB_MEMORY

    monkeypatch.delenv("FORENSICS_DB_MEMORY", raising=False)
    db = build_db(tmp_path, "phase_straggler")
    calls = []
    real = rp._diagnosis

    def diagnosis(con):
        limit = con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]
        calls.append((threading.current_thread().name.startswith("forensics-report"), limit))
        return real(con)

    monkeypatch.setattr(rp, "_diagnosis", diagnosis)
    pages = {}
    for limit in (10**9, 0):
        monkeypatch.setattr(rp, "PARALLEL_DIAGNOSIS_MAX_LINES", limit)
        out = tmp_path / f"r{limit}.html"
        rp.write_report(db, out)
        # the page's generation time is the one thing allowed to differ
        pages[limit] = re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", "TIME", out.read_text())
    # beside the phase views in a thread, then first, on the caller's thread and under the
    # diagnosis' own DuckDB limit (the report's is given back for the phase views)
    probe = duckdb.connect()
    limits = []
    for value in (REPORT_DB_MEMORY, DB_MEMORY):
        probe.execute("SET memory_limit = ?", [value])
        limits.append(probe.execute("SELECT current_setting('memory_limit')").fetchall()[0][0])
    assert calls == [(True, limits[0]), (False, limits[1])]
    assert "root cause" in pages[0].lower()
    assert pages[0] == pages[10**9]
