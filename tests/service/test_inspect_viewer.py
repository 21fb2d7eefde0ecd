"""The inspect viewer in a real headless browser (Debian's chromium driven by Playwright), on the default model:
type the prompt, run it, and read the heatmap, its colour legend, the massive-activation table and the plots off
the page.

The README's screenshot (docs/images/viewer.png) is taken here, and the patching, attribution and features tabs'
(docs/images/patching.png, attribution.png, features.png). Every run writes a fresh one to the artifacts
folder; UPDATE_SCREENSHOTS=1 also replaces the committed image and its sidecar (viewer.png.json), which records a
hash of the viewer's sources that produced it. `test_committed_screenshot_is_current` (no browser needed) fails when
those sources changed and the image was not taken again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "service" / "microscope" / "static"
SCREENSHOT = ROOT / "docs" / "images" / "viewer.png"
SIDECAR = SCREENSHOT.with_name(SCREENSHOT.name + ".json")
PATCH_SCREENSHOT = ROOT / "docs" / "images" / "patching.png"
PATCH_SIDECAR = PATCH_SCREENSHOT.with_name(PATCH_SCREENSHOT.name + ".json")
ATTR_SCREENSHOT = ROOT / "docs" / "images" / "attribution.png"
ATTR_SIDECAR = ATTR_SCREENSHOT.with_name(ATTR_SCREENSHOT.name + ".json")
FEATURES_SCREENSHOT = ROOT / "docs" / "images" / "features.png"
FEATURES_SIDECAR = FEATURES_SCREENSHOT.with_name(FEATURES_SCREENSHOT.name + ".json")
SHIPPED_SAE = ROOT / "model" / "features" / "sae" / "shipped" / "smollm2-135m-instruct-l15-resid-post-topk4k"
SAE_NAME = "smollm2-l15"
ARTIFACTS = Path(os.environ.get("LLAMASCOPE_SCREENSHOT_DIR") or ROOT / "tests" / "artifacts")
REGENERATE = "UPDATE_SCREENSHOTS=1 .venv/bin/python -m pytest tests/service/test_inspect_viewer.py"

CHROMIUM = os.environ.get("LLAMASCOPE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
# Flags for a closed network: without the background-networking ones chromium keeps dialing out and stalls.
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH: install Debian's `chromium` package (.ci/run does) to run the viewer test")


def sources_sha256() -> str:
    """What the viewer looks like is decided by service/microscope/static/*: one hash over their names and bytes."""
    h = hashlib.sha256()
    for f in sorted(STATIC.iterdir()):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def page():
    sync_api = pytest.importorskip("playwright.sync_api", reason="the `playwright` package is in the test extra")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 1100})
        finally:
            browser.close()


def open_and_run(server, page) -> list[str]:
    """Open the viewer, inspect the Summer prompt, wait for the table; -> the page's errors (filled as they come)."""
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/inspect/ui")
    page.fill("#prompt", "Summer is warm. Winter is cold.\n")
    page.click("#run")
    page.wait_for_selector("#massive tbody tr[data-dim]", timeout=60_000)
    return errors


@needs_chromium
def test_viewer_shows_heatmap_and_massive_activations(server, page):
    errors = open_and_run(server, page)

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

    # the colour legend: its bar runs from white (weight 0) to the heatmap's deep orange (the map's largest weight,
    # its last tick)
    assert page.get_attribute("#heatmap-legend", "data-max") in page.text_content("#map-info")
    ends = page.evaluate("""() => {
        const c = document.getElementById('heatmap-legend'), ctx = c.getContext('2d'), y = 21;
        return [[...ctx.getImageData(11, y, 1, 1).data], [...ctx.getImageData(c.width - 12, y, 1, 1).data]]; }""")
    white, orange = ends[0][:3], ends[1][:3]
    assert min(white) >= 250 and all(abs(a - b) <= 2 for a, b in zip(orange, (194, 65, 12))), ends
    # the page links to the definitions
    docs = page.get_attribute("#docs-link", "href")
    assert docs == "/inspect/ui/docs" and "Massive activation" in page.request.get(server.url + docs).text()

    assert "9 tokens" in page.text_content("#status")

    # one click re-runs the prompt with the block-11 entry set to zero: before / after side by side
    intervene(page, 11, "zero")
    before, after = ppl(page, "before"), ppl(page, "after")
    assert after > 1000 * before, (before, after)  # Sun et al.: zeroing the massive activation wrecks the model
    assert page.get_attribute("#after", "data-massive") == "0" and page.get_attribute("#before", "data-massive") == "17"
    assert len(page.query_selector_all("#before ol.top5 li")) == 5 == len(page.query_selector_all("#after ol.top5 li"))
    sinks = {side: json.loads(page.get_attribute(f"#{side}", "data-sinks")) for side in ("before", "after")}
    assert sinks["before"][:12] == pytest.approx(sinks["after"][:12], abs=1e-6)  # untouched up to the edited block
    assert max(abs(a - b) for a, b in zip(sinks["before"][12:], sinks["after"][12:])) > 0.3
    for side in ("before", "after"):
        assert canvas_ink(page, f"#{side} canvas.magnitudes") > 500 and canvas_ink(page, f"#{side} canvas.sinks") > 200

    # the README's picture: the default view (last block, head 0) and the zero ablation's before / after
    take_screenshot(page, None, SCREENSHOT, SIDECAR)

    # choosing another layer and head redraws; hovering a cell reads its value
    page.select_option("#layer", "3")
    page.select_option("#head", "2")
    assert "sink" in page.text_content("#map-info")
    box = page.locator("#heatmap").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["width"] * 0.45)
    assert "weight" in page.text_content("#tooltip")
    assert "perplexity" in page.text_content("#status")

    page.screenshot(path=str(ARTIFACTS / "viewer-hover.png"), full_page=True)
    assert not errors, errors


def intervene(page, layer: int, kind: str) -> None:
    page.evaluate("() => { document.getElementById('compare').dataset.kind = ''; }")
    page.click(f"#massive tbody tr[data-layer='{layer}'] button.{kind}")
    page.wait_for_function(f"() => document.getElementById('compare').dataset.kind === '{kind}'", timeout=120_000)


def ppl(page, side: str) -> float:
    return float(page.get_attribute(f"#{side} .ppl-value", "data-value"))


def canvas_ink(page, selector: str) -> int:
    return page.evaluate("""(sel) => {
        const c = document.querySelector(sel), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i + 3] > 0 && (d[i] < 240 || d[i + 1] < 240 || d[i + 2] < 240)) n++;
        return n; }""", selector)


@needs_chromium
def test_viewer_mean_ablation_keeps_the_model(server, page):
    """"mean" sets the entry to its mean over the reference sentences (read through /inspect's hidden states): the
    prompt's perplexity barely moves and the massive activation stays."""
    errors = open_and_run(server, page)
    intervene(page, 11, "mean")
    before, after = ppl(page, "before"), ppl(page, "after")
    assert abs(after / before - 1) < 0.05, (before, after)
    assert "its mean" in page.text_content("#compare-what")
    assert page.get_attribute("#after", "data-massive") == "17"
    assert not errors, errors


@needs_chromium
def test_viewer_live_mode_streams_tokens_with_their_sink_mass(server, page):
    """Live mode: type a prompt, generate, and watch the tokens arrive each with its per-layer sink mass (the
    telemetry the decode kernels record, `inspect: {"stream": true}`), drawn as a layers x tokens strip."""
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/inspect/ui")
    page.fill("#prompt", "Summer is warm. Winter is cold.\n")
    page.fill("#max-tokens", "12")
    page.click("#live")
    page.wait_for_selector("#live-sinks[data-tokens='12']", timeout=120_000)
    assert page.get_attribute("#live-sinks", "data-layers") == "30"
    sinks = page.eval_on_selector_all("#live-tokens span:not(.prompt)", "s => s.map(e => e.dataset.sinks.split(',').map(Number))")
    assert len(sinks) == 12 and all(len(s) == 30 and all(0 <= v <= 1 for v in s) for s in sinks)
    assert min(sinks[0][3:10]) > 0.5, sinks[0]  # the default model's sink: blocks 3-9 look mostly at token 0
    ink = page.evaluate("""() => {
        const c = document.getElementById('live-sinks'), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i] < 250 || d[i + 1] < 250 || d[i + 2] < 250) n++;
        return n; }""")
    assert ink > 1000
    assert "12 tokens streamed" in page.text_content("#status")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "viewer-live.png"), full_page=True)
    assert not errors, errors


@needs_chromium
def test_viewer_reports_api_errors(server, page):
    page.goto(server.url + "/inspect/ui")
    page.fill("#prompt", "")
    page.click("#run")
    page.wait_for_selector("#status.error", timeout=30_000)
    assert "prompt" in page.text_content("#status")  # the 400 envelope's message, naming the field


@needs_chromium
def test_viewer_patching_tab_draws_the_worked_example(server, page):
    """The patching tab on docs/inspection.md's worked example (its default prompts and answers): one heatmap of
    every block's output (rows) at every token (columns), the colour legend from the corrupted run (0) to the clean
    one (1), the two baselines, and each cell's values on hover. docs/images/patching.png is taken here."""
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/inspect/ui#patch")
    assert page.is_visible("#patch-main") and not page.is_visible("#inspect-main")
    assert page.input_value("#patch-clean") == "The Eiffel Tower is in the city of"
    page.click("#patch-run")
    page.wait_for_selector("#patch-panels[data-cells='270']", timeout=600_000)  # 30 blocks x 9 tokens
    assert page.text_content("#patch-panels h3") == "block_output"
    assert "clean" in page.text_content("#patch-baselines") and "corrupted" in page.text_content("#patch-baselines")
    assert canvas_ink(page, "#patch-panels canvas") > 2000
    # the legend's bar runs from blue (below 0) through white (0, the corrupted run) to orange (1, the clean run)
    ends = page.evaluate("""() => {
        const c = document.getElementById('patch-legend'), ctx = c.getContext('2d'), y = 10;
        return [[...ctx.getImageData(41, y, 1, 1).data], [...ctx.getImageData(c.width - 42, y, 1, 1).data]]; }""")
    assert ends[0][2] > 200 and ends[0][0] < 100 and all(abs(a - b) <= 3 for a, b in zip(ends[1][:3], (194, 65, 12))), ends
    # hover the last block at the last token: that cell is the clean run's final residual stream, exactly 1
    panel = page.locator("#patch-panels canvas")
    box = panel.bounding_box()
    panel.hover(position={"x": box["width"] - 3, "y": box["height"] - 3})  # scrolls it into view first
    tip = page.text_content("#patch-tooltip")
    assert "block 29" in tip and "token 8" in tip and "normalised 1.0000" in tip, tip
    take_screenshot(page, "main#patch-main", PATCH_SCREENSHOT, PATCH_SIDECAR)
    assert not errors, errors


def take_screenshot(page, selector: str | None, image: Path, sidecar: Path) -> None:
    """A fresh screenshot of `selector` (None: the whole page) in the artifacts folder; with UPDATE_SCREENSHOTS=1 it
    becomes the docs' image, and its sidecar records the viewer sources' hash."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    fresh = ARTIFACTS / image.name
    if selector is None:
        page.screenshot(path=str(fresh), full_page=True)
    else:
        page.locator(selector).screenshot(path=str(fresh))
    assert fresh.stat().st_size > 10_000
    if os.environ.get("UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(fresh, image)
        sidecar.write_text(json.dumps({
            "sources": "service/microscope/static/*", "sources_sha256": sources_sha256(), "image_sha256": file_sha256(image),
            "taken_by": "tests/service/test_inspect_viewer.py", "regenerate": REGENERATE}, indent=2) + "\n")


@needs_chromium
def test_viewer_attribution_tab_draws_dla_and_the_estimate_beside_the_exact_grid(server, page):
    """The attribution tab on the worked example (its default prompts and answers): direct logit attribution of the
    clean prompt as a head x layer heatmap and MLP bars, whose caption's sum is the logit difference; attribution
    patching's block_output grid beside the exact one, with their correlation; hover values.
    docs/images/attribution.png is taken here."""
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/inspect/ui#attribute")
    assert page.is_visible("#attribute-main") and not page.is_visible("#patch-main")
    assert page.input_value("#attr-clean") == "The Eiffel Tower is in the city of"
    page.click("#attr-run")
    page.wait_for_selector("#attr-heads[data-layers='30']", timeout=120_000)
    page.wait_for_selector("#attr-atp-panels[data-cells='270']", timeout=900_000)  # 30 blocks x 9 tokens
    caption = page.text_content("#attr-dla-what")
    diff, total = float(caption.split(" = ")[0].split()[-1]), float(caption.split("(sum ")[1].rstrip(")"))
    assert diff == pytest.approx(2.857, abs=2e-3) and total == pytest.approx(diff, abs=2e-3), caption
    assert canvas_ink(page, "#attr-heads") > 2000 and canvas_ink(page, "#attr-mlp") > 500
    titles = page.locator("#attr-atp-panels h3").all_text_contents()
    assert titles == ["block_output · estimated", "block_output · exact"], titles
    assert float(page.get_attribute("#attr-atp-stats", "data-correlation")) > 0.5
    assert "correlation" in page.text_content("#attr-atp-stats")
    heads = page.locator("#attr-heads")
    box = heads.bounding_box()
    heads.hover(position={"x": box["width"] / 2, "y": box["height"] / 2})  # a head of a middle block
    assert re.match(r"L\d+H\d: -?\d+\.\d{4}$", page.text_content("#attr-tooltip")), page.text_content("#attr-tooltip")
    take_screenshot(page, "main#attribute-main", ATTR_SCREENSHOT, ATTR_SIDECAR)
    assert not errors, errors


@needs_chromium
def test_viewer_patching_tab_reports_errors_naming_the_field(server, page):
    page.goto(server.url + "/inspect/ui#patch")
    page.fill("#patch-corrupted", "The Colosseum in Rome is in the city of")
    page.click("#patch-run")
    page.wait_for_selector("#patch-status.error", timeout=30_000)
    assert page.text_content("#patch-status").startswith("corrupted:")


@pytest.fixture
def sae_server(server):
    """The default model's server serving the shipped SAE as `SAE_NAME`: the store's load of a path the operator
    gave, the call `--sae NAME=PATH` makes at start (service/common/state.py), on the session's server."""
    store = server.app.state.server.saes
    store.load(SAE_NAME, SHIPPED_SAE, trusted=True)
    try:
        yield server
    finally:
        store.unload(SAE_NAME)


@needs_chromium
def test_viewer_features_tab_shows_the_grid_the_api_returns(sae_server, page):
    """The features tab on the shipped SAE: the grid's features (ids, max, mean) in the table, the tokens shaded by
    the picked feature's activations, a hovered token's top features and a feature's promoted and suppressed tokens
    are the values /inspect returns for the same request. docs/images/features.png is taken here."""
    server = sae_server
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/inspect/ui#features")
    assert page.is_visible("#features-main") and not page.is_visible("#inspect-main")
    page.fill("#feat-sae", SAE_NAME)  # (picked from GET /v1/saes where the server lists them)
    page.click("#feat-run")
    page.wait_for_selector("#feat-list tbody tr", timeout=120_000)
    body = {"prompt": page.input_value("#feat-prompt"), "include": [], "mode": "none",
            "features": {"sae": SAE_NAME, "top_k": 8}}
    r = httpx.post(server.url + "/inspect", json=body, timeout=120)
    assert r.status_code == 200, r.text
    api, T = r.json()["features"], len(r.json()["tokens"])
    assert api["hook_name"] == "blocks.15.hook_resid_post" and len(api["features"]) > 8

    def approx(values):
        return pytest.approx(values, rel=1e-5, abs=1e-6)

    rows = page.eval_on_selector_all("#feat-list tbody tr", "rs => rs.map(r => [r.dataset.id, r.dataset.max, r.dataset.mean])")
    assert [int(r[0]) for r in rows] == [f["id"] for f in api["features"]]
    assert [float(r[1]) for r in rows] == approx([f["max"] for f in api["features"]])
    assert [float(r[2]) for r in rows] == approx([f["mean"] for f in api["features"]])
    for pick in (1, 0):  # click a feature: the tokens are shaded by its activations, its logit lists shown
        page.click(f"#feat-list tbody tr:nth-child({pick + 1})")
        f = api["features"][pick]
        want = [0.0] * T
        for p, a in zip(f["positions"], f["activations"]):
            want[p] = a
        assert page.get_attribute("#feat-tokens", "data-feature") == str(f["id"])
        acts = page.eval_on_selector_all("#feat-tokens span", "s => s.map(e => Number(e.dataset.act))")
        assert acts == approx(want)
        for side in ("promotes", "suppresses"):
            shown = page.eval_on_selector_all(f"#feat-{side} li", "ls => ls.map(l => Number(l.dataset.id))")
            assert shown == [x["id"] for x in f[side]]
    for t in (2, T - 1):  # hover a token: its top features
        page.hover(f"#feat-tokens span[data-index='{t}']")
        assert page.get_attribute("#feat-token-top", "data-token") == str(t)
        top = page.eval_on_selector_all("#feat-token-top tbody tr", "rs => rs.map(r => [Number(r.dataset.id), Number(r.dataset.value)])")
        assert [e[0] for e in top] == [e[0] for e in api["by_token"][t]]
        assert [e[1] for e in top] == approx([e[1] for e in api["by_token"][t]])
    # the picture: the feature active at the most tokens, and the token where it is largest
    u = max(range(len(api["features"])), key=lambda j: len(api["features"][j]["positions"]))
    f = api["features"][u]
    page.click(f"#feat-list tbody tr:nth-child({u + 1})")
    page.hover(f"#feat-tokens span[data-index='{f['positions'][f['activations'].index(max(f['activations']))]}']")
    assert shaded_tokens(page) == len(f["positions"]) > 1
    take_screenshot(page, "main#features-main", FEATURES_SCREENSHOT, FEATURES_SIDECAR)
    assert not errors, errors


def shaded_tokens(page) -> int:
    """Tokens the picked feature shades (a background other than white)."""
    return page.evaluate("""() => [...document.querySelectorAll('#feat-tokens span')]
        .filter(s => s.style.background && s.style.background !== 'rgb(255, 255, 255)').length""")


@needs_chromium
def test_viewer_features_tab_reports_errors_naming_the_field(server, page):
    page.goto(server.url + "/inspect/ui#features")
    page.fill("#feat-sae", "no-such-dictionary")
    page.click("#feat-run")
    page.wait_for_selector("#feat-status.error", timeout=30_000)
    assert page.text_content("#feat-status").startswith("features.sae:")


@pytest.mark.parametrize("image,sidecar", [(SCREENSHOT, SIDECAR), (PATCH_SCREENSHOT, PATCH_SIDECAR),
                                           (ATTR_SCREENSHOT, ATTR_SIDECAR), (FEATURES_SCREENSHOT, FEATURES_SIDECAR)],
                         ids=["viewer", "patching", "attribution", "features"])
def test_committed_screenshot_is_current(image, sidecar):
    """The docs' screenshots were taken from the viewer's current sources (checked without a browser, so a change
    to the viewer cannot leave a picture stale even where chromium is missing)."""
    assert sidecar.is_file(), f"{sidecar.relative_to(ROOT)} is missing: take the screenshot with {REGENERATE}"
    recorded = json.loads(sidecar.read_text())
    assert recorded["sources_sha256"] == sources_sha256(), (
        f"the viewer's sources (service/microscope/static/*) changed since {image.relative_to(ROOT)} was taken: "
        f"regenerate with {REGENERATE}, look at the image, and commit it with its sidecar")
    assert recorded["image_sha256"] == file_sha256(image), (
        f"{image.relative_to(ROOT)} is not the image the viewer test took: regenerate with {REGENERATE}")
