"""POST /inspect/attribute and /inspect/patch's head sites over HTTP, against HF transformers forward hooks and
autograd on the same random weights (float32, 1e-4; tests/attribution_reference.py writes the references from the
definitions): head-level patching cells at every head site; direct logit attribution per head and MLP; attribution
patching's estimates (the gradient) and its `verify` cells, which are exact patches; a completion streaming beside
an attribution keeps its tokens; a quantized server says at which precision its gradients ran; every bad request is
a 400 or 413 naming its field, before anything runs, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
import torch

from attribution_reference import attribution_patching as hf_attribution_patching
from attribution_reference import direct_logit as hf_direct_logit
from attribution_reference import metric as hf_metric_of
from attribution_reference import patch_cell, run
from hf_checkpoints import save_tiny_llama
from live_server import completions_beside
from model.loaders.hf import load_hf
from service.config import Settings
from tiny import byte_tokenizer

# byte tokens: one character each, so prompts of equal length are equal token counts
CLEAN = "The quick brown fox jumps over a dog."
CORRUPTED = "The quick green cat jumps over a dog."
N_LAYERS, H, K = 3, 4, 2
HEAD_SITES = ["head_q", "head_k", "head_v", "head_output"]


@pytest.fixture(scope="module")
def attr_server(tmp_path_factory, tiny_live):
    d = tmp_path_factory.mktemp("hf-attribute")
    hf = save_tiny_llama(d, vocab_size=258, num_hidden_layers=N_LAYERS)
    settings = Settings(max_patch_cells=400, max_num_seqs=16, max_background_tokens=64)
    with tiny_live(settings, load_hf(d)) as live:
        yield live, hf, d


def _ids():
    tok = byte_tokenizer()
    return (tok.encode(CLEAN), tok.encode(CORRUPTED), tok.encode(" ", add_bos=False)[0], tok.encode("x", add_bos=False)[0])


def hf_metric(hf, ids, answer, contrast):
    with torch.no_grad():
        return float(hf_metric_of(run(hf, ids, (), ())["logits"].double(), answer, contrast))


def post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, timeout=600)


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_head_level_patching_equals_hf_hook_sweep(attr_server, direction):
    """Every head site, two query heads (and the KV head they share), three positions: each cell the target run
    with that head's slice replaced by the source's, in HF's modules (q_proj / k_proj / v_proj outputs, o_proj's
    input)."""
    live, hf, _ = attr_server
    clean, corrupted, answer, contrast = _ids()
    positions = [11, 14, len(clean) - 1]
    body = {"clean": CLEAN, "corrupted": CORRUPTED, "answer": " ", "contrast": "x", "sites": HEAD_SITES,
            "layers": "all", "positions": positions, "heads": [2, 3], "direction": direction}
    r = post(live, "/inspect/patch", body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["heads"] == [2, 3] and got["kv_heads"] == [1]
    assert got["usage"]["cells"] == (2 + 1 + 1 + 2) * N_LAYERS * 3
    source, target = (clean, corrupted) if direction == "denoise" else (corrupted, clean)
    with torch.no_grad():
        src = run(hf, source, HEAD_SITES, range(N_LAYERS))["values"]
    m_clean, m_corr = hf_metric(hf, clean, answer, contrast), hf_metric(hf, corrupted, answer, contrast)
    worst, moved = 0.0, 0.0
    for s, site in enumerate(HEAD_SITES):
        heads = [1] if site in ("head_k", "head_v") else [2, 3]
        for l in range(N_LAYERS):
            for j, head in enumerate(heads):
                for i, p in enumerate(positions):
                    raw = patch_cell(hf, src, target, answer, contrast, site, l, head, p)
                    want = (raw - m_corr) / (m_clean - m_corr)
                    worst = max(worst, abs(got["normalized"][s][l][j][i] - want), abs(got["raw"][s][l][j][i] - raw))
                    moved = max(moved, abs(want - (0.0 if direction == "denoise" else 1.0)))
    print(f"{direction}: max |ours - HF| {worst:.2e}; the cells move the metric by up to {moved:.2f}")
    assert worst <= 1e-4 and moved > 0.05


def test_direct_logit_over_http_equals_hf_hooks(attr_server):
    live, hf, _ = attr_server
    clean, _, answer, contrast = _ids()
    r = post(live, "/inspect/attribute", {"method": "direct_logit", "prompt": CLEAN, "answer": " ", "contrast": "x"})
    assert r.status_code == 200, r.text
    got = r.json()
    ref = hf_direct_logit(hf, clean, answer, contrast)
    assert got["object"] == "inspection.attribution" and got["position"] == len(clean) - 1
    assert torch.tensor(got["heads"]).sub(torch.tensor(ref["heads"])).abs().max() <= 1e-4
    assert torch.tensor(got["mlp"]).sub(torch.tensor(ref["mlp"])).abs().max() <= 1e-4
    c = got["contributions"]
    assert list(c)[:2] == ["embed", "L0H0"] and c["L1H3"] == got["heads"][1][3] and c["L2"] == got["mlp"][2]
    assert sum(v for k, v in c.items()) == pytest.approx(got["logit_diff"], abs=1e-4)
    assert got["logit_diff"] == pytest.approx(ref["logit_diff"], abs=1e-4)


def test_attribution_patching_over_http_equals_hf_autograd_and_verifies_exactly(attr_server):
    live, hf, _ = attr_server
    clean, corrupted, answer, contrast = _ids()
    sites = ["block_output", "attention_output", "mlp_output", *HEAD_SITES]
    body = {"method": "attribution_patching", "clean": CLEAN, "corrupted": CORRUPTED, "answer": " ", "contrast": "x",
            "sites": sites, "qk_fix": False, "verify": 12}
    r = post(live, "/inspect/attribute", body)
    assert r.status_code == 200, r.text
    got = r.json()
    T = len(clean)
    assert got["positions"] == list(range(T)) and got["heads"] == list(range(H)) and got["kv_heads"] == list(range(K))
    ref, _ = hf_attribution_patching(hf, clean, corrupted, answer, contrast, sites, range(N_LAYERS), range(T))
    m_clean, m_corr = hf_metric(hf, clean, answer, contrast), hf_metric(hf, corrupted, answer, contrast)
    assert got["baselines"]["clean"] == pytest.approx(m_clean, abs=1e-4)
    assert got["baselines"]["corrupted"] == pytest.approx(m_corr, abs=1e-4)
    worst, base = 0.0, got["baselines"]["corrupted"]  # raw = the target's metric + the estimate
    for s, site in enumerate(sites):
        for l in range(N_LAYERS):
            if site in HEAD_SITES:
                for j, head in enumerate(range(K if site in ("head_k", "head_v") else H)):
                    for p in range(T):
                        worst = max(worst, abs(got["raw"][s][l][j][p] - base - ref[(site, l, head, p)]))
            else:
                for p in range(T):
                    worst = max(worst, abs(got["raw"][s][l][p] - base - ref[(site, l, None, p)]))
    largest = max(map(abs, ref.values()))
    print(f"AtP over HTTP: max |ours - HF autograd| {worst:.2e}, of estimates up to {largest:.2f}")
    assert worst <= 1e-4 * max(1.0, largest)  # float32 sums of T x D products
    # verify: the 12 largest estimates, each patched exactly; the same as /inspect/patch gives for that cell
    v = got["verified"]
    assert len(v["cells"]) == 12 and v["correlation"] is not None
    est = [abs(c["estimated_raw"] - m_corr) for c in v["cells"]]
    assert est == sorted(est, reverse=True)
    for c in v["cells"][:3]:
        exact = post(live, "/inspect/patch", {"clean": CLEAN, "corrupted": CORRUPTED, "answer": " ", "contrast": "x",
                                              "sites": [c["site"]], "layers": [c["layer"]], "positions": [c["position"]],
                                              **({"heads": [c["head"]]} if c["head"] is not None and c["site"] in
                                                 ("head_q", "head_output") else {})}).json()
        cell = exact["raw"][0][0]
        if c["head"] is not None:
            heads = exact["kv_heads"] if c["site"] in ("head_k", "head_v") else exact["heads"]
            cell = cell[heads.index(c["head"])]
        assert cell[0] == pytest.approx(c["exact_raw"], abs=1e-4), c


def test_a_completion_beside_an_attribution_keeps_its_tokens(attr_server):
    live, _, _ = attr_server
    with completions_beside(live.url, 3) as (ref, texts):
        r = post(live, "/inspect/attribute", {"method": "attribution_patching", "clean": CLEAN, "corrupted": CORRUPTED,
                                              "answer": " ", "contrast": "x", "sites": ["block_output", "head_q", "head_k"]})
    assert r.status_code == 200, r.text
    assert texts == [ref] * 3


def test_a_quantized_server_says_where_its_gradient_ran(attr_server, tiny_live):
    _, _, d = attr_server
    with tiny_live(Settings(), load_hf(d, quantization="int8")) as live:
        r = post(live, "/inspect/attribute", {"method": "attribution_patching", "clean": CLEAN, "corrupted": CORRUPTED,
                                              "answer": " ", "contrast": "x", "verify": 3})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["precision"]["quantization"] == "int8"
        assert got["gradient_precision"].startswith("float32 (each quantized layer's weight dequantized")
        assert len(got["verified"]["cells"]) == 3


PAIR = {"method": "attribution_patching", "clean": CLEAN, "corrupted": CORRUPTED, "answer": " ", "contrast": "x"}
DLA = {"method": "direct_logit", "prompt": CLEAN, "answer": " ", "contrast": "x"}


@pytest.mark.parametrize("body,status,param", [
    ({**PAIR, "method": "gradient"}, 400, "method"),
    ({**DLA, "clean": CLEAN}, 400, "clean"),
    ({**DLA, "sites": ["block_output"]}, 400, "sites"),
    ({**PAIR, "prompt": CLEAN}, 400, "prompt"),
    ({k: v for k, v in DLA.items() if k != "contrast"}, 400, "contrast"),
    ({k: v for k, v in DLA.items() if k != "prompt"}, 400, "prompt"),
    ({k: v for k, v in PAIR.items() if k != "corrupted"}, 400, "corrupted"),
    ({**PAIR, "corrupted": CORRUPTED + "!"}, 400, "corrupted"),
    ({**PAIR, "heads": [H], "sites": ["head_output"]}, 400, "heads"),
    ({**PAIR, "sites": ["head_z"]}, 400, "sites"),
    ({**PAIR, "layers": [N_LAYERS]}, 400, "layers"),
    ({**PAIR, "answer": "ab"}, 400, "answer"),
    ({**PAIR, "verify": 401}, 413, "verify"),  # over max_patch_cells
    ({**PAIR, "verify": 200, "positions": [0]}, 400, "verify"),  # more than the sweep's 3 x 3 cells
    ({**PAIR, "corrupted": CLEAN}, 400, "corrupted"),  # the two metrics are equal: nothing to normalise by
    ({**DLA, "prompt": "x" * 5000}, 413, "prompt"),  # over max_inspect_tokens (4096)
])
def test_bad_requests_name_their_field(attr_server, body, status, param):
    live, _, _ = attr_server
    r = post(live, "/inspect/attribute", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].split(".")[0] == param, err
    assert live.app.state.server.ready


def test_the_byte_budget_is_a_413_before_anything_runs(attr_server, monkeypatch):
    live, _, _ = attr_server
    app = live.app
    monkeypatch.setattr(app.state.server.settings, "max_inspect_response_bytes", 50_000)
    jobs0 = app.state.server.engine._num_jobs
    r = post(live, "/inspect/attribute", {**PAIR, "sites": ["block_output", "head_q"]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "attribute_too_large", r.text
    assert "budget" in r.json()["error"]["message"] and app.state.server.engine._num_jobs == jobs0
    # the patching endpoint's head sites are held to its own budget
    r = post(live, "/inspect/patch", {**{k: v for k, v in PAIR.items() if k != "method"}, "sites": ["head_output"],
                                      "positions": "all"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "patch_too_large", r.text
