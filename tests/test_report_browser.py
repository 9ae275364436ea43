"""Open the report in a real headless browser (Debian's Chromium driven by Playwright):
it loads without JavaScript errors, the plots render, and markup from the logs stays text.

Needs `apt-get install -y chromium` and `pip install playwright` (no `playwright install`:
the system browser is used). Skips when either is missing.
"""
from __future__ import annotations

import os
import time

import pytest

from forensics import report as rp
from tests.test_report import EVIL_NAME, crafted_diagnosis, xss_db

CHROMIUM = os.environ.get("FORENSICS_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install -y chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def open_report(browser, path):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    page.on("console", lambda msg: errors.append(f"console.{msg.type}: {msg.text}") if msg.type == "error" else None)
    requests: list[str] = []
    page.on("request", lambda req: requests.append(req.url) if not req.url.startswith(("file:", "data:", "about:")) else None)
    t0 = time.perf_counter()
    page.goto(path.as_uri())
    page.wait_for_selector('body[data-report-ready="1"]', state="attached", timeout=30_000)
    return page, errors, requests, time.perf_counter() - t0


def scroll_to_every_plot(page) -> int:
    """Plots that start below the first screen render when scrolled near: scroll to each and
    wait for it. Returns how many plots were still far below the screen (beyond the 300 px
    the page draws ahead) before any scrolling, each checked not drawn yet; a plot within
    those 300 px may already be drawing, so it is not checked (reading its state in two
    steps raced with that drawing)."""
    far = page.evaluate("""() => Array.from(document.querySelectorAll('.plot[data-deferred="1"]'))
        .filter(d => d.getBoundingClientRect().top > window.innerHeight + 300)
        .map(d => [d.id, d.querySelectorAll('svg.main-svg').length, d.getAttribute('data-rendered')])""")
    for plot_id, svgs, rendered in far:
        assert svgs == 0 and rendered != "1", plot_id
    for div in page.locator(".plot").all():
        div.scroll_into_view_if_needed()
        page.wait_for_selector(f'#{div.get_attribute("id")}[data-rendered="1"]', state="attached", timeout=30_000)
    return len(far)


def test_report_renders_and_log_markup_stays_text(browser, tmp_path, monkeypatch):
    db = xss_db(tmp_path)
    crafted_diagnosis(monkeypatch)
    out = tmp_path / "report.html"
    rp.write_report(db, out, title="browser test")
    page, errors, requests, seconds = open_report(browser, out)
    try:
        assert errors == []
        assert requests == []  # nothing fetched: the page is self-contained
        # the timeline renders at once; the plots below the first screen when scrolled to
        assert page.get_attribute("#plot-timeline", "data-rendered") == "1"
        assert page.locator(".plot[data-deferred]").count() >= 1  # the incident card fills the first screen
        assert scroll_to_every_plot(page) >= 1  # one at least was far below, and not drawn until scrolled to
        assert errors == []
        # every plot rendered into SVG, with bars / lines in it
        for div in ("timeline", "steps", "metrics"):
            assert page.get_attribute(f"#plot-{div}", "data-rendered") == "1"
            assert page.locator(f"#plot-{div} svg.main-svg").count() >= 1
        assert page.locator("#plot-timeline .barlayer .point, #plot-timeline .scatterlayer .js-line").count() > 0
        assert page.locator("#plot-steps .barlayer .point").count() > 0
        assert page.locator("#plot-timeline .scatterlayer .point").count() == 3  # evidence markers
        # no injected handler or script ran
        assert page.evaluate("window.__pwned === undefined")
        assert page.title() == "browser test"
        assert page.locator("#incident img, #incident script, #inventory img, #findings img, main svg[onload]").count() == 0
        # ... and the markup is shown as text
        incident = page.inner_text("#incident")
        assert "<script>window.__pwned=1;document.title='pwned'</script>" in incident
        assert "<img src=x onerror=\"window.__pwned=2;document.title='pwned'\">" in incident
        assert EVIL_NAME in page.inner_text("#inventory")
        assert seconds < 15
    finally:
        page.close()


def test_aggregated_report_renders(browser, tmp_path, monkeypatch):
    """The large-run layout (time-bin grid, stacked area per step) renders too."""
    db = xss_db(tmp_path)
    crafted_diagnosis(monkeypatch)
    monkeypatch.setattr(rp, "MAX_SEGMENTS", 10)
    monkeypatch.setattr(rp, "MAX_STEP_BARS", 2)
    out = tmp_path / "big.html"
    rp.write_report(db, out)
    page, errors, requests, _ = open_report(browser, out)
    try:
        assert errors == [] and requests == []
        assert page.locator("#plot-timeline .heatmaplayer image, #plot-timeline .hm image").count() == 1
        # printing draws the plots not scrolled to yet
        assert page.get_attribute("#plot-metrics", "data-deferred") == "1"
        assert page.get_attribute("#plot-metrics", "data-rendered") is None
        page.evaluate("window.dispatchEvent(new Event('beforeprint'))")
        for div in ("steps", "metrics"):
            page.wait_for_selector(f'#plot-{div}[data-rendered="1"]', state="attached", timeout=30_000)
        assert errors == []
        assert page.locator("#plot-steps .scatterlayer .js-fill").count() >= 3
        assert page.evaluate("window.__pwned === undefined")
    finally:
        page.close()


def test_clicking_an_evidence_marker_opens_its_lines(browser, tmp_path, monkeypatch):
    db = xss_db(tmp_path)
    crafted_diagnosis(monkeypatch)
    out = tmp_path / "report.html"
    rp.write_report(db, out)
    page, errors, _, _ = open_report(browser, out)
    try:
        assert page.evaluate("document.getElementById('ctx-e0').open") is False
        marker = page.locator("#plot-timeline .scatterlayer .point").first
        marker.scroll_into_view_if_needed()
        box = marker.bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.wait_for_function("() => Array.from(document.querySelectorAll('details.ctx')).some(d => d.open)", timeout=10_000)
        opened = page.evaluate("Array.from(document.querySelectorAll('details.ctx')).filter(d => d.open).map(d => d.id)")
        assert len(opened) == 1 and opened[0].startswith("ctx-e")
        text = page.inner_text(f"#{opened[0]}")
        assert "trainer-rank1.log:" in text or EVIL_NAME in text
        assert page.evaluate("window.__pwned === undefined") and errors == []
    finally:
        page.close()
