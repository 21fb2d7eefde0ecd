"""Over HTTP: the `features` field on /v1/completions, /v1/chat/completions and /v1/responses (each token's top
features of a served dictionary, streamed with each token equal to the collected answer), /v1/saes (list, load
from the allowed directories only, unload), every refusal a client can cause as a 400 naming the field (the server
keeps serving), and the shipped SAE on the default model.

The served values are held to the reference in tests/engine/test_sae_features.py (HF activations, every path);
here the tiny model's own block outputs, read by forward hooks, encoded by the dictionary, are the reference."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from model.features.sae import load_dictionary
from service.config import Settings
from tiny import greedy_tokens

D, F = 64, 40  # the tiny model's width (tests/tiny.py), the dictionaries' features
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"  # the byte tokenizer has none


def write_saelens(folder: Path, hook_name: str = "blocks.1.hook_resid_post", architecture: str = "topk",
                  seed: int = 0, d_in: int = D) -> Path:
    """A random dictionary in SAELens' layout (cfg.json + sae_weights.safetensors, its v6 config)."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    save_file({"W_enc": torch.randn(d_in, F, generator=g), "b_enc": torch.randn(F, generator=g),
               "W_dec": torch.randn(F, d_in, generator=g), "b_dec": torch.randn(d_in, generator=g)},
              folder / "sae_weights.safetensors")
    cfg = {"architecture": architecture, "d_in": d_in, "d_sae": F, "k": 5, "dtype": "float32",
           "apply_b_dec_to_input": True, "normalize_activations": "none",
           "metadata": {"hook_name": hook_name, "sae_lens_version": "6.54.12"}}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def saes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saes")
    write_saelens(root / "allowed" / "topk1")
    write_saelens(root / "allowed" / "relu0", "blocks.0.hook_mlp_out", "standard", seed=1)
    write_saelens(root / "allowed" / "mid", "blocks.1.hook_resid_mid", "standard", seed=2)
    write_saelens(root / "allowed" / "post", "blocks.0.mlp.hook_post", "standard", seed=5, d_in=2 * D)  # F = 2 D wide
    write_saelens(root / "outside" / "other", seed=3)
    (root / "allowed" / "link").symlink_to(root / "outside" / "other")
    (root / "allowed" / "broken").mkdir()
    (root / "allowed" / "broken" / "cfg.json").write_text("{not json")
    write_saelens(root / "allowed" / "wide", d_in=2 * D, seed=4)
    return root


@pytest.fixture(scope="module")
def live(tiny_live, saes):
    allowed = saes / "allowed"
    settings = Settings(sae=[f"topk1={allowed / 'topk1'}", f"relu0={allowed / 'relu0'}", f"mid={allowed / 'mid'}",
                             f"post={allowed / 'post'}"],
                        sae_allowed_dirs=[str(allowed)], chat_template=TEMPLATE, sae_encoder="float32")
    with tiny_live(settings) as server:
        yield server


def post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(live.url + path, json=body, timeout=120)


def stream(live, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", live.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def reference(live, saes: Path, name: str, ids: list[int]) -> torch.Tensor:
    """(T, F): the dictionary's encode of the tiny model's activation at its hook over `ids`, read by a forward
    hook on the module the hook names (one uncached forward)."""
    d = load_dictionary(saes / "allowed" / name)
    model = live.model
    block = model.layers[d.hook_in.layer]
    seen = {}
    if d.hook_in.site == "resid_mid":  # the stream between the sub-blocks: the MLP's norm's input
        handle = block.ffn_norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0][0].float().clone()))
    else:
        module = {"block_output": block, "mlp_output": block.feed_forward}[d.hook_in.site]
        handle = module.register_forward_hook(lambda m, a, o: seen.__setitem__("x", o[0].float().clone()))
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]))
    finally:
        handle.remove()
    return d.encode(seen["x"])


def test_completions_features_equal_the_reference_and_stream_as_collected(live, saes):
    body = {"prompt": "features, token by token", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
            "features": {"sae": "topk1", "top_k": 4, "positions": "all", "ids": [0, 3], "error_norm": True}}
    r = post(live, "/v1/completions", {**body, "logprobs": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    feats = choice["features"]
    assert feats["sae"] == "topk1" and len(feats["tokens"]) == 6 == len(choice["logprobs"]["tokens"])
    prompt = live.app.state.server.loaded.tokenizer.encode(body["prompt"])
    P = len(prompt)
    assert [e["position"] for e in feats["prompt"]] == list(range(P - 1))
    assert [e["position"] for e in feats["tokens"]] == list(range(P - 1, P + 5))
    tokens = greedy_tokens(live.model, [prompt], 6)[0]  # the served tokens (their text may not re-encode to them)
    assert live.app.state.server.loaded.tokenizer.decode(tokens) == choice["text"]
    f = reference(live, saes, "topk1", prompt + tokens[:5])
    for e in feats["prompt"] + feats["tokens"]:
        ref = f[e["position"]]
        tol = 1e-4 * f.abs().max().item()
        assert 0 < len(e["top"]) <= 4 and all(t["activation"] > 0 for t in e["top"])  # TopK k=5: inactive left out
        assert [t["activation"] for t in e["top"]] == pytest.approx(ref.topk(len(e["top"])).values.tolist(), abs=tol)
        assert e["ids"] == pytest.approx(ref[[0, 3]].tolist(), abs=tol)
        assert e["error_norm"] > 0
    # streamed: one chunk a token, each with its features; the same numbers
    chunks = [c for ev in stream(live, "/v1/completions", body) for c in ev["choices"] if "features" in c]
    assert len(chunks) == 6
    assert [e for c in chunks for e in c["features"]["prompt"]] == feats["prompt"]
    assert [e for c in chunks for e in c["features"]["tokens"]] == feats["tokens"]


def test_chat_and_responses_carry_features(live):
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0.0, "features": {"sae": "relu0", "top_k": 3}}
    r = post(live, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    feats = r.json()["choices"][0]["features"]
    assert feats["sae"] == "relu0" and feats["prompt"] == [] and 1 <= len(feats["tokens"]) <= 4
    chunks = [c for ev in stream(live, "/v1/chat/completions", body) for c in ev["choices"] if "features" in c]
    assert [e for c in chunks for e in c["features"]["tokens"]] == feats["tokens"]
    r = post(live, "/v1/responses", {"input": "hi", "max_output_tokens": 4, "temperature": 0.0,
                                     "features": {"sae": "relu0", "top_k": 3}})
    assert r.status_code == 200, r.text
    assert r.json()["features"]["tokens"] == feats["tokens"]  # the same prompt, greedy: the same rows
    events = stream(live, "/v1/responses", {"input": "hi", "max_output_tokens": 4, "temperature": 0.0,
                                            "features": {"sae": "relu0", "top_k": 3}})
    deltas = [e for e in events if e["type"] == "response.features.delta"]
    assert [t for e in deltas for t in e["tokens"]] == feats["tokens"]


@pytest.mark.parametrize("features, param", [
    ({"sae": "nope"}, "features.sae"),
    ({"sae": "topk1", "top_k": 0}, "features.top_k"),
    ({"sae": "topk1", "top_k": 65}, "features.top_k"),
    ({"sae": "topk1", "ids": [F]}, "features.ids"),
    ({"sae": "topk1", "positions": "last"}, "features.positions"),
    ({"sae": "topk1", "top_k": "8"}, "features.top_k"),
    ({"sae": "topk1", "extra": 1}, "features.extra"),
    ({"sae": "post"}, "features.sae"),  # loaded, but at a site the engine does not read yet (F wide)
])
def test_refusals_name_the_field_and_the_server_keeps_serving(live, features, param):
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})):
        r = post(live, path, {**body, "features": features})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()
    assert post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_dictionary_at_resid_mid_is_served_and_equals_the_reference(live, saes):
    """blocks.1.hook_resid_mid (many SAELens releases read there): every row's features equal the dictionary's encode
    of the stream after block 1's attention, read by a hook on the MLP's norm's input."""
    body = {"prompt": "between the sub-blocks", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
            "features": {"sae": "mid", "top_k": 3, "positions": "all", "ids": [1, 7]}}
    r = post(live, "/v1/completions", body)
    assert r.status_code == 200, r.text
    feats = r.json()["choices"][0]["features"]
    prompt = live.app.state.server.loaded.tokenizer.encode(body["prompt"])
    tokens = greedy_tokens(live.model, [prompt], 4)[0]
    f = reference(live, saes, "mid", prompt + tokens[:3])
    rows = feats["prompt"] + feats["tokens"]
    assert [e["position"] for e in rows] == list(range(len(prompt) + 3))
    tol = 1e-4 * f.abs().max().item()
    for e in rows:
        ref = f[e["position"]]
        assert [t["activation"] for t in e["top"]] == pytest.approx(ref.topk(len(e["top"])).values.tolist(), abs=tol)
        assert e["ids"] == pytest.approx(ref[[1, 7]].tolist(), abs=tol)
    assert any(e["top"] for e in rows)  # features fire, so the equality means something


def test_saes_are_listed_loaded_within_the_allowed_directories_and_unloaded(live, saes):
    r = httpx.get(live.url + "/v1/saes")
    assert r.status_code == 200
    listed = {d["name"]: d for d in r.json()["data"]}
    assert set(listed) == {"topk1", "relu0", "mid", "post"}
    assert listed["topk1"] | {} == {"name": "topk1", "object": "sae", "format": listed["topk1"]["format"],
                                    "hook_in": "blocks.1.hook_resid_post", "hook_out": "blocks.1.hook_resid_post",
                                    "d_in": D, "d_sae": F, "d_out": D, "activation": "topk", "k": 5,
                                    "bytes": (2 * D * F + F + D) * 4, "dtype": "float32", "encoder": "float32",
                                    "transcoder": False}
    assert listed["relu0"]["hook_in"] == "blocks.0.hook_mlp_out" and listed["relu0"]["k"] is None
    allowed = saes / "allowed"
    for path, param in ((saes / "outside" / "other", "path"), (allowed / "link", "path"),
                        (allowed / "broken", "cfg.json"), (allowed / "wide", "d_in"), (allowed / "nothing", "path")):
        r = post(live, "/v1/saes", {"name": "new", "path": str(path)})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] is not None
        assert "new" not in [d["name"] for d in httpx.get(live.url + "/v1/saes").json()["data"]]  # nothing loaded
    r = post(live, "/v1/saes", {"name": "topk1", "path": str(allowed / "topk1")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"  # the name is in use
    r = post(live, "/v1/saes", {"name": "again", "path": str(allowed / "topk1")})
    assert r.status_code == 200 and r.json()["hook_in"] == "blocks.1.hook_resid_post"
    body = {"prompt": "x", "max_tokens": 2, "temperature": 0.0, "features": {"sae": "again"}}
    assert post(live, "/v1/completions", body).json()["choices"][0]["features"]["tokens"]
    assert httpx.delete(live.url + "/v1/saes/again").status_code == 200
    assert httpx.delete(live.url + "/v1/saes/again").status_code == 404
    r = post(live, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "features.sae"


def test_an_int8_encoder_reads_within_its_rounding_of_the_float32_one(live, saes):
    """POST /v1/saes with `encoder` "int8" (the server's default here is float32): listed so, and each token's top
    features within 2% of the largest activation of the same dictionary's float32 reads, on the same greedy tokens;
    an encoder the server does not have is a 400 naming it."""
    r = post(live, "/v1/saes", {"name": "q8", "path": str(saes / "allowed" / "relu0"), "encoder": "int8"})
    assert r.status_code == 200 and r.json()["encoder"] == "int8", r.text
    try:
        read = {"top_k": 4, "positions": "all", "ids": [0, 7]}
        body = {"prompt": "rounded features", "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
        got = {name: post(live, "/v1/completions", {**body, "features": {"sae": name, **read}}).json()["choices"][0]
               for name in ("relu0", "q8")}
        assert got["q8"]["text"] == got["relu0"]["text"]  # reading changes nothing
        exact, rounded = (got[n]["features"]["prompt"] + got[n]["features"]["tokens"] for n in ("relu0", "q8"))
        tol = 2e-2 * max(t["activation"] for e in exact for t in e["top"])
        assert len(exact) == len(rounded) > 0
        for e, q in zip(exact, rounded):
            assert [t["activation"] for t in q["top"]] == pytest.approx([t["activation"] for t in e["top"]], abs=tol)
            assert q["ids"] == pytest.approx(e["ids"], abs=tol)
        assert exact != rounded  # the int8 kernel did run
    finally:
        httpx.delete(live.url + "/v1/saes/q8")
    r = post(live, "/v1/saes", {"name": "q4", "path": str(saes / "allowed" / "relu0"), "encoder": "int4"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoder", r.text


def test_run_time_loading_is_off_without_allowed_directories(tiny_live, saes):
    with tiny_live(Settings()) as server:
        r = httpx.post(server.url + "/v1/saes", json={"name": "a", "path": str(saes / "allowed" / "topk1")})
        assert r.status_code == 403 and r.json()["error"]["code"] == "sae_loading_off"
        assert httpx.get(server.url + "/v1/saes").json()["data"] == []


@pytest.mark.slow
def test_the_shipped_sae_on_the_default_model(default_model):
    """The shipped TopK k=32 dictionary at block 15's output of the default model, over a live server: every token
    carries at most 32 active features, the largest first."""
    from live_server import LiveServer
    from service.main import create_app

    shipped = Path(__file__).resolve().parents[2] / "model/features/sae/shipped"
    folder = next(shipped.iterdir())
    app = create_app(Settings(sae=[f"resid15={folder}"]), loaded=default_model, wait_ready=True)
    with LiveServer(app) as server:
        r = httpx.post(server.url + "/v1/completions", timeout=300, json={
            "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0.0,
            "features": {"sae": "resid15", "top_k": 64, "positions": "all"}})
        assert r.status_code == 200, r.text
        feats = r.json()["choices"][0]["features"]
        entries = feats["prompt"] + feats["tokens"]
        assert len(feats["tokens"]) == 5
        for e in entries:
            acts = [t["activation"] for t in e["top"]]
            assert 0 < len(acts) <= 32 and acts == sorted(acts, reverse=True)


def test_the_sae_flag_takes_several_and_adds_when_repeated(saes):
    """`--sae a=A b=B` and `--sae a=A --sae b=B` name the same two dictionaries (a repeated list flag adds, as a
    user repeating it means); the same name twice stops the server at start."""
    from service.config import parse_cli

    a, b = (f"{n}={saes / 'allowed' / n}" for n in ("topk1", "relu0"))
    assert parse_cli(["--sae", a, b]).sae == parse_cli(["--sae", a, "--sae", b]).sae == [a, b]
    with pytest.raises(SystemExit):
        parse_cli(["--sae", a, "--sae", a])
