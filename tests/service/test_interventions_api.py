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
from hf_reference import SENTENCES, SUMMER

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


SHOUTED = ["I LOVE THE SUMMER SUN", "WE WENT TO THE MARKET TODAY", "THIS IS THE BEST DAY EVER",
           "PLEASE CALL ME TOMORROW", "THE DOG RAN ACROSS THE FIELD"]
HELD_OUT = ["Write a short note to a friend:", "Describe your favourite food.", "The weather today is",
            "Tell me about your city.", "My plan for the weekend is"]


def upper_ratio(texts: list[str]) -> float:
    letters = [c for t in texts for c in t if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(1, len(letters))


def test_steering_vector_from_contrastive_pairs(server):
    """A vector built by POST /v1/vectors from five pairs (the same sentence shouted and not) makes greedy output on
    five other prompts shout: the share of capital letters goes up; at scale 0 the text is the unsteered text, to
    the character."""
    r = httpx.post(server.url + "/v1/vectors", json={"name": "shout", "layers": [8], "positive": SHOUTED,
                                                       "negative": [s.lower().capitalize() for s in SHOUTED]}, timeout=300)
    assert r.status_code == 200, r.text
    try:
        def texts(scale: float | None) -> list[str]:
            edit = None if scale is None else [{"vector": {"name": "shout"}, "scale": scale}]
            body = post(server, "/v1/completions", {"prompt": HELD_OUT, "max_tokens": 24, "temperature": 0,
                                                    "interventions": edit})
            return [c["text"] for c in body["choices"]]

        plain, zero, steered = texts(None), texts(0.0), texts(1.0)
        print(f"\ncapital letters: unsteered {upper_ratio(plain):.2f}, steered {upper_ratio(steered):.2f} "
              f"(vector norm {r.json()['norms']['8']:.1f})\n  {plain[0]!r}\n  {steered[0]!r}")
        assert zero == plain
        assert upper_ratio(steered) > upper_ratio(plain) + 0.3
    finally:
        httpx.delete(server.url + "/v1/vectors/shout")


# ---- a tiny model: errors, stored vectors, control vectors, streaming ------------------------------------------


@pytest.fixture(scope="module")
def control_gguf(tmp_path_factory) -> tuple[str, dict[int, np.ndarray]]:
    """A llama.cpp control vector for the tiny model (width 64): direction.1 and direction.3, written with the
    gguf package as cvector-generator writes them."""
    import gguf

    path = tmp_path_factory.mktemp("cvec") / "calm.gguf"
    g = np.random.default_rng(0)
    directions = {1: g.standard_normal(64).astype(np.float32), 3: g.standard_normal(64).astype(np.float32)}
    w = gguf.GGUFWriter(str(path), "controlvector")
    w.add_string("controlvector.model_hint", "llama")
    w.add_uint32("controlvector.layer_count", len(directions))
    for layer, v in directions.items():
        w.add_tensor(f"direction.{layer}", v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path), directions


@pytest.fixture(scope="module")
def vector_server(control_gguf, tiny_live):
    from service.config import Settings
    from tiny import tiny_model

    settings = Settings(control_vector=f"{control_gguf[0]}:2.0", max_vectors=4)
    with tiny_live(settings, tiny_model(seed=4, n_layers=6, max_seq_len=1024)) as live:
        yield live


def _vector(seed: int, dim: int = 64, norm: float = 8.0) -> list[float]:
    v = np.random.default_rng(seed).standard_normal(dim)
    return (v / np.linalg.norm(v) * norm).tolist()


def test_malformed_items_are_400s_naming_the_field(vector_server):
    def err(body: dict, path: str = "/v1/completions") -> tuple[str, str]:
        base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
        r = httpx.post(vector_server.url + path, json={**base, **body}, timeout=60)
        assert r.status_code == 400, r.text
        e = r.json()["error"]
        return e["param"], e["message"]

    cases = [
        ({"interventions": [{"layer": 0, "vector": [1.0, 2.0]}]}, "interventions[0].vector", "width is 64"),
        ({"interventions": [{"layer": 6, "vector": _vector(0)}]}, "interventions[0].layer", "out of range"),
        ({"interventions": [{"layer": 0, "vector": _vector(0)}, {"layer": 1, "vector": {"name": "nope"}}]},
         "interventions[1].vector", "no stored vector named 'nope'"),
        ({"interventions": [{"layer": 0, "op": "set", "dims": [1, 2], "values": [0.0]}]}, "interventions[0].values", "one value per dim"),
        ({"interventions": [{"layer": 0, "op": "scale", "dims": [64]}]}, "interventions[0].dims", "[0, 64)"),
        ({"interventions": [{"layer": 0, "op": "add"}]}, "interventions[0].vector", "needs a vector"),
        ({"interventions": [{"op": "set", "dims": [0], "values": [1.0]}]}, "interventions[0].layer", "give the block"),
        ({"interventions": [{"layer": 2, "op": "project_out", "vector": _vector(1)},
                            {"layer": 2, "op": "project_out", "vector": _vector(2)}]}, "interventions[1].op", "one project_out"),
        ({"interventions": [{"layer": 0, "vector": {"name": "calm"}}]}, "interventions[0].vector", "no direction for block 0"),
        ({"return_hidden_states": {"layers": [9]}}, "return_hidden_states.layers", "[0, 6)"),
    ]
    for body, param, words in cases:
        got_param, message = err(body)
        assert got_param == param and words in message, (body, got_param, message)
    # schema-level refusals name the field too
    for bad in ({"layer": 0, "op": "paint", "vector": _vector(0)}, {"layer": 0, "positions": [-1], "vector": _vector(0)},
                {"layer": 0, "site": "residual", "vector": _vector(0)}):
        param, _ = err({"interventions": [bad]})
        assert param.startswith("interventions"), param
    nan = '{"prompt": "hi", "interventions": [{"layer": 0, "vector": [NaN' + ", 0.0" * 63 + "]}]}"
    r = httpx.post(vector_server.url + "/v1/completions", content=nan, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "interventions" in r.json()["error"]["param"], r.text
    param, _ = err({"interventions": [{"layer": 7, "vector": _vector(0)}]}, "/inspect")
    assert param == "interventions[0].layer"
    assert httpx.get(vector_server.url + "/health").status_code == 200


def test_stored_vectors_lifecycle(vector_server):
    pairs = {"positive": ["I am so happy today", "What a wonderful day"],
             "negative": ["I am so sad today", "What a terrible day"]}
    r = httpx.post(vector_server.url + "/v1/vectors", json={"name": "joy", "layers": [1, 4], **pairs}, timeout=120)
    assert r.status_code == 200, r.text
    v = r.json()
    assert v["name"] == "joy" and v["layers"] == [1, 4] and v["dim"] == 64 and v["source"] == "contrastive"
    stored = {int(l): np.frombuffer(base64.b64decode(d), "<f4") for l, d in v["data"].items()}
    # the mean difference of the last token's block outputs, as the probes read them
    from model.probes import ProbeOptions, ProbeRun
    from tiny import byte_tokenizer

    model, tok = vector_server.app.state.server.loaded.model, byte_tokenizer()

    def last(text: str) -> dict[int, torch.Tensor]:
        ids = tok.encode(text)
        res = ProbeRun(model, ids, ProbeOptions(layers=[1, 4], include=frozenset({"hidden_states"}),
                                                hidden_positions=[len(ids) - 1])).run()
        return {p.layer: p.hidden[0] for p in res.layers}

    P, N = [last(t) for t in pairs["positive"]], [last(t) for t in pairs["negative"]]
    for layer in (1, 4):
        want = torch.stack([p[layer] - n[layer] for p, n in zip(P, N)]).mean(0)
        assert np.abs(stored[layer] - want.numpy()).max() <= 1e-5 * np.abs(want.numpy()).max(), layer  # chunking: rounding
    listed = httpx.get(vector_server.url + "/v1/vectors").json()["data"]
    assert {x["name"] for x in listed} == {"joy", "calm"}
    assert httpx.get(vector_server.url + "/v1/vectors/joy").json()["data"] == v["data"]
    dup = httpx.post(vector_server.url + "/v1/vectors", json={"name": "joy", "layers": [1], **pairs}, timeout=60)
    assert dup.status_code == 409 and dup.json()["error"]["param"] == "name"
    for body, param in (({"name": "x", "layers": [1], "positive": ["a"], "negative": ["b", "c"]}, "negative"),
                        ({"name": "x", "layers": [6], "positive": ["a"], "negative": ["b"]}, "layers"),
                        ({"name": "no spaces", "layers": [1], "positive": ["a"], "negative": ["b"]}, "name")):
        r = httpx.post(vector_server.url + "/v1/vectors", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # a named vector is its inline directions
    named = post(vector_server, "/v1/completions", {"prompt": "Today", "max_tokens": 8, "temperature": 0, "logprobs": 1,
                                           "interventions": [{"vector": {"name": "joy"}, "scale": 3.0}]})
    inline = post(vector_server, "/v1/completions", {"prompt": "Today", "max_tokens": 8, "temperature": 0, "logprobs": 1,
                                            "interventions": [{"layer": l, "vector": stored[l].tolist(), "scale": 3.0}
                                                              for l in (1, 4)]})
    assert named["choices"][0]["logprobs"] == inline["choices"][0]["logprobs"]
    assert httpx.delete(vector_server.url + "/v1/vectors/joy").json() == {"object": "vector.deleted", "name": "joy", "deleted": True}
    assert httpx.delete(vector_server.url + "/v1/vectors/joy").status_code == 404
    assert httpx.get(vector_server.url + "/v1/vectors/joy").status_code == 404
    r = httpx.post(vector_server.url + "/v1/completions", json={"prompt": "x", "interventions": [{"vector": {"name": "joy"}}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "vector_not_found"


def test_control_vector_gguf_adds_direction_n_at_block_n(vector_server, control_gguf):
    """--control-vector calm.gguf:2.0 stores `calm`: direction.N x 2 at block N's output (llama.cpp's reading)."""
    _, directions = control_gguf
    calm = next(v for v in httpx.get(vector_server.url + "/v1/vectors").json()["data"] if v["name"] == "calm")
    assert calm["layers"] == [1, 3] and calm["source"] == "gguf" and calm["scale"] == 2.0
    stored = {int(l): np.frombuffer(base64.b64decode(d), "<f4")
              for l, d in httpx.get(vector_server.url + "/v1/vectors/calm").json()["data"].items()}
    for layer, v in directions.items():
        assert np.array_equal(stored[layer], 2.0 * v)
    body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "logprobs": 2}
    named = post(vector_server, "/v1/completions", {**body, "interventions": [{"vector": {"name": "calm"}}]})
    inline = post(vector_server, "/v1/completions", {**body, "interventions": [
        {"layer": l, "site": "block_output", "vector": (2.0 * v).tolist()} for l, v in directions.items()]})
    plain = post(vector_server, "/v1/completions", body)
    assert named["choices"][0]["logprobs"] == inline["choices"][0]["logprobs"] != plain["choices"][0]["logprobs"]


def test_control_vector_files_llama_cpp_would_refuse(tmp_path):
    import gguf

    from service.microscope.vectors import load_control_vector

    def write(name: str, tensors: dict[str, np.ndarray]) -> str:
        w = gguf.GGUFWriter(str(tmp_path / name), "controlvector")
        for k, v in tensors.items():
            w.add_tensor(k, v)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return str(tmp_path / name)

    ok = np.ones(64, dtype=np.float32)
    for tensors, words in (({"direction.0": ok}, "N >= 1"), ({"direction.1": np.ones(8, np.float32)}, "width is 64"),
                           ({"direction.9": ok}, "beyond the model's 6 blocks"), ({"bias.1": ok}, "not direction.N")):
        with pytest.raises(ValueError, match=words):
            load_control_vector(write(f"{len(words)}.gguf", tensors), 6, 64)
    with pytest.raises(ValueError, match="no such file"):
        load_control_vector(str(tmp_path / "missing.gguf:1.5"), 6, 64)


def test_streaming_n2_seeds_and_stops_behave_as_without_interventions(vector_server):
    """The same request streamed and not: the same text, logprobs and hidden states (each chunk carrying its own
    positions); n = 2 seeded choices differ from each other and repeat with the seed; a stop string ends it."""
    edit = [{"layer": 2, "vector": _vector(3), "positions": "generated"},
            {"layer": 0, "op": "scale", "dims": [0, 1, 2], "factor": 0.5}]
    body = {"prompt": "The cat", "max_tokens": 12, "temperature": 0.9, "seed": 5, "n": 2, "logprobs": 1,
            "interventions": edit, "return_hidden_states": {"layers": [1, 5], "positions": "last"}}
    whole = post(vector_server, "/v1/completions", body)
    again = post(vector_server, "/v1/completions", body)
    assert whole["choices"] == again["choices"]
    a, b = whole["choices"]
    assert a["text"] != b["text"]
    assert decode(a["hidden_states"]).shape == (12, 2, 64) and a["hidden_states"]["positions"] == list(range(6, 18))
    chunks: dict[int, list] = {0: [], 1: []}
    with httpx.stream("POST", vector_server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    chunks[c["index"]].append(c)
    for i, choice in enumerate(whole["choices"]):
        got = chunks[i]
        assert "".join(c["text"] for c in got) == choice["text"]
        hs = [c["hidden_states"] for c in got if c["hidden_states"] is not None]
        assert [p for h in hs for p in h["positions"]] == choice["hidden_states"]["positions"]
        assert np.array_equal(np.concatenate([decode(h) for h in hs]), decode(choice["hidden_states"]))
    plain = post(vector_server, "/v1/completions", {k: v for k, v in body.items() if k not in ("interventions",)})
    assert [c["text"] for c in plain["choices"]] != [c["text"] for c in whole["choices"]]
    stop = a["text"][3:5]
    stopped = post(vector_server, "/v1/completions", {**body, "n": 1, "stop": [stop]})["choices"][0]
    assert stopped["finish_reason"] == "stop" and stop not in stopped["text"]
