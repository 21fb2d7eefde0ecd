"""POST /inspect/attribute's `features` and /inspect/patch's `hook` over HTTP, against HF transformers forward hooks
and autograd on the same random weights (float32, 1e-4) and a random SAELens-format dictionary served with --sae:
each feature's direct logit contribution and the sum with b_dec and the error; attribution patching over features
(the definition on HF's gradient and activations); `verify`'s exact feature patches against an HF forward hook adding
the same vector; hook names giving the same sweep as sites + layers; every bad request a 400 naming its field."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from safetensors.torch import save_file

from attribution_reference import metric as hf_metric_of
from attribution_reference import run as hf_run
from hf_checkpoints import save_tiny_llama
from model.features.sae import load_dictionary
from model.loaders.hf import load_hf
from service.config import Settings
from tiny import byte_tokenizer

CLEAN = "The quick brown fox jumps over a dog."
CORRUPTED = "The quick green cat jumps over a dog."
N_LAYERS, LAYER = 3, 1
HOOK = f"blocks.{LAYER}.hook_resid_post"


def write_sae(folder, hook_name: str, d_in: int = 64, d_sae: int = 96, seed: int = 0):
    """A random TopK dictionary in SAELens' layout (cfg.json + sae_weights.safetensors)."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    save_file({"W_enc": torch.randn(d_in, d_sae, generator=g) / d_in ** 0.5, "b_enc": torch.randn(d_sae, generator=g) * 0.1,
               "W_dec": torch.randn(d_sae, d_in, generator=g) / d_in ** 0.5, "b_dec": torch.randn(d_in, generator=g) * 0.1},
              folder / "sae_weights.safetensors")
    cfg = {"architecture": "topk", "d_in": d_in, "d_sae": d_sae, "k": 12, "dtype": "float32",
           "apply_b_dec_to_input": True, "normalize_activations": "none",
           "metadata": {"hook_name": hook_name, "sae_lens_version": "6.54.12"}}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def feature_server(tmp_path_factory, tiny_live):
    d = tmp_path_factory.mktemp("hf-feature-attribute")
    hf = save_tiny_llama(d / "model", vocab_size=258, num_hidden_layers=N_LAYERS)
    sae = write_sae(d / "sae", HOOK)
    mid = write_sae(d / "mid", f"blocks.{LAYER}.hook_resid_mid", seed=1)
    settings = Settings(max_patch_cells=400, max_num_seqs=16, sae=[f"rand={sae}", f"mid={mid}"])
    with tiny_live(settings, load_hf(d / "model")) as live:
        yield live, hf, load_dictionary(sae)


def post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, timeout=600)


def _ids():
    tok = byte_tokenizer()
    return (tok.encode(CLEAN), tok.encode(CORRUPTED), tok.encode(" ", add_bos=False)[0], tok.encode("x", add_bos=False)[0])


def hf_resid(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf_run(hf, ids, ("block_output",), (LAYER,))["values"][(LAYER, "block_output")].double()  # (T, D)


def test_direct_logit_features_over_http_equal_the_definition(feature_server):
    live, hf, d = feature_server
    clean, _, answer, contrast = _ids()
    r = post(live, "/inspect/attribute", {"method": "direct_logit", "prompt": CLEAN, "answer": " ", "contrast": "x",
                                          "features": {"sae": "rand", "top": 5}})
    assert r.status_code == 200, r.text
    got = r.json()
    f = got["features"]
    assert (f["sae"], f["hook"], f["layer"], f["site"]) == ("rand", HOOK, LAYER, "block_output")
    kept = {}
    handle = hf.model.norm.register_forward_pre_hook(lambda m, a: kept.__setitem__("x", a[0][0, -1]))
    x = hf_resid(hf, clean)[-1]  # (D,)
    handle.remove()
    w = hf.lm_head.weight.detach().double()
    u = hf.model.norm.weight.detach().double() * torch.rsqrt(kept["x"].double().pow(2).mean() + hf.config.rms_norm_eps) * \
        (w[answer] - w[contrast])
    acts = d.encode(x[None].float())[0].double()
    want = acts * (d.W_dec.double() @ u)  # (F,)
    assert f["active"] == int((acts != 0).sum()) and len(f["top"]) == 5
    assert [t["feature"] for t in f["top"]] == want.abs().topk(5).indices.tolist()
    tol = 1e-4 * max(1.0, float(acts.abs().max()), float(want.abs().max()))  # within 1e-4 of the largest
    for t in f["top"]:
        assert t["contribution"] == pytest.approx(float(want[t["feature"]]), abs=tol)
        assert t["activation"] == pytest.approx(float(acts[t["feature"]]), abs=tol)
    assert f["site_contribution"] == pytest.approx(float(u @ x), abs=tol)
    assert f["features_sum"] + f["bias"] + f["error"] == pytest.approx(f["site_contribution"], abs=1e-4)
    assert f["sum"] == pytest.approx(f["site_contribution"], abs=1e-4)
    assert got["logit_diff"] == pytest.approx(got["sum"], abs=1e-4)  # the plain attribution is still there


def test_feature_patching_over_http_equals_hf_and_verifies_exactly(feature_server):
    live, hf, d = feature_server
    clean, corrupted, answer, contrast = _ids()
    T = len(clean)
    r = post(live, "/inspect/attribute", {"method": "attribution_patching", "clean": CLEAN, "corrupted": CORRUPTED,
                                          "answer": " ", "contrast": "x", "features": {"sae": "rand", "top": 50},
                                          "verify": 6})
    assert r.status_code == 200, r.text
    got = r.json()
    f = got["features"]
    assert got["direction"] == "noise" and got["positions"] == list(range(T)) and len(f["top"]) == 50
    # the definition: HF autograd's gradient at the clean run, the dictionary's encode of HF's activations
    probe = {}

    def add_probe(l, s, x):
        probe["p"] = torch.zeros_like(x, requires_grad=True)
        return x + probe["p"]

    with torch.enable_grad():
        out = hf_run(hf, clean, ("block_output",), (LAYER,), add_probe)
        (g,) = torch.autograd.grad(hf_metric_of(out["logits"].float(), answer, contrast), [probe["p"]])
    g = g[0].double()  # (T, D)
    x_clean, x_corr = hf_resid(hf, clean), hf_resid(hf, corrupted)
    f_clean, f_corr = d.encode(x_clean.float()).double(), d.encode(x_corr.float()).double()
    est = (g @ d.W_dec.double().T) * (f_corr - f_clean)  # (T, F)
    largest = float(est.abs().max())
    for n in f["top"]:
        assert n["estimate"] == pytest.approx(float(est[n["position"], n["feature"]]), abs=1e-4 * max(1.0, largest))
    assert [abs(n["estimate"]) for n in f["top"]] == sorted((abs(n["estimate"]) for n in f["top"]), reverse=True)
    assert abs(f["top"][0]["estimate"]) == pytest.approx(largest, abs=1e-4 * max(1.0, largest))
    assert f["nodes"] == int((f_corr != f_clean).sum())
    assert max(map(abs, f["rest"])) <= 1e-4 * max(1.0, largest)
    with torch.no_grad():
        m_clean = float(hf_metric_of(hf_run(hf, clean, (), ())["logits"].double(), answer, contrast))
    assert got["baselines"]["clean"] == pytest.approx(m_clean, abs=1e-4)
    # verify: each of the 6 largest patched exactly, feature i at position t moved to its corrupted value
    v = f["verified"]
    assert len(v["nodes"]) == 6 and v["correlation"] is not None
    moved = 0.0
    for n in v["nodes"]:
        t, i = n["position"], n["feature"]
        vec = ((f_corr[t, i] - f_clean[t, i]) * d.W_dec[i].double()).float()

        def edit(l, s, x, t=t, vec=vec):
            x = x.clone()
            x[0, t] += vec
            return x

        with torch.no_grad():
            exact = float(hf_metric_of(hf_run(hf, clean, ("block_output",), (LAYER,), edit)["logits"].double(),
                                       answer, contrast)) - m_clean
        assert n["exact"] == pytest.approx(exact, abs=1e-4), n
        moved = max(moved, abs(exact))
    assert moved > 1e-3


def test_a_hook_name_sweeps_what_sites_and_layers_sweep(feature_server):
    live, _, _ = feature_server
    pair = {"clean": CLEAN, "corrupted": CORRUPTED, "answer": " ", "contrast": "x", "positions": [11, 14, -1]}
    want = post(live, "/inspect/patch", {**pair, "sites": ["block_output"], "layers": [LAYER]}).json()
    for hook in (HOOK, f"blocks.{LAYER + 1}.hook_resid_pre", f"model.layers.{LAYER}", [HOOK]):
        r = post(live, "/inspect/patch", {**pair, "hook": hook})
        assert r.status_code == 200, r.text
        got = r.json()
        assert (got["sites"], got["layers"]) == (["block_output"], [LAYER]) and got["raw"] == want["raw"], hook
    grid = post(live, "/inspect/patch", {**pair, "sites": ["mlp_output", "head_output"], "layers": [0, 2]}).json()
    hooks = ["model.layers.0.mlp", "model.layers.2.mlp", "blocks.0.attn.hook_z", "model.layers.2.self_attn.o_proj.input"]
    got = post(live, "/inspect/patch", {**pair, "hook": hooks}).json()
    assert (got["sites"], got["layers"]) == (["mlp_output", "head_output"], [0, 2]) and got["raw"] == grid["raw"]
    r = post(live, "/inspect/attribute", {"method": "attribution_patching", **pair, "hook": HOOK, "qk_fix": False})
    assert r.status_code == 200 and r.json()["sites"] == ["block_output"] and r.json()["layers"] == [LAYER], r.text


FEATURES = {"method": "attribution_patching", "clean": CLEAN, "corrupted": CORRUPTED, "answer": " ", "contrast": "x",
            "features": {"sae": "rand"}}
PATCH = {"clean": CLEAN, "corrupted": CORRUPTED, "answer": " ", "contrast": "x"}


@pytest.mark.parametrize("path,body,param", [
    ("/inspect/attribute", {**FEATURES, "features": {"sae": "nothing"}}, "features.sae"),
    ("/inspect/attribute", {**FEATURES, "features": {"sae": "mid"}}, "features.sae"),  # resid_mid: not recorded
    ("/inspect/attribute", {**FEATURES, "features": {"sae": "rand", "top": 0}}, "features.top"),
    ("/inspect/attribute", {**FEATURES, "features": {"sae": "rand", "k": 3}}, "features.k"),
    ("/inspect/attribute", {**FEATURES, "features": {"top": 3}}, "features.sae"),
    ("/inspect/attribute", {**FEATURES, "sites": ["block_output"]}, "sites"),
    ("/inspect/attribute", {**FEATURES, "layers": [1]}, "layers"),
    ("/inspect/attribute", {**FEATURES, "direction": "denoise"}, "direction"),
    ("/inspect/attribute", {**FEATURES, "hook": HOOK}, "hook"),
    ("/inspect/attribute", {**FEATURES, "corrupted": CORRUPTED + "!"}, "corrupted"),
    ("/inspect/attribute", {**FEATURES, "positions": [99]}, "positions"),
    ("/inspect/attribute", {**FEATURES, "verify": 401}, "verify"),
    ("/inspect/attribute", {k: v for k, v in FEATURES.items() if k != "contrast"}, "contrast"),
    ("/inspect/attribute", {"method": "direct_logit", "prompt": CLEAN, "answer": " ", "contrast": "x",
                            "features": {"sae": "nothing"}}, "features.sae"),
    ("/inspect/attribute", {"method": "direct_logit", "prompt": CLEAN, "answer": " ", "contrast": "x",
                            "hook": HOOK}, "hook"),
    ("/inspect/patch", {**PATCH, "hook": f"blocks.{LAYER}.ln2.hook_normalized"}, "hook"),  # read only: not patched
    ("/inspect/patch", {**PATCH, "hook": "blocks.0.hook_resid_pre"}, "hook"),  # the embeddings
    ("/inspect/patch", {**PATCH, "hook": f"blocks.{N_LAYERS}.hook_resid_post"}, "hook"),
    ("/inspect/patch", {**PATCH, "hook": "blocks.1.hook_nothing"}, "hook"),
    ("/inspect/patch", {**PATCH, "hook": [HOOK, f"blocks.{LAYER + 1}.hook_resid_pre"]}, "hook"),  # one place twice
    ("/inspect/patch", {**PATCH, "hook": [HOOK, "blocks.2.hook_mlp_out"]}, "hook"),  # not a sites x layers grid
    ("/inspect/patch", {**PATCH, "hook": HOOK, "layers": [1]}, "layers"),
    ("/inspect/patch", {**PATCH, "hook": ""}, "hook"),
    ("/inspect/patch", {**PATCH, "hook": "blocks.1.hook_resid_post" + " " * 300}, "hook"),
    ("/inspect/patch", {**PATCH, "hook": []}, "hook"),
])
def test_bad_requests_name_their_field(feature_server, path, body, param):
    live, _, _ = feature_server
    r = post(live, path, body)
    status = 413 if param == "verify" else 400
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert live.app.state.server.ready
