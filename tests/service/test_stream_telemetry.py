"""Over HTTP, on the default model: `inspect: {"stream": true}` puts each token's attention telemetry in its chunk,
equal to /inspect on the final sequence; `kv_window` on completions and chat; the errors a client can cause."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from model.probes import ProbeOptions, inspect

SUMMER = "Summer is warm. Winter is cold.\n"


def stream_events(url: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_streamed_telemetry_equals_inspect_on_the_final_sequence(server, default_model):
    """Acceptance: for every generated token, per layer and head, the sink mass its query put on token 0 equals
    /inspect's row of that position within 1e-5 (float32), and its top-k attended positions are /inspect's."""
    n, k = 8, 5
    body = {"prompt": SUMMER, "max_tokens": n, "temperature": 0.0, "stream": True, "inspect": {"stream": True, "top_k": k}}
    chunks = [c for e in stream_events(server.url, body) for c in e["choices"]]
    assert len(chunks) == n and all("inspect" in c for c in chunks)
    prompt = default_model.tokenizer.encode(SUMMER)
    tokens = [c["token_id"] for c in chunks]
    positions = [c["inspect"]["position"] for c in chunks]
    assert positions == list(range(len(prompt) - 1, len(prompt) + n - 1))  # the query that produced each token
    first = chunks[0]["inspect"]
    assert first["sink_tokens"] == 1 and len(first["layers"]) == default_model.model.config.n_layers
    layer = first["layers"][5]
    assert len(layer["sink_mass_heads"]) == 9 and len(layer["top_positions"]) == 9 and len(layer["top_positions"][0]) == k
    assert layer["sink_mass"] == pytest.approx(sum(layer["sink_mass_heads"]) / 9, abs=1e-6)

    # /inspect over HTTP: rows mode, full rows as lists (rounded to 5 decimals there)
    r = httpx.post(server.url + "/inspect", json={"input_ids": prompt + tokens, "mode": "rows", "rows": positions,
                                                  "format": "list", "include": ["attention"]}, timeout=300)
    assert r.status_code == 200, r.text
    maps = {l["layer"]: torch.tensor(l["attention"]["maps"]["values"]["data"]) for l in r.json()["layers"]}  # (H, R, T)
    # the same inspection in-process, unrounded: the top-k order must match exactly
    exact = inspect(default_model.model, prompt + tokens, ProbeOptions(mode="rows", rows=positions, include=frozenset({"attention"})))
    for probe in exact.layers:
        p = probe.maps.values  # (H, R, T)
        for i, c in enumerate(chunks):
            got = c["inspect"]["layers"][probe.layer]
            assert torch.allclose(torch.tensor(got["sink_mass_heads"]), maps[probe.layer][:, i, 0], atol=1e-5)
            assert torch.allclose(torch.tensor(got["sink_mass_heads"]), p[:, i, 0], atol=1e-5)
            top = torch.sort(p[:, i], dim=-1, descending=True, stable=True)
            assert got["top_positions"] == top.indices[:, :k].tolist(), (probe.layer, i)
            assert torch.allclose(torch.tensor(got["top_weights"]), top.values[:, :k], atol=1e-5)
    # the default model's attention sink: most of the mass of the middle blocks goes to token 0
    assert min(first["layers"][i]["sink_mass"] for i in range(3, 10)) > 0.5


def test_telemetry_and_window_errors_are_400s(server):
    url = server.url + "/v1/completions"
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "inspect": {"stream": True}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "inspect" and "stream: true" in r.json()["error"]["message"]
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "kv_window": {"sink_tokens": 4, "window": 1 << 20}}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "kv_window" and "exceeds the context length" in err["message"]
    for bad in ({"window": 0}, {"sink_tokens": -1, "window": 8}, {"window": "8"}, {"sink_tokens": 4}, {"window": 8, "x": 1}):
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "kv_window": bad}, timeout=30)
        assert r.status_code == 400, (bad, r.text)
    r = httpx.post(url, json={"prompt": "hi", "stream": True, "inspect": {"stream": True, "top_k": 0}}, timeout=30)
    assert r.status_code == 400


def test_kv_window_on_completions_and_chat(server):
    """A prompt scored under a window (echo + logprobs) and a chat reply generated with one: the API side works;
    what the window computes is held to the paper's formulation in tests/engine/test_kv_window.py."""
    ids = httpx.post(server.url + "/tokenize", json={"prompt": SUMMER * 12}, timeout=30).json()["tokens"]
    body = {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0, "kv_window": {"sink_tokens": 4, "window": 32}}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    windowed = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    full = httpx.post(server.url + "/v1/completions", json={**body, "kv_window": None}, timeout=300).json()
    full = full["choices"][0]["logprobs"]["token_logprobs"]
    assert len(windowed) == len(full) == len(ids) + 1
    assert windowed[1:53] == pytest.approx(full[1:53], abs=1e-3)  # until the first eviction the two are the same
    assert windowed[60:] != pytest.approx(full[60:], abs=1e-3)
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 40, "temperature": 0.0,
        "kv_window": {"sink_tokens": 4, "window": 16}}, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 40 or r.json()["choices"][0]["finish_reason"] == "stop"


def test_server_default_window(tmp_path):
    """--kv-window W --sink-tokens S: requests without their own kv_window get it, so a server with a small context
    generates past it; a default that cannot fit the context keeps the server from serving, with the reason."""
    from live_server import tiny_live_server
    from service.config import Settings

    settings = Settings(max_model_len=64, block_size=16, kv_window=32, sink_tokens=4)
    with tiny_live_server(settings) as live:
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 200, "ignore_eos": True,
                                                            "temperature": 0.0}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 200, "kv_window": {
            "sink_tokens": 0, "window": 60}}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_window"  # 0 + 60 + 16 > 64
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "abc", "max_tokens": (1 << 17) + 1}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # --max-window-tokens
    too_big = Settings(max_model_len=64, block_size=16, kv_window=60)
    with tiny_live_server(too_big, ready_path="/inspect/ui") as live:  # a page that needs no model
        r = httpx.get(live.url + "/health", timeout=10)
        assert r.status_code == 503 and "kv_window" in r.text
