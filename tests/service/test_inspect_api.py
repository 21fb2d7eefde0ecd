"""POST /inspect and the completions `inspect` extension, over HTTP: the default model's known massive activations
and sinks, the byte budget, map encodings, errors, and sharing the engine with completions."""

from __future__ import annotations

import base64
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from model.generate import generate
from model.probes import ProbeOptions, inspect
from service.config import Settings
from tiny import tiny_model

SUMMER = "Summer is warm. Winter is cold.\n"


def decode(arr: dict) -> np.ndarray:
    if arr["encoding"] == "list":
        return np.array(arr["data"], dtype=np.float32)
    dtype = "<f2" if arr["dtype"] == "float16" else "<i4"
    return np.frombuffer(base64.b64decode(arr["data"]), dtype=dtype).reshape(arr["shape"])


@pytest.fixture(scope="module")
def inspect_server(tiny_live):
    settings = Settings(max_inspect_tokens=3000, max_inspect_response_bytes=4 << 20)
    with tiny_live(settings, tiny_model(seed=4, n_layers=12, max_seq_len=4096)) as live:
        yield live


# ---- the default model ---------------------------------------------------------------------------------------


@torch.no_grad()
def _hf_eager(model, ids: list[int]):
    """transformers' forward with attention probabilities (eager attention: SDPA returns none) and hidden states."""
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        return model(torch.tensor([ids]), output_attentions=True, output_hidden_states=True)
    finally:
        model.set_attn_implementation(before)


def test_default_model_massive_activations_and_sinks(server, hf_gguf_model):
    r = httpx.post(server.url + "/inspect", json={"prompt": SUMMER}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"][0]["text"] == "Summer" and len(body["tokens"]) == 9
    flagged = {l["layer"]: l for l in body["layers"] if l["num_massive"]}
    assert sorted(flagged) == list(range(11, 28)), "massive activations in blocks 11..27 only"
    for layer in flagged.values():
        e = layer["massive"][0]
        assert (e["token"], e["dim"], e["massive"]) == (0, 507, True)
        assert abs(e["value"]) > 2e4 and e["ratio"] > 1000
    s = body["summary"]
    assert (s["first_massive_layer"], s["last_massive_layer"], s["massive_dims"]) == (11, 27, [507])
    assert s["massive_tokens"] == [{"index": 0, "text": "Summer"}]
    # first-token sinks: most heads of the later blocks put most of their attention on token 0
    late = [h["sink_mass"] for l in body["layers"][12:] for h in l["attention"]["heads"]]
    assert sum(m > 0.5 for m in late) / len(late) > 0.7
    assert np.mean(s["sink_mass_by_layer"][12:]) > 0.6 > np.mean(s["sink_mass_by_layer"][:2])
    # the mass on the massive token is token 0's mass here (it is the only one)
    h = body["layers"][20]["attention"]["heads"][0]
    assert h["massive_mass"] == pytest.approx(h["sink_mass"])
    # maps: full by default at this size, rows sum to 1, and A is causal
    maps = body["layers"][20]["attention"]["maps"]
    assert body["mode"] == maps["mode"] == "full"
    A = decode(maps["values"]).astype(np.float32)
    assert A.shape == (9, 9, 9)
    assert np.allclose(A.sum(-1), 1, atol=5e-3) and np.all(np.triu(A, 1) == 0)
    # The same facts from transformers on the same file (eager attention): the flagged values are its hidden
    # states' entries, every head's sink mass is its attention's, and the map is its map (to float16 rounding).
    hf = _hf_eager(hf_gguf_model, [t["id"] for t in body["tokens"]])
    for layer, entry in flagged.items():
        assert entry["massive"][0]["value"] == pytest.approx(float(hf.hidden_states[layer + 1][0, 0, 507]), rel=1e-4)
    for layer in body["layers"]:
        probs = hf.attentions[layer["layer"]][0]  # (H, T, T)
        sinks = probs[:, 1:, 0].mean(-1)  # (H,): queries 1..T-1 on token 0
        assert [h["sink_mass"] for h in layer["attention"]["heads"]] == pytest.approx(sinks.tolist(), abs=1e-4)
    assert np.abs(A - hf.attentions[20][0].numpy()).max() < 1e-3
    assert body["usage"]["response_bytes"] == len(r.content)


@pytest.mark.slow
def test_budget_refuses_full_maps_at_2048_and_pooled_fits(server):
    ids = (list(range(1000, 1100)) * 21)[:2048]
    r = httpx.post(server.url + "/inspect", json={"input_ids": ids, "mode": "full"}, timeout=60)
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == "inspect_too_large" and err["param"] == "mode"
    assert "mode 'pooled' with pool_size >= " in err["message"] and "budget" in err["message"]
    r = httpx.post(server.url + "/inspect", json={"input_ids": ids, "mode": "pooled", "pool_size": 32,
                                                   "include": ["attention", "massive"]}, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["response_bytes"] <= Settings().max_inspect_response_bytes
    P = decode(body["layers"][15]["attention"]["maps"]["values"]).astype(np.float32)
    assert P.shape == (9, 64, 64) and np.allclose(P.sum(-1), 1, atol=2e-2)
    assert body["summary"]["massive_tokens"][0]["index"] == 0


def test_completions_inspect_extension_through_openai(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    out = client.completions.create(model=server.app.state.server.model_name, prompt=SUMMER, max_tokens=4,
                                    temperature=0, extra_body={"inspect": True})
    assert out.choices[0].text
    (summary,) = out.model_extra["inspect"]
    assert summary["prompt_index"] == 0
    assert summary["summary"]["massive_layers"] == list(range(11, 28))
    assert len(summary["summary"]["sink_mass_by_layer"]) == 30


# ---- a tiny random model -------------------------------------------------------------------------------------


def test_response_maps_equal_the_probe(inspect_server):
    ids = [7, 100, 42, 9, 9, 250, 3, 77, 61, 12, 200]
    ref = inspect(inspect_server.model, ids, ProbeOptions(mode="full", heads=[1, 3], layers=[2, 5]))
    for fmt in ("base64", "list"):
        r = httpx.post(inspect_server.url + "/inspect", json={"input_ids": ids, "mode": "full", "heads": [1, 3], "layers": [2, 5],
                                                     "format": fmt, "include": ["attention"]}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["layers_selected"] == [2, 5] and body["heads_selected"] == [1, 3] and body["kv_groups"] == [0, 1]
        for layer, probe in zip(body["layers"], ref.layers):
            got = decode(layer["attention"]["maps"]["values"])
            assert np.allclose(got, probe.maps.values.numpy(), atol=1e-3)
            assert "residual_norm" not in layer and "logit_lens" not in layer


def test_topk_rows_and_pooled_in_the_response(inspect_server):
    ids = list(range(40, 90))
    r = httpx.post(inspect_server.url + "/inspect", json={"input_ids": ids, "mode": "topk", "attention_top_k": 3, "layers": [0]}, timeout=60).json()
    maps = r["layers"][0]["attention"]["maps"]
    assert decode(maps["indices"]).shape == decode(maps["values"]).shape == (4, 50, 3)
    r = httpx.post(inspect_server.url + "/inspect", json={"input_ids": ids, "mode": "rows", "rows": [0, -1], "layers": [0]}, timeout=60).json()
    maps = r["layers"][0]["attention"]["maps"]
    assert maps["rows"] == [0, 49] and decode(maps["values"]).shape == (4, 2, 50)
    r = httpx.post(inspect_server.url + "/inspect", json={"input_ids": ids, "mode": "pooled", "pool_size": 8, "layers": [0]}, timeout=60).json()
    maps = r["layers"][0]["attention"]["maps"]
    assert (maps["pool_size"], maps["reduce"]) == (8, "mean") and decode(maps["values"]).shape == (4, 7, 7)


def test_chat_messages_are_rendered_with_the_template(server):
    msgs = [{"role": "user", "content": "What is 2+2?"}]  # float32 greedy: no near-tie (tests/model/test_default_model.py)
    r = httpx.post(server.url + "/inspect", json={"messages": msgs, "max_tokens": 8, "include": ["massive"]}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    tok = server.app.state.server.loaded.tokenizer
    prompt = tok.encode(tok.apply_chat_template(msgs), add_bos=False)
    assert [t["id"] for t in body["tokens"][: len(prompt)]] == prompt and body["num_prompt_tokens"] == len(prompt)
    want = list(generate(server.app.state.server.loaded.model, prompt, 8, tok.stop_ids))  # the reference loop
    assert body["completion"]["token_ids"] == want and body["completion"]["text"] == tok.decode(want, skip_special_tokens=True)
    assert body["mode"] == "none" and "attention" not in body["layers"][0]


def test_generate_then_inspect(inspect_server):
    r = httpx.post(inspect_server.url + "/inspect", json={"prompt": "abc", "max_tokens": 5, "lens_positions": [0, -1]}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["num_prompt_tokens"] == 3 and len(body["completion"]["token_ids"]) == 5
    assert len(body["tokens"]) == 8 and body["usage"]["completion_tokens"] == 5
    assert [e["position"] for e in body["layers"][-1]["logit_lens"]] == [0, 7]
    # greedy: the last block's lens at position 2 predicts the first generated token
    r2 = httpx.post(inspect_server.url + "/inspect", json={"prompt": "abc", "lens_positions": [2], "lens_top_k": 1}, timeout=60).json()
    assert r2["layers"][-1]["logit_lens"][0]["top"][0]["id"] == body["completion"]["token_ids"][0]


def test_auto_mode_falls_back_to_pooling(inspect_server):
    ids = [5] * 2000  # 12 layers x 4 heads x 2000^2 half floats: far over the 4 MB budget of this server
    r = httpx.post(inspect_server.url + "/inspect", json={"input_ids": ids, "include": ["attention"]}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["mode"] == "pooled" and body["usage"]["response_bytes"] < 4 << 20


@pytest.mark.parametrize("body,status,param,needle", [
    ({"prompt": "x", "layers": [12]}, 400, "layers", "out of range"),
    ({"prompt": "x", "heads": [4]}, 400, "heads", "out of range"),
    ({"prompt": "x", "input_ids": [1]}, 400, "prompt", "exactly one"),
    ({}, 400, "prompt", "exactly one"),
    ({"prompt": ""}, 400, "prompt", "at least 1"),
    ({"input_ids": [258]}, 400, "input_ids", "vocabulary"),
    ({"prompt": "xy", "mode": "rows"}, 400, "rows", "rows"),
    ({"prompt": "xy", "mode": "rows", "rows": [2]}, 400, "rows", "[-2, 2)"),
    ({"prompt": "x", "include": ["massive"], "mode": "full"}, 400, "mode", "attention"),
    ({"prompt": "x", "massive_ratio": 0}, 400, "massive_ratio", ""),
    ({"prompt": "x", "mode": "everything"}, 400, "mode", ""),
    ({"prompt": "x", "layers": [1, 1]}, 400, "layers", "repeat"),
    ({"prompt": "x", "max_tokens": 5000}, 400, "max_tokens", "context"),
    ({"input_ids": [1] * 3001}, 413, "prompt", "max_inspect_tokens"),
    ({"input_ids": [1] * 2000, "max_tokens": 1001}, 413, "max_tokens", "max_inspect_tokens"),
    ({"input_ids": [1] * 1024, "mode": "full"}, 413, "mode", "pooled"),
    ({"prompt": "x", "model": "other"}, 404, "model", "does not exist"),
])
def test_client_errors_are_envelopes(inspect_server, body, status, param, needle):
    r = httpx.post(inspect_server.url + "/inspect", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param or err["param"].startswith(param), err
    assert needle in err["message"]
    assert httpx.post(inspect_server.url + "/inspect", json={"prompt": "still fine"}, timeout=60).status_code == 200


def test_completions_with_inspect_refuse_long_prompts(inspect_server):
    r = httpx.post(inspect_server.url + "/v1/completions", json={"prompt": [1] * 3001, "max_tokens": 1, "inspect": True}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "inspect_too_long"


def test_inspect_does_not_stall_completions(inspect_server):
    """A long inspection steps a block at a time between engine steps: a short completion submitted after it
    started finishes first, and the inspection still completes."""
    done: dict[str, float] = {}

    def long_inspect():
        r = httpx.post(inspect_server.url + "/inspect", json={"input_ids": [3] * 2000, "mode": "none"}, timeout=300)
        assert r.status_code == 200
        done["inspect"] = time.perf_counter()

    t = threading.Thread(target=long_inspect)
    t.start()
    deadline = time.monotonic() + 60
    state = inspect_server.app.state.server
    while not state.engine._jobs and time.monotonic() < deadline:  # wait until the engine thread has the job
        time.sleep(0.01)
    r = httpx.post(inspect_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=300)
    done["completion"] = time.perf_counter()
    t.join()
    assert r.status_code == 200
    assert done["completion"] < done["inspect"]


def test_queue_limit_is_a_429(inspect_server, monkeypatch):
    state = inspect_server.app.state.server
    monkeypatch.setattr(state.settings, "max_inspect_queued", 0)
    r = httpx.post(inspect_server.url + "/inspect", json={"prompt": "x"}, timeout=60)
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"


def test_non_finite_activations_become_null():
    from service.microscope.inspect_format import dumps_with_size

    data = dumps_with_size({"layers": [{"max_abs": float("inf"), "residual_norm": [1.0, float("nan")]}], "usage": {}})
    import json

    body = json.loads(data)
    assert body["layers"][0] == {"max_abs": None, "residual_norm": [1.0, None]}
    assert body["usage"]["response_bytes"] == len(data)
