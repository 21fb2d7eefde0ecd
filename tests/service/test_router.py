"""Router mode with real processes: a `python -m service --model A --model B --model C --models-max 2` front over
three tiny random checkpoints (benchmarks/tiny_checkpoint.py, one byte tokenizer), each model in its own child.
The module's router takes most of a minute to start on 2 busy cores; the parity and load/unload tests (each a load
or two more) are marked slow.

- the third model named on demand loads, the least recently used one unloads, and the stream in flight on it
  finishes first, whole;
- a child killed mid-stream fails only that stream (an error event, then [DONE]); the other models keep answering;
  the killed one is started again and answers as before;
- each model's greedy answers through the router equal the same checkpoint served alone (a server of its own);
- /inspect/compare between two models equals the differences of one /inspect on each;
- /v1/models states, /models/load and /models/unload (llama-server's shapes), their refusals, /metrics labelled by
  model (parsed by prometheus_client), and a load over --models-memory-bytes refused naming the budget, with no
  process started.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from benchmarks.load import ServedProcess
from benchmarks.tiny_checkpoint import write_tiny_checkpoint
from live_server import LiveServer
from service.router.compare import decode_array, layer_differences
from service.router.options import parse_router_cli, wants_router

NAMES = ("alpha", "beta", "gamma")
KV = str(16 << 20)
LONG = 3000  # tokens of a stream that is still running when the test acts on its model
PROMPTS = ["The quick brown fox", "hello world", "0123456789"]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("models")
    for seed, name in enumerate(NAMES, 1):
        write_tiny_checkpoint(d / name, seed=seed, max_seq_len=8192)
    return d


class Router(ServedProcess):
    def __init__(self, args: list[str], log_path: Path) -> None:
        super().__init__(args, log_path, env={"LLAMASCOPE_THREADS": "1"})

    def models(self) -> dict[str, dict]:
        return {m["id"]: m for m in httpx.get(self.url + "/v1/models", timeout=10).json()["data"]}

    def wait_state(self, name: str, value: str, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.models()[name]
            if m["status"]["value"] == value:
                return m
            time.sleep(0.1)
        raise TimeoutError(f"{name} never {value}: {self.models()[name]}")

    def child_pid(self, name: str) -> int:
        """The pid of the router's child serving `name` (its own children only, read from /proc)."""
        kids = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            kids += (task / "children").read_text().split()
        for pid in kids:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"--served-model-name" in argv and argv[argv.index(b"--served-model-name") + 1] == name.encode():
                return int(pid)
        raise LookupError(name)


@pytest.fixture(scope="module")
def router(models_dir, tmp_path_factory):
    r = Router([a for n in NAMES for a in ("--model", str(models_dir / n))] + ["--models-max", "2", "--kv-cache-bytes",
                                                                               KV, "--max-model-len", "8192"],
               tmp_path_factory.mktemp("router") / "router.log")
    try:
        r.wait_state("alpha", "loaded")
        r.wait_state("beta", "loaded")
        yield r
    finally:
        assert r.stop(10) == 0, r.log_path.read_text()[-3000:]


def complete(url: str, model: str, prompt: str, max_tokens: int = 12) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "logprobs": 1}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def stream(url: str, model: str, max_tokens: int, events: list, first: threading.Event) -> None:
    body = {"model": model, "prompt": "stream", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=300) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        events.append(r.status_code)
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                first.set()
    events.append(("ended", time.monotonic()))
    first.set()


def start_stream(url: str, model: str, max_tokens: int) -> tuple[threading.Thread, list]:
    events: list = []
    first = threading.Event()
    t = threading.Thread(target=stream, args=(url, model, max_tokens, events, first))
    t.start()
    assert first.wait(120)
    return t, events


def test_third_model_evicts_the_least_recently_used_after_its_stream(router):
    complete(router.url, "beta", "warm")  # beta used after alpha's stream starts below: alpha is the LRU
    t, events = start_stream(router.url, "alpha", LONG)
    complete(router.url, "beta", "warm again")
    asked = time.monotonic()
    answer = complete(router.url, "gamma", PROMPTS[0])  # loads gamma: alpha, the LRU, unloads once its stream ends
    answered = time.monotonic()
    t.join(120)
    assert events[0] == 200 and events[-2] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[1:-2]]
    assert not any("error" in c for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == LONG  # every token streamed
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    ended = events[-1][1]
    assert asked < ended < answered  # gamma answered only after alpha's stream had finished
    assert answer["finish_reason"] == "length"
    states = {n: m["status"]["value"] for n, m in router.models().items()}
    assert states == {"alpha": "unloaded", "beta": "loaded", "gamma": "loaded"}


def test_a_killed_model_fails_only_its_own_stream_and_restarts(router):
    before = complete(router.url, "beta", PROMPTS[1])
    t, events = start_stream(router.url, "beta", LONG)
    os.kill(router.child_pid("beta"), signal.SIGKILL)
    other = complete(router.url, "gamma", PROMPTS[1])  # the other model keeps answering meanwhile
    t.join(120)
    assert events[0] == 200 and events[-2] == "[DONE]"
    last = json.loads(events[-3])
    assert last["error"]["code"] == "model_unavailable" and "beta" in last["error"]["message"]
    assert not any("usage" in json.loads(e) for e in events[1:-2])  # it did not finish
    assert other["finish_reason"] == "length"
    # the front notices the exit within its watch interval, which a stream's error can beat: wait for the restart
    deadline = time.monotonic() + 120
    while router.models()["beta"]["status"]["restarts"] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    m = router.wait_state("beta", "loaded")
    assert m["status"]["restarts"] == 1
    assert complete(router.url, "beta", PROMPTS[1]) == before
    counters = httpx.get(router.url + "/metrics").text
    assert 'llamascope_router_model_restarts_total{model="beta"} 1.0' in counters


@pytest.mark.slow
def test_greedy_answers_equal_each_model_served_alone(router, models_dir):
    from service.config import Settings
    from service.main import create_app

    loaded = [n for n, e in router.models().items() if e["status"]["value"] == "loaded"]
    through = {(n, p): complete(router.url, n, p) for n in loaded for p in PROMPTS}
    for n in loaded:
        settings = Settings(model=str(models_dir / n), kv_cache_bytes=int(KV), max_model_len=8192)
        with LiveServer(create_app(settings, wait_ready=True)) as alone:
            for p in PROMPTS:
                assert complete(alone.url, n, p) == through[(n, p)], (n, p)


def test_compare_across_models_is_the_difference_of_two_inspections(router):
    body = {"prompt": "Summer is warm. Winter is cold.", "mode": "full", "format": "base64"}
    # The comparison is taken from the float32 block outputs and float16 maps each model's /inspect returns; two
    # /inspect calls of one model agree to the last bit only when nothing else ran in between (an inspection right
    # after a model generated can differ in the last bits: a single server does the same, not the router's doing),
    # so the separate inspections are held to float32 rounding (residuals) and a float16 step or two (maps).
    r = httpx.post(router.url + "/inspect/compare", json={**body, "model": "gamma", "compare": ["beta"]}, timeout=120)
    assert r.status_code == 200, r.text
    cmp = r.json()
    sides = {}
    for name in ("gamma", "beta"):
        one = httpx.post(router.url + "/inspect", json={**body, "model": name, "include": ["attention", "hidden_states"],
                                                         "hidden_dtype": "float32"}, timeout=120)
        assert one.status_code == 200, one.text
        sides[name] = one.json()
    assert [t["id"] for t in cmp["tokens"]] == [t["id"] for t in sides["gamma"]["tokens"]]
    layers = cmp["comparisons"][0]["layers"]
    assert cmp["comparisons"][0]["model"] == "beta" and len(layers) == len(sides["gamma"]["layers"]) == 2
    for got, a, b in zip(layers, sides["gamma"]["layers"], sides["beta"]["layers"]):
        ha = torch.from_numpy(decode_array(a["hidden_states"]["values"]).copy())  # (T, D)
        hb = torch.from_numpy(decode_array(b["hidden_states"]["values"]).copy())
        delta = (hb - ha).norm(dim=-1)
        close = dict(rtol=1e-5, atol=0)
        np.testing.assert_allclose(got["residual"]["delta_norm"], delta.tolist(), **close)
        np.testing.assert_allclose(got["residual"]["relative"], (delta / ha.norm(dim=-1)).tolist(), **close)
        np.testing.assert_allclose(got["residual"]["cosine"], torch.nn.functional.cosine_similarity(ha, hb, dim=-1).tolist(),
                                   rtol=1e-4, atol=1e-6)
        assert min(got["residual"]["delta_norm"]) > 0  # two different checkpoints
        maps_a = decode_array(a["attention"]["maps"]["values"]).astype(np.float32)
        maps_b = decode_array(b["attention"]["maps"]["values"]).astype(np.float32)
        diff = decode_array(got["attention"]["values"])
        assert got["attention"]["mode"] == "full" and diff.shape == maps_a.shape
        np.testing.assert_allclose(diff.astype(np.float32), maps_b - maps_a, rtol=0, atol=2e-3)
        assert np.abs(maps_b - maps_a).max() > 0.05  # the maps do differ: a sign or side swapped would fail above
        # the same two inspections given to the router's own arithmetic: exactly these differences
        exact = layer_differences(a, b, "base64")
        assert exact["residual"]["delta_norm"] == delta.tolist()
        assert exact["residual"]["cosine"] == torch.nn.functional.cosine_similarity(ha, hb, dim=-1).tolist()
        assert np.array_equal(decode_array(exact["attention"]["values"]), (maps_b - maps_a).astype(np.float16))
    # top-k maps hold each side's own keys: refused, as a single server refuses them for adapters
    bad = httpx.post(router.url + "/inspect/compare", json={**body, "model": "gamma", "compare": ["beta"],
                                                            "mode": "topk"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode"


@pytest.mark.slow
def test_models_list_load_unload_and_refusals(router):
    m = router.models()
    assert set(m) == set(NAMES) and all(e["object"] == "model" for e in m.values())
    loaded = [n for n, e in m.items() if e["status"]["value"] == "loaded"]
    assert len(loaded) == 2 and all(m[n]["max_model_len"] == 8192 for n in loaded)
    victim = loaded[0]
    assert httpx.post(router.url + "/models/unload", json={"model": victim}, timeout=60).json() == {"success": True}
    assert router.models()[victim]["status"]["value"] == "unloaded"
    r = httpx.post(router.url + "/models/unload", json={"model": victim})
    assert r.status_code == 400 and r.json()["error"]["message"] == f"model {victim} is not loaded"
    assert httpx.post(router.url + "/models/load", json={"model": victim}, timeout=60).json() == {"success": True}
    assert router.models()[victim]["status"]["value"] in ("loading", "loaded")
    router.wait_state(victim, "loaded")
    r = httpx.post(router.url + "/models/load", json={"model": victim})
    assert r.status_code == 400 and "already" in r.json()["error"]["message"]
    for path, body, status in (("/models/load", {"model": "nope"}, 404), ("/models/load", {"model": 3}, 400),
                               ("/models/unload", {}, 400), ("/v1/completions", {"model": "nope", "prompt": "x"}, 404)):
        r = httpx.post(router.url + path, json=body)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}, (path, r.text)
    assert httpx.get(router.url + "/health").status_code == 200


def test_metrics_are_labelled_by_model(router):
    from prometheus_client.parser import text_string_to_metric_families

    complete(router.url, "beta", "counted")
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(router.url + "/metrics").text)}
    requests = families["llamascope_requests"].samples
    assert any(s.labels == {"model": "beta", "endpoint": "completions", "status": "200"} and s.value >= 1
               for s in requests)
    loaded = {n for n, e in router.models().items() if e["status"]["value"] == "loaded"}
    assert {s.labels["model"] for s in families["llamascope_generation_tokens"].samples} == loaded
    states = {(s.labels["model"], s.labels["state"]): s.value for s in families["llamascope_router_model_state"].samples}
    assert all(states[(n, "loaded")] == 1 for n in loaded)


def test_a_client_leaving_a_stream_ends_it_in_the_model_and_refusals_keep_their_envelope(router):
    from prometheus_client.parser import text_string_to_metric_families

    def counters(name: str) -> dict[str, float]:
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(router.url + "/metrics").text)}
        return {s.labels["model"]: s.value for s in families[name].samples if not s.name.endswith("_created")}

    model = sorted(n for n, e in router.models().items() if e["status"]["value"] == "loaded")[0]
    before = counters("llamascope_aborted_requests").get(model, 0)
    body = {"model": model, "prompt": "stream", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", router.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for n, _ in enumerate(line for line in r.iter_lines() if line.startswith("data: ")):
            if n == 3:
                break  # the client leaves: the front closes its connection to the model's process
    deadline = time.monotonic() + 30
    while counters("llamascope_aborted_requests").get(model, 0) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counters("llamascope_aborted_requests")[model] == before + 1
    while counters("llamascope_num_requests_running")[model] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counters("llamascope_num_requests_running")[model] == 0
    # refusals on the fast path: the front's own for a model it does not have, the model's own for the rest
    r = httpx.post(router.url + "/v1/completions", json={"model": "nobody", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    r = httpx.put(router.url + "/v1/completions", json={"model": model}, timeout=30)
    assert r.status_code == 405 and "error" in r.json(), r.text
    assert complete(router.url, model, PROMPTS[0])["finish_reason"] == "length"


def test_a_load_over_the_memory_budget_is_refused_naming_it(models_dir, tmp_path):
    r = Router(["--models-dir", str(models_dir), "--models-memory-bytes", str(8 << 20), "--kv-cache-bytes", KV],
               tmp_path / "router.log")
    try:
        refused = httpx.post(r.url + "/v1/completions", json={"model": "beta", "prompt": "x"}, timeout=30)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "insufficient_memory" and "model beta needs" in error["message"]
        assert "0.01 GiB --models-memory-bytes" in error["message"]
        assert {m["status"]["value"] for m in r.models().values()} == {"unloaded"}
        assert not (Path(f"/proc/{r.proc.pid}/task/{r.proc.pid}/children").read_text().split())  # nothing started
    finally:
        assert r.stop(10) == 0


def test_router_command_line():
    assert wants_router(["--model", "a", "--model", "b"], {}) and wants_router(["--models-dir", "d"], {})
    assert wants_router([], {"LLAMASCOPE_MODELS_DIR": "d"}) and not wants_router(["--model", "a"], {})
    o = parse_router_cli(["--model", "a", "--model=b", "--threads", "1", "--models-max", "3", "--port", "9000"])
    assert o.models == ["a", "b"] and o.models_max == 3 and o.settings.port == 9000
    assert o.child_argv == ["--threads", "1"]  # model, port and the router's own flags are the router's
    for argv in (["--model", "a", "--model", "b", "--served-model-name", "x"], ["a", "--model", "b", "--model", "c"],
                 ["--model", "a", "--model", "b", "--models-max", "0"]):
        with pytest.raises(SystemExit) as e:
            parse_router_cli(argv)
        assert e.value.code == 2


def test_relabelled_expositions_parse_as_one():
    """Two servers' own expositions (service/metrics.py's registry) merged: each family once, every sample with its
    model's label, label values escaped; what prometheus_client's parser reads back."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from service.common.metrics import Metrics
    from service.router.metrics import relabel

    families: dict[str, list[str]] = {}
    headers: dict[str, list[str]] = {}
    for name, n in (("a", 1), ('b"\\odd', 2)):
        m = Metrics()
        m.requests.labels("completions", "200").inc(n)
        m.ttft.observe(0.02 * n)
        relabel(generate_latest(m.registry).decode(), name, families, headers)
    text = "\n".join(line for fam, samples in families.items() for line in headers[fam] + samples) + "\n"
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    requests = {s.labels["model"]: s.value for s in parsed["llamascope_requests"].samples if s.name.endswith("_total")}
    assert requests == {"a": 1.0, 'b"\\odd': 2.0}
    counts = {s.labels["model"]: s.value for s in parsed["llamascope_time_to_first_token_seconds"].samples
              if s.name.endswith("_count")}
    assert counts == {"a": 1.0, 'b"\\odd': 1.0}
    assert sum(line.startswith("# TYPE llamascope_requests_total ") for line in text.splitlines()) == 1
