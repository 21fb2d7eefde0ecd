"""Steering by feature and hook names over HTTP, on a tiny random model serving three dictionaries (`--sae`): a
feature `add` is exactly the `add` of its decoder row at the dictionary's site; a `clamp` follows an uncached
forward hooked with the dictionary's own encode; `hook` (TransformerLens names, HF module paths) is exactly the
`layer` + `site` it names, in interventions and hidden-state reads (the stream between the sub-blocks too: a clamp
of a dictionary reading blocks.0.hook_resid_mid follows the hooked forward; reads there equal the hooked values);
every mistake is a 400 naming its field, and the server keeps serving."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

from model.features.sae import load_dictionary
from random_dictionaries import random_dictionary, save_saelens
from service.config import Settings
from tiny import byte_tokenizer, greedy_tokens

PROMPT = "steer me"


@pytest.fixture(scope="module")
def live(tiny_live, tmp_path_factory):
    root = tmp_path_factory.mktemp("saes")
    relu = random_dictionary("relu", layer=1, site="block_output", seed=0, input_scale=8.0)
    jump = random_dictionary("jumprelu", layer=0, site="mlp_output", seed=1, input_scale=4.0)
    save_saelens(root / "relu", relu, "standard", "blocks.1.hook_resid_post")
    save_saelens(root / "jump", jump, "jumprelu", "blocks.0.hook_mlp_out")
    save_saelens(root / "tc", random_dictionary("relu", layer=0, seed=2), "transcoder", "blocks.0.hook_resid_mid",
                 "blocks.0.hook_mlp_out")
    save_saelens(root / "mid", random_dictionary("relu", layer=0, seed=3), "standard", "blocks.0.hook_resid_mid")
    specs = [f"{n}={root / n}" for n in ("relu", "jump", "tc", "mid")]
    with tiny_live(Settings(sae=specs)) as server:
        server.saes = {n: load_dictionary(root / n) for n in ("relu", "jump", "mid")}
        yield server


def complete(live, interventions=None, status: int = 200, **extra) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1, "echo": True,
            "interventions": interventions, **extra}
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def lps(body: dict) -> list:
    c = body["choices"][0]
    return [c["text"], c["logprobs"]["token_logprobs"]]


def test_feature_add_is_the_add_of_its_decoder_row(live):
    d = live.saes["relu"]
    row = d.W_dec[7].tolist()
    by_feature = complete(live, [{"op": "add", "feature": {"sae": "relu", "id": 7}, "scale": 3.0,
                                  "positions": "generated"}])
    by_vector = complete(live, [{"layer": 1, "op": "add", "vector": row, "scale": 3.0, "positions": "generated"}])
    assert lps(by_feature) == lps(by_vector)
    assert lps(by_feature) != lps(complete(live))  # it steered


def test_a_clamp_over_http_follows_the_hooked_forward(live):
    d, tok = live.saes["jump"], byte_tokenizer()
    prompt = tok.encode(PROMPT)
    got = complete(live, [{"op": "clamp", "feature": {"sae": "jump", "id": 5}, "value": 7.0}], max_tokens=5,
                   echo=False, logprobs=None, prompt=prompt, ignore_eos=True)
    ids = list(prompt)

    def hook(mod, args, out):  # (1, T, D): x + decode(f with f_5 = 7) - decode(f)
        x = out[0]
        f = d.encode(x)
        f2 = f.clone()
        f2[:, 5] = 7.0
        return (x + d.decode(f2, x) - d.decode(f, x))[None]

    handle = live.model.layers[0].feed_forward.register_forward_hook(hook)
    try:
        with torch.inference_mode():
            for _ in range(5):
                ids.append(int(live.model(torch.tensor([ids]))[0, -1].argmax()))
    finally:
        handle.remove()
    assert got["choices"][0]["text"] == tok.decode(ids[len(prompt):], skip_special_tokens=True)
    clamped = complete(live, [{"op": "clamp", "feature": {"sae": "jump", "id": 5}, "value": 7.0}])
    assert lps(clamped) != lps(complete(live))  # it steered


@pytest.mark.parametrize("hook, place", [
    ("blocks.1.hook_resid_post", {"layer": 1}),
    ("model.layers.1", {"layer": 1}),
    ("blocks.1.hook_resid_pre", {"layer": 0}),
    ("blocks.0.hook_mlp_out", {"layer": 0, "site": "mlp_output"}),
    ("model.layers.1.self_attn.o_proj", {"layer": 1, "site": "attention_output"}),
    ("blocks.0.hook_resid_mid", {"layer": 0, "site": "resid_mid"}),
    ("model.layers.1.post_attention_layernorm.input", {"layer": 1, "site": "resid_mid"}),
    ("model.layers.1.mlp.input", {"layer": 1, "site": "mlp_input"}),
])
def test_a_hook_name_is_the_place_it_names(live, hook, place):
    v = torch.randn(64, generator=torch.Generator().manual_seed(1)).mul(3).tolist()
    named = complete(live, [{"hook": hook, "op": "add", "vector": v}])
    placed = complete(live, [{**place, "op": "add", "vector": v}])
    assert lps(named) == lps(placed)


def test_hidden_states_by_hook(live):
    a = complete(live, None, return_hidden_states={"hooks": ["blocks.0.hook_resid_post", "model.layers.1"]})
    b = complete(live, None, return_hidden_states={"layers": [0, 1]})
    key = "hidden_states"
    assert a["choices"][0][key] == b["choices"][0][key]
    a = complete(live, None, return_hidden_states={"hooks": ["blocks.1.ln2.hook_normalized", "blocks.0.ln2.hook_normalized"]})
    b = complete(live, None, return_hidden_states={"layers": [1, 0], "site": "mlp_normalized"})
    assert a["choices"][0][key] == b["choices"][0][key]


def test_stream_site_hidden_states_equal_the_hooked_values(live):
    """`return_hidden_states` at resid_mid, mlp_normalized and mlp_input, every position: the MLP's norm's input,
    that over its root mean square without the gain (TransformerLens' ln2.hook_normalized), and the MLP's input, as
    hooks on one uncached forward see them."""
    tok = byte_tokenizer()
    prompt = tok.encode(PROMPT)
    got = {}
    for site in ("resid_mid", "mlp_normalized", "mlp_input"):
        c = complete(live, None, prompt=prompt, echo=False, logprobs=None, max_tokens=4, ignore_eos=True,
                     return_hidden_states={"layers": [1, 0], "site": site, "positions": "all"})["choices"][0]
        hs = c["hidden_states"]
        got[site] = np.frombuffer(base64.b64decode(hs["data"]), "<f4").reshape(hs["shape"])
    tokens = greedy_tokens(live.model, [prompt], 4)[0]  # the served tokens (their text may not re-encode to them)
    assert tok.decode(tokens) == c["text"]
    seen, handles = {}, []
    for l, block in enumerate(live.model.layers):
        def before(m, a, l=l):
            x = a[0][0].float()
            seen[(l, "resid_mid")] = x.clone()
            seen[(l, "mlp_normalized")] = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + live.model.config.norm_eps)
        handles.append(block.ffn_norm.register_forward_pre_hook(before))
        handles.append(block.feed_forward.register_forward_pre_hook(
            lambda m, a, l=l: seen.__setitem__((l, "mlp_input"), a[0][0].float().clone())))
    try:
        with torch.inference_mode():
            live.model(torch.tensor([prompt + tokens[:3]]))
    finally:
        for h in handles:
            h.remove()
    for site, values in got.items():
        assert values.shape == (len(prompt) + 3, 2, 64)
        for j, layer in enumerate((1, 0)):
            want = seen[(layer, site)].numpy()
            assert np.abs(values[:, j] - want).max() <= 1e-5 * np.abs(want).max(), (site, layer)


def test_a_clamp_at_resid_mid_follows_the_hooked_forward(live):
    """The dictionary reading blocks.0.hook_resid_mid: the clamp edits the stream itself (the MLP and block 1 see it),
    as an attention output that makes the stream the clamped one does in an uncached forward."""
    d, tok = live.saes["mid"], byte_tokenizer()
    prompt = tok.encode(PROMPT)
    item = [{"op": "clamp", "feature": {"sae": "mid", "id": 3}, "value": 6.0}]
    got = complete(live, item, max_tokens=5, echo=False, logprobs=None, prompt=prompt, ignore_eos=True)
    ids, seen, block = list(prompt), {}, live.model.layers[0]

    def clamp(x):  # (T, D): x + decode(f with f_3 = 6) - decode(f)
        f = d.encode(x)
        f2 = f.clone()
        f2[:, 3] = 6.0
        return x + d.decode(f2, x) - d.decode(f, x)

    handles = [block.register_forward_pre_hook(lambda m, a: seen.__setitem__("h", a[0])),
               block.attention.register_forward_hook(lambda m, a, o: clamp((seen["h"] + o)[0])[None] - seen["h"])]
    try:
        with torch.inference_mode():
            for _ in range(5):
                ids.append(int(live.model(torch.tensor([ids]))[0, -1].argmax()))
    finally:
        for h in handles:
            h.remove()
    assert got["choices"][0]["text"] == tok.decode(ids[len(prompt):], skip_special_tokens=True)
    assert lps(complete(live, item)) != lps(complete(live))  # it steered


@pytest.mark.parametrize("item, param", [
    ({"op": "add", "feature": {"sae": "nope", "id": 1}}, "interventions[0].feature.sae"),
    ({"op": "add", "feature": {"sae": "relu", "id": 48}}, "interventions[0].feature.id"),
    ({"op": "clamp", "feature": {"sae": "relu", "id": 1}}, "interventions[0].value"),
    ({"op": "add", "feature": {"sae": "relu", "id": 1}, "value": 2.0}, "interventions[0].value"),
    ({"op": "clamp", "feature": {"sae": "tc", "id": 1}, "value": 2.0}, "interventions[0].feature"),
    ({"op": "set", "feature": {"sae": "relu", "id": 1}, "dims": [0], "values": [1.0]}, "interventions[0].op"),
    ({"op": "add", "feature": {"sae": "relu", "id": 1}, "layer": 0}, "interventions[0].layer"),
    ({"op": "clamp", "value": 2.0, "layer": 0}, "interventions[0].feature"),
    ({"op": "add", "hook": "blocks.0.ln2.hook_normalized", "vector": [0.0] * 64}, "interventions[0].hook"),
    ({"op": "add", "hook": "blocks.0.attn.hook_z", "vector": [0.0] * 64}, "interventions[0].hook"),
    ({"op": "add", "hook": "blocks.5.hook_resid_post", "vector": [0.0] * 64}, "interventions[0].hook"),
    ({"op": "add", "hook": "model.layers.0.nonsense", "vector": [0.0] * 64}, "interventions[0].hook"),
    ({"op": "add", "hook": "blocks.0.hook_resid_post", "layer": 0, "vector": [0.0] * 64}, "interventions[0].layer"),
])
def test_mistakes_are_400s_naming_the_field(live, item, param):
    body = complete(live, [item], status=400)
    assert body["error"]["param"] == param, body
    assert complete(live)["choices"][0]["text"]  # still serving


@pytest.mark.parametrize("hidden, param", [
    ({"hooks": ["blocks.0.attn.hook_z"]}, "return_hidden_states.hooks[0]"),
    ({"hooks": ["blocks.0.hook_resid_post", "blocks.0.hook_attn_out"]}, "return_hidden_states.hooks[1]"),
    ({"hooks": ["blocks.0.hook_resid_mid"], "site": "resid_mid"}, "return_hidden_states.site"),
    ({"layers": [0], "site": "head_output"}, "return_hidden_states.site"),
    ({"hooks": ["blocks.0.hook_resid_post", "blocks.9.hook_resid_post"]}, "return_hidden_states.hooks[1]"),
    ({"hooks": ["blocks.0.hook_resid_post"], "layers": [0]}, "return_hidden_states.layers"),
    ({"positions": "last"}, "return_hidden_states.layers"),
])
def test_hidden_state_hook_mistakes_are_400s(live, hidden, param):
    body = complete(live, None, status=400, return_hidden_states=hidden)
    assert body["error"]["param"] == param, body
