"""/inspect's `features`: a served dictionary's feature x token grid over HTTP, against HF transformers' activations
at the place the dictionary's hook names (a forward hook on the HF module model/hook_names.py maps it to) encoded
by the dictionary as loaded from its files (float32, within 1e-4 of the largest activation); the tokens each
feature's decoder direction promotes and suppresses against a direct torch computation on HF's weights (lm_head
times the final norm's gain times the direction; through o_proj for a dictionary of the heads' outputs); and every
bad request a 400 naming its field, the server serving on."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from hf_checkpoints import save_tiny_llama
from model.features.sae import load_dictionary
from model.hook_names import parse_hook
from model.loaders.hf import load_hf
from service.config import Settings
from tiny import byte_tokenizer

N_LAYERS = 3
PROMPT = "The quick brown fox jumps over the lazy dog."
# name -> (hook, architecture, d_in, d_sae)
DICTIONARIES = {
    "resid": ("blocks.1.hook_resid_post", "topk", 64, 48),
    "attn": ("blocks.0.hook_attn_out", "standard", 64, 40),
    "heads": ("blocks.2.attn.hook_z", "jumprelu", 64, 40),
    "mid": ("blocks.1.hook_resid_mid", "standard", 64, 40),
    "normalized": ("blocks.1.ln2.hook_normalized", "standard", 64, 16),  # a site /inspect does not read yet
}


def write_saelens(folder: Path, hook_name: str, architecture: str, d_in: int, d_sae: int, seed: int) -> Path:
    """A random dictionary in SAELens 6's layout (tests/model/test_sae_files.py's, with biases and thresholds)."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {"W_enc": torch.randn(d_in, d_sae, generator=g) * 0.3, "b_enc": torch.randn(d_sae, generator=g) * 0.2,
               "W_dec": torch.randn(d_sae, d_in, generator=g), "b_dec": torch.randn(d_in, generator=g) * 0.1}
    if architecture == "jumprelu":
        tensors["threshold"] = torch.rand(d_sae, generator=g) * 0.5
    save_file(tensors, folder / "sae_weights.safetensors")
    cfg = {"architecture": architecture, "d_in": d_in, "d_sae": d_sae, "k": 6, "dtype": "float32",
           "apply_b_dec_to_input": True, "normalize_activations": "none",
           "metadata": {"hook_name": hook_name, "sae_lens_version": "6.54.12"}}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def grid_server(tmp_path_factory, tiny_live):
    d = tmp_path_factory.mktemp("hf-features")
    hf = save_tiny_llama(d / "model", vocab_size=258, num_hidden_layers=N_LAYERS)
    paths = {name: write_saelens(d / name, *spec, seed=i) for i, (name, spec) in enumerate(DICTIONARIES.items())}
    settings = Settings(sae=[f"{name}={path}" for name, path in paths.items()], max_num_seqs=8)
    with tiny_live(settings, load_hf(d / "model")) as live:
        yield live, hf, paths


def hf_activation(hf, ids: list[int], name: str) -> torch.Tensor:
    """The activation (T, width) at hook `name` on `ids`, read by a forward hook on the HF module it names."""
    path, side = parse_hook(name).hf_module()
    seen = {}

    def grab(module, args, output):
        x = args[0] if side == "input" else (output[0] if isinstance(output, tuple) else output)
        seen["x"] = x.detach()[0]

    handle = hf.get_submodule(path).register_forward_hook(grab)
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        handle.remove()
    return seen["x"].float()


def post(live, body: dict) -> httpx.Response:
    return httpx.post(live.url + "/inspect", json={"prompt": PROMPT, "include": [], **body}, timeout=300)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = max(want.abs().max().item(), 1e-6)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4 * scale, ((got - want).abs().max().item(), scale)


@pytest.mark.parametrize("name", ["resid", "attn", "heads", "mid"])
def test_grid_equals_the_dictionarys_encode_of_hf_activations(grid_server, name):
    live, hf, paths = grid_server
    top_k, ids = 3, [0, 7]
    r = post(live, {"features": {"sae": name, "top_k": top_k, "ids": ids}})
    assert r.status_code == 200, r.text
    body = r.json()
    tokens = [t["id"] for t in body["tokens"]]
    T = len(tokens)
    g = body["features"]
    hook, _, _, d_sae = DICTIONARIES[name]
    assert (g["sae"], g["hook_name"], g["d_sae"], g["top_k"], g["num_tokens"]) == (name, hook, d_sae, top_k, T)
    dictionary = load_dictionary(paths[name])
    f = dictionary.encode(hf_activation(hf, tokens, hook))  # (T, F): the reference grid
    assert (f > 0).any(dim=-1).all(), "every token has an active feature (else the test checks less)"

    # each token's top features: the reference's largest, active ones (values to 1e-4 of the largest)
    ref_values, ref_ids = f.topk(top_k, dim=-1)
    for t, entries in enumerate(g["by_token"]):
        active = int((ref_values[t] > 0).sum())
        assert len(entries) == active
        assert [e[0] for e in entries] == ref_ids[t, :active].tolist()
        close(torch.tensor([e[1] for e in entries]), ref_values[t, :active])

    # the grid's features: the union of those and the requested ids, by descending max
    union = sorted({i for row, vals in zip(ref_ids.tolist(), ref_values.tolist()) for i, v in zip(row, vals) if v > 0}
                   | set(ids))
    got_ids = [e["id"] for e in g["features"]]
    assert sorted(got_ids) == union
    maxima = [e["max"] for e in g["features"]]
    assert maxima == sorted(maxima, reverse=True)
    dense = torch.zeros(len(got_ids), T)
    for u, e in enumerate(g["features"]):
        assert e["positions"] == sorted(e["positions"]) and all(v != 0 for v in e["activations"])
        dense[u, e["positions"]] = torch.tensor(e["activations"])
    want = f[:, got_ids].T  # (U, T)
    close(dense, want)
    close(torch.tensor(maxima), want.amax(-1))
    close(torch.tensor([e["mean"] for e in g["features"]]), want.mean(-1))


def test_promoted_and_suppressed_tokens_equal_the_unembedding_of_each_direction(grid_server):
    live, hf, paths = grid_server
    for name in ("resid", "heads"):
        r = post(live, {"features": {"sae": name, "top_k": 2}})
        assert r.status_code == 200, r.text
        g = r.json()["features"]
        d = load_dictionary(paths[name])
        hook = parse_hook(DICTIONARIES[name][0])
        tok = byte_tokenizer()
        for e in g["features"]:
            direction = d.W_dec[e["id"]]  # (D_out,)
            with torch.no_grad():
                if hook.site == "head_output":  # the heads' outputs reach the stream through o_proj
                    direction = hf.model.layers[hook.layer].self_attn.o_proj(direction)
                logits = hf.lm_head.weight @ (hf.model.norm.weight * direction)  # (V,)
            for side, largest in (("promotes", True), ("suppresses", False)):
                want = logits.topk(10, largest=largest)
                got = e[side]
                close(torch.tensor([x["logit"] for x in got]), want.values)
                # ids where the neighbouring logits are apart (a near-tie may come in either order)
                assert [x["text"] for x in got] == [tok.decode([x["id"]]) for x in got]
                v = want.values.tolist()
                for j, x in enumerate(got):
                    gap = min(abs(v[j] - v[j - 1]) if j else 1.0, abs(v[j] - v[j + 1]) if j + 1 < len(v) else 1.0)
                    if gap > 1e-3 * max(abs(u) for u in v):
                        assert x["id"] == want.indices[j].item(), (name, e["id"], side, j)


@pytest.mark.parametrize("features,param,fragment", [
    ({"sae": "nope"}, "features.sae", "no dictionary named 'nope'"),
    ({"sae": "normalized"}, "features.sae", "mlp_normalized"),
    ({"sae": "resid", "ids": [48]}, "features.ids", "out of range [0, 48)"),
    ({"sae": "resid", "ids": [3, 3]}, "features.ids", "repeat"),
    ({"sae": "resid", "top_k": 0}, "features.top_k", ""),
    ({"sae": "resid", "k": 3}, "features.k", ""),
])
def test_bad_feature_requests_are_400s_naming_the_field(grid_server, features, param, fragment):
    live, _, _ = grid_server
    r = post(live, {"features": features})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err
    assert post(live, {"features": {"sae": "resid"}}).status_code == 200  # still serving


def test_compare_refuses_features(grid_server):
    live, _, _ = grid_server
    r = httpx.post(live.url + "/inspect/compare", json={"prompt": PROMPT, "compare": ["tiny"],
                                                        "features": {"sae": "resid"}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "features", r.text


def test_grid_over_prompt_and_completion_and_under_an_intervention(grid_server):
    """The grid covers the whole inspected sequence (prompt + generated tokens), and reads the site after the
    inspection's own edits: adding a vector at the site moves the grid as the dictionary says."""
    live, hf, paths = grid_server
    r = post(live, {"features": {"sae": "resid", "top_k": 4}, "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["features"]["num_tokens"] == len(body["tokens"]) == len(byte_tokenizer().encode(PROMPT)) + 3
    vector = [0.5] * 64
    edit = [{"layer": 1, "site": "block_output", "op": "add", "vector": vector}]
    r = post(live, {"features": {"sae": "resid", "top_k": 4}, "interventions": edit})
    assert r.status_code == 200, r.text
    g = r.json()["features"]
    tokens = [t["id"] for t in r.json()["tokens"]]
    x = hf_activation(hf, tokens, "blocks.1.hook_resid_post") + torch.tensor(vector)
    f = load_dictionary(paths["resid"]).encode(x)
    dense = torch.zeros(len(g["features"]), len(tokens))
    for u, e in enumerate(g["features"]):
        dense[u, e["positions"]] = torch.tensor(e["activations"])
    close(dense, f[:, [e["id"] for e in g["features"]]].T)


def test_the_response_is_built_and_encoded_on_the_engine_thread(grid_server, monkeypatch):
    """Building an inspection's response (tokens, layers, the grid) and encoding it as JSON hold the GIL while they
    run; on the event loop or a worker thread they stall every serving step for that long. Every unit of it runs on
    the engine thread, as slices of the inspection's job (service/microscope/probing.py `ThenRespond`)."""
    from service.microscope import inspect_format, json_pieces

    live, _, _ = grid_server
    seen: Counter = Counter()

    def spy(module, name):
        real = getattr(module, name)

        def counted(*args):
            seen[(name, threading.current_thread().name)] += 1
            return real(*args)
        monkeypatch.setattr(module, name, counted)

    spy(json_pieces, "_dumps")  # the encoding's pieces
    spy(inspect_format, "_f32")  # the grid's rows and entries
    spy(inspect_format, "_entry")  # the layers' activation entries
    r = post(live, {"features": {"sae": "resid", "top_k": 4}, "include": ["massive", "norms"]})
    assert r.status_code == 200, r.text
    assert {name for name, _ in seen} == {"_dumps", "_f32", "_entry"}
    assert {thread for _, thread in seen} == {"llamascope-engine"}, seen
