"""Interventions and hidden states over HTTP on the default model (float32): Sun et al.'s massive-activation
ablation reproduced through completions and /inspect, hidden states against HF's, streaming and n > 1, and every
malformed item a 400 envelope naming its field. `pytest -s` prints the figures docs/inspection.md quotes."""

from __future__ import annotations

import base64
import json
import math
import threading

import httpx
import numpy as np
import pytest
import torch

from model.generate import generate
from test_paper_findings import SENTENCES, SUMMER

BLOCK, DIM = 11, 507


def decode(arr: dict) -> np.ndarray:
    dtype = {"float32": "<f4", "float16": "<f2"}[arr["dtype"]]
    return np.frombuffer(base64.b64decode(arr["data"]), dtype=dtype).reshape(arr["shape"])


def post(server, path: str, body: dict, timeout: float = 300) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def perplexity(server, interventions: list[dict] | None) -> float:
    """exp(mean NLL) of every token after the first of the six sentences: prompt logprobs via echo + logprobs."""
    body = post(server, "/v1/completions", {"prompt": SENTENCES, "max_tokens": 1, "temperature": 0, "echo": True,
                                            "logprobs": 0, "interventions": interventions})
    nll = [-x for c in body["choices"] for x in c["logprobs"]["token_logprobs"][1:-1]]  # [0] None, [-1] generated
    return math.exp(sum(nll) / len(nll))


def zero_or_mean(value: float) -> list[dict]:
    return [{"layer": BLOCK, "op": "set", "dims": [DIM], "values": [value], "positions": [0]}]


def test_massive_activation_ablation_over_http(server):
    """Sun et al. 2024, section 3: setting the massive activation (token 0, dim 507, at the block where it first
    appears) to zero wrecks the model; setting it to its mean over sequences changes almost nothing. The mean is
    read over HTTP too (/inspect hidden states), and /inspect of the edited prompt shows the entry gone and the
    attention sinks of the later blocks moved, the earlier blocks' untouched."""
    values = []
    for s in SENTENCES:
        body = post(server, "/inspect", {"prompt": s, "layers": [BLOCK], "include": ["hidden_states"],
                                         "hidden_positions": [0], "hidden_dtype": "float32"})
        values.append(float(decode(body["layers"][0]["hidden_states"]["values"])[0, DIM]))
    mean = sum(values) / len(values)
    base, zeroed, averaged = perplexity(server, None), perplexity(server, zero_or_mean(0.0)), perplexity(server, zero_or_mean(mean))
    print(f"\nblock {BLOCK} token 0 dim {DIM}: values {min(values):.0f}..{max(values):.0f}, mean {mean:.1f}\n"
          f"perplexity of the six sentences: original {base:.2f}, set to 0 {zeroed:.3g}, set to the mean "
          f"{averaged:.2f} ({100 * (averaged / base - 1):+.2f}%)")
    assert zeroed > 1000 * base  # orders of magnitude
    assert abs(averaged / base - 1) < 0.01  # within 1%

    inspections = {name: post(server, "/inspect", {"prompt": SUMMER, "mode": "none", "interventions": edit,
                                                   "include": ["massive", "attention"]})
                   for name, edit in (("original", None), ("zero", zero_or_mean(0.0)), ("mean", zero_or_mean(mean)))}
    massive = {n: [(l["layer"], e["token"], e["dim"]) for l in b["layers"] for e in l["massive"]] for n, b in inspections.items()}
    assert (BLOCK, 0, DIM) in massive["original"] and (BLOCK, 0, DIM) in massive["mean"]
    assert (BLOCK, 0, DIM) not in massive["zero"]  # gone from the table
    sinks = {n: b["summary"]["sink_mass_by_layer"] for n, b in inspections.items()}
    print("sink mass (mean attention of queries 1..T-1 on token 0) by block, original / zero / mean:")
    for i in range(len(sinks["original"])):
        print(f"  block {i:2d}: {sinks['original'][i]:.2f} / {sinks['zero'][i]:.2f} / {sinks['mean'][i]:.2f}")
    print(f"massive layers after zeroing: {inspections['zero']['summary']['massive_layers']}")
    assert sinks["zero"][: BLOCK + 1] == pytest.approx(sinks["original"][: BLOCK + 1], abs=1e-6)  # untouched up to the edit
    moved = [i for i in range(BLOCK + 1, len(sinks["zero"])) if abs(sinks["zero"][i] - sinks["original"][i]) > 0.3]
    assert len(moved) >= 3, moved  # zeroing the bias moves later blocks' sinks
    assert max(abs(a - b) for a, b in zip(sinks["mean"], sinks["original"])) < 0.05  # the mean does not


def test_hidden_states_equal_hf_over_http(server, hf_gguf_model, default_model):
    """Completions' `return_hidden_states` (prompt and generated positions, while other requests run) and /inspect's
    `hidden_states` against transformers' output_hidden_states on the same GGUF, float32: <= 1e-5 of each layer's
    largest magnitude."""
    tok = default_model.tokenizer
    layers = [0, 5, BLOCK, 20, 28]
    noise = []

    def traffic():  # other requests in the same steps
        for i in range(3):
            noise.append(post(server, "/v1/completions", {"prompt": f"Count to {i + 3}:", "max_tokens": 12}))

    t = threading.Thread(target=traffic)
    t.start()
    body = post(server, "/v1/completions", {"prompt": "The river flows past the old mill", "max_tokens": 8,
                                            "temperature": 0, "return_hidden_states": {"layers": layers, "positions": "all"}})
    t.join()
    c = body["choices"][0]
    ids = tok.encode("The river flows past the old mill")
    tokens = list(generate(default_model.model, ids, 8))  # the greedy tokens the engine produced (same weights)
    assert tok.decode(tokens) == c["text"]
    hs = c["hidden_states"]
    got = decode(hs)  # (positions, layers, D): every position computed, prompt and generated
    assert hs["layers"] == layers and hs["positions"] == list(range(len(ids) + 7)) and got.shape[1:] == (len(layers), 576)
    with torch.inference_mode():
        ref = hf_gguf_model(torch.tensor([ids + tokens[:7]]), output_hidden_states=True).hidden_states
    worst = 0.0
    for j, layer in enumerate(layers):
        want = ref[layer + 1][0].numpy()
        worst = max(worst, float(np.abs(got[:, j] - want).max() / np.abs(want).max()))
    insp = post(server, "/inspect", {"input_ids": ids + tokens[:7], "layers": layers, "include": ["hidden_states"],
                                     "hidden_dtype": "float32"})
    for layer in insp["layers"]:
        want = ref[layer["layer"] + 1][0].numpy()
        worst = max(worst, float(np.abs(decode(layer["hidden_states"]["values"]) - want).max() / np.abs(want).max()))
    print(f"\nhidden states over HTTP vs HF output_hidden_states: max relative difference {worst:.1e}")
    assert worst <= 1e-5
    assert all(len(n["choices"][0]["text"]) > 0 for n in noise)
