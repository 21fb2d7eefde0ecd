"""The inspect viewer in a real headless browser (Debian's chromium driven by Playwright), on the default model:
type the prompt, run it, and read the heatmap, the massive-activation table and the plots off the page."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("LLAMASCOPE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
# Flags for a closed network: without the background-networking ones chromium keeps dialing out and stalls.
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH: install Debian's `chromium` package (.ci/run does) to run the viewer test")


@pytest.fixture
def page():
    sync_api = pytest.importorskip("playwright.sync_api", reason="the `playwright` package is in the test extra")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 1100})
        finally:
            browser.close()


def test_viewer_shows_heatmap_and_massive_activations(server, page, tmp_path):
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/inspect/ui")
    page.fill("#prompt", "Summer is warm. Winter is cold.\n")
    page.click("#run")
    page.wait_for_selector("#massive tbody tr[data-dim]", timeout=60_000)

    # the massive-activation table: token 0 ("Summer"), dim 507, in blocks 11..27
    rows = page.eval_on_selector_all("#massive tbody tr", "rs => rs.map(r => [...r.cells].map(c => c.textContent))")
    assert {int(r[0]) for r in rows} == set(range(11, 28))
    assert all(r[1] == "0" and r[2] == '"Summer"' and r[3] == "507" and abs(float(r[4])) > 2e4 for r in rows)

    # the heatmap canvas was drawn, with ink in it: count non-white pixels
    assert page.get_attribute("#heatmap", "data-drawn") == "1"
    ink = page.evaluate("""() => {
        const c = document.getElementById('heatmap'), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i] < 250 || d[i + 1] < 250 || d[i + 2] < 250) n++;
        return n; }""")
    assert ink > 1000

    # choosing another layer and head redraws; hovering a cell reads its value
    page.select_option("#layer", "3")
    page.select_option("#head", "2")
    assert "sink" in page.text_content("#map-info")
    box = page.locator("#heatmap").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["width"] * 0.45)
    assert "weight" in page.text_content("#tooltip")
    assert "9 tokens" in page.text_content("#status")

    shot = Path(os.environ.get("LLAMASCOPE_SCREENSHOT_DIR", tmp_path)) / "inspect-viewer.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    assert not errors, errors


def test_viewer_reports_api_errors(server, page):
    page.goto(server.url + "/inspect/ui")
    page.fill("#prompt", "")
    page.click("#run")
    page.wait_for_selector("#status.error", timeout=30_000)
    assert "prompt" in page.text_content("#status")  # the 400 envelope's message, naming the field
