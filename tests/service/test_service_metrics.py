"""/metrics on a live server on the tiny model: every `llamascope_` metric is exposed, and the counters and
histograms move by exactly the right amounts after known requests."""

from __future__ import annotations


import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from model import kernels
from service.config import Settings

CMPL = "/v1/completions"
BLOCK = 16

HISTOGRAMS = [
    "llamascope_time_to_first_token_seconds", "llamascope_inter_token_latency_seconds",
    "llamascope_e2e_request_latency_seconds", "llamascope_request_queue_time_seconds",
    "llamascope_request_prompt_tokens", "llamascope_request_generation_tokens", "llamascope_engine_step_seconds",
]
COUNTERS = [
    "llamascope_requests", "llamascope_request_finish", "llamascope_prompt_tokens", "llamascope_generation_tokens",
    "llamascope_prefix_cache_hit_tokens", "llamascope_preemptions", "llamascope_aborted_requests",
    "llamascope_engine_steps",
]
GAUGES = ["llamascope_num_requests_running", "llamascope_num_requests_waiting", "llamascope_kv_cache_usage_ratio"]


class Scrape:
    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = {(s.name, frozenset(s.labels.items())): s.value
                        for f in self.families.values() for s in f.samples}

    def get(self, name: str, **labels) -> float:
        """A sample's value; 0 for a labelled child not created yet."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def metrics_server(tiny_live):
    with tiny_live(Settings(block_size=BLOCK), timeout=60) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        server.client = client
        yield server


def scrape(metrics_server) -> Scrape:
    r = metrics_server.client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return Scrape(r.text)


def test_every_metric_is_exposed(metrics_server):
    s = scrape(metrics_server)
    for name in HISTOGRAMS:
        assert s.families[name].type == "histogram", name
    for name in COUNTERS:
        assert s.families[name].type == "counter", name
    for name in GAUGES:
        assert s.families[name].type == "gauge", name
    assert all(name.startswith("llamascope_") for name in s.families)


def test_fallbacks_and_the_decode_paths_are_visible(metrics_server):
    """Every fallback the engine can take has its gauge (0 here: nothing fell back on CPU), and /v1/models says
    which decode attention and graph path serve, with the same counts."""
    s = scrape(metrics_server)
    kinds = ("triton_decode_attention", "triton_cache", "decode_graphs", "graph_capture")
    assert {k: s.get("llamascope_engine_fallbacks", kind=k) for k in kinds} == dict.fromkeys(kinds, 0.0)
    assert all(("llamascope_engine_fallbacks", frozenset({("kind", k)})) in s.samples for k in kinds)
    execution = metrics_server.client.get("/v1/models").json()["data"][0]["execution"]
    assert execution == {"decode_attention": "native" if kernels.native() is not None else "torch",
                         "decode_graphs": "off", "cpu_kernels": kernels.built_for(),
                         "fallbacks": dict.fromkeys(kinds, 0)}


def _completion(metrics_server, prompt: list[int], max_tokens: int = 5, **extra) -> dict:
    r = metrics_server.client.post(CMPL, json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                                     **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(metrics_server, prompt: list[int], max_tokens: int = 5) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    with metrics_server.client.stream("POST", CMPL, json=body) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    assert text.rstrip().endswith("data: [DONE]")


def test_counters_move_by_the_right_amounts(metrics_server):
    # distinct first tokens and < one block each: no prefix-cache hits among these
    prompts = [[10 + i] * n for i, n in enumerate((3, 7, 11, 13))]
    before = scrape(metrics_server)
    for p in prompts[:3]:
        body = _completion(metrics_server, p)
        assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens"] == len(p)
    _streamed(metrics_server, prompts[3])
    # one request the engine refuses (prompt + max_tokens over the context): a 400 from inside the route
    r = metrics_server.client.post(CMPL, json={"prompt": [1, 2, 3], "max_tokens": 600})
    assert r.status_code == 400, r.text
    after = scrape(metrics_server)

    def delta(name: str, **labels) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    P = sum(len(p) for p in prompts)
    assert delta("llamascope_requests_total", endpoint="completions", status="200") == 4
    assert delta("llamascope_requests_total", endpoint="completions", status="400") == 1
    assert delta("llamascope_prompt_tokens_total") == P  # the refused request's prompt is not counted
    assert delta("llamascope_generation_tokens_total") == 20
    assert delta("llamascope_request_finish_total", finish_reason="length") == 4
    assert delta("llamascope_request_finish_total", finish_reason="stop") == 0
    assert delta("llamascope_prefix_cache_hit_tokens_total") == 0
    assert delta("llamascope_aborted_requests_total") == 0
    assert delta("llamascope_preemptions_total") == 0
    for name in ("llamascope_e2e_request_latency_seconds", "llamascope_request_prompt_tokens",
                 "llamascope_request_generation_tokens"):  # per successful request
        assert delta(name + "_count") == 4, name
        assert delta(name + "_bucket", le="+Inf") == 4, name
    for name in ("llamascope_time_to_first_token_seconds", "llamascope_request_queue_time_seconds"):
        assert delta(name + "_count") == 4, name
    assert delta("llamascope_request_prompt_tokens_sum") == P
    assert delta("llamascope_request_generation_tokens_sum") == 20
    assert delta("llamascope_request_generation_tokens_bucket", le="4.0") == 0  # 5 tokens each: all in (4, 16]
    assert delta("llamascope_request_generation_tokens_bucket", le="16.0") == 4
    assert delta("llamascope_inter_token_latency_seconds_count") == 4 * 4  # one gap per token after the first
    assert delta("llamascope_engine_step_seconds_count") >= 5  # 5 tokens need at least 5 steps
    # every step is counted under the path the runner chose: on CPU with the kernels every step fused, prefill too
    steps = {p: delta("llamascope_engine_steps_total", path=p) for p in ("module", "native", "cuda_graph")}
    assert sum(steps.values()) == delta("llamascope_engine_step_seconds_count")
    assert steps["cuda_graph"] == 0
    assert (steps["native"] >= 5 and steps["module"] == 0) if kernels.native() is not None else steps["module"] >= 5
    for name in ("llamascope_e2e_request_latency_seconds", "llamascope_time_to_first_token_seconds",
                 "llamascope_engine_step_seconds"):
        assert delta(name + "_sum") > 0, name
    # after every request has finished, nothing is running, waiting or holding KV blocks
    assert after.get("llamascope_num_requests_running") == 0
    assert after.get("llamascope_num_requests_waiting") == 0
    assert after.get("llamascope_kv_cache_usage_ratio") == 0


def test_prefix_cache_hits(metrics_server):
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks of 16, shared with nothing sent before
    before = scrape(metrics_server)
    first = _completion(metrics_server, prompt)
    mid = scrape(metrics_server)
    second = _completion(metrics_server, prompt)
    after = scrape(metrics_server)
    hits = "llamascope_prefix_cache_hit_tokens_total"
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert mid.get(hits) - before.get(hits) == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK
    assert after.get(hits) - mid.get(hits) == 2 * BLOCK
    assert after.get("llamascope_prompt_tokens_total") - before.get("llamascope_prompt_tokens_total") == 2 * len(prompt)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]  # greedy, cache or not
    assert after.get("llamascope_kv_cache_usage_ratio") == 0  # cached-but-free blocks count as free


def test_n_choices_count_per_choice(metrics_server):
    before = scrape(metrics_server)
    body = _completion(metrics_server, [50, 51, 52], max_tokens=3, n=2, temperature=1.0, seed=1)
    assert body["usage"]["completion_tokens"] == 6
    after = scrape(metrics_server)
    assert after.get("llamascope_requests_total", endpoint="completions", status="200") - \
        before.get("llamascope_requests_total", endpoint="completions", status="200") == 1
    assert after.get("llamascope_request_finish_total", finish_reason="length") - \
        before.get("llamascope_request_finish_total", finish_reason="length") == 2
    assert after.get("llamascope_generation_tokens_total") - before.get("llamascope_generation_tokens_total") == 6
    assert after.get("llamascope_request_generation_tokens_sum") - \
        before.get("llamascope_request_generation_tokens_sum") == 6
    assert after.get("llamascope_prompt_tokens_total") - before.get("llamascope_prompt_tokens_total") == 3


@pytest.mark.parametrize("body,status", [
    ({"prompt": "a", "temperature": -1}, 400),  # pydantic validation, before the route runs
    ({"prompt": ""}, 400),  # the route's own check, before RunStats
    ({"prompt": "a", "model": "nope"}, 404),
], ids=["validation_400", "empty_prompt_400", "unknown_model_404"])
def test_every_failed_request_is_counted(metrics_server, body, status):
    before = scrape(metrics_server)
    r = metrics_server.client.post(CMPL, json=body)
    assert r.status_code == status
    after = scrape(metrics_server)
    key = dict(endpoint="completions", status=str(status))
    assert after.get("llamascope_requests_total", **key) - before.get("llamascope_requests_total", **key) == 1
