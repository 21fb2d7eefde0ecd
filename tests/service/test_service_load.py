"""Disconnects abort and free KV blocks; 64 simultaneous requests all succeed with the right usage."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from live_server import idle_stats, is_idle


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else ""): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if (m["llamascope_kv_cache_usage_ratio"], m["llamascope_num_requests_running"],
                m["llamascope_num_requests_waiting"]) == (0, 0, 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_stream_disconnect_aborts_and_frees_blocks(server):
    before = wait_idle(server.url)
    body = {"prompt": "Tell me a very long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines, during = 0, None
        for line in r.iter_lines():
            lines += line.startswith("data: ")
            if lines >= 3:
                # scrape before leaving the loop: dropping the line iterator may already close the connection
                during = scrape(server.url)
                break
        assert during["llamascope_kv_cache_usage_ratio"] > 0  # the request holds blocks while it streams
    after = wait_idle(server.url)  # the connection is closed here
    deadline = time.monotonic() + 10
    while after["llamascope_aborted_requests_total"] == before["llamascope_aborted_requests_total"] and time.monotonic() < deadline:
        time.sleep(0.1)
        after = scrape(server.url)
    assert after["llamascope_kv_cache_usage_ratio"] == 0 and after["llamascope_num_requests_running"] == 0
    assert after["llamascope_aborted_requests_total"] == before["llamascope_aborted_requests_total"] + 1
    assert is_idle(idle_stats(server.app))


def test_non_stream_disconnect_aborts_too(server):
    before = wait_idle(server.url)
    body = {"prompt": "Count to a thousand:", "max_tokens": 600, "ignore_eos": True}
    try:
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.5)
    except httpx.TimeoutException:
        pass  # the client gives up and closes the connection mid-request
    after = wait_idle(server.url)
    assert after["llamascope_kv_cache_usage_ratio"] == 0
    assert after["llamascope_aborted_requests_total"] >= before["llamascope_aborted_requests_total"] + 1


def test_64_concurrent_mixed_requests(server, default_model):
    tok = default_model.tokenizer
    prompts = [f"Request number {i}: write about topic {i % 7}." for i in range(64)]

    async def one(client: httpx.AsyncClient, i: int):
        p = prompts[i]
        body = {"prompt": p, "max_tokens": 6, "ignore_eos": True, "temperature": 0.7, "seed": i}
        if i % 4 == 3:  # a chat request now and then
            body = {"messages": [{"role": "user", "content": p}], "max_tokens": 6, "ignore_eos": True, "seed": i}
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        if i % 2:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            usage, text = None, ""
            async with client.stream("POST", server.url + path, json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        usage = chunk.get("usage") or usage
                        for c in chunk["choices"]:
                            text += c.get("text") or (c.get("delta") or {}).get("content") or ""
            return i, path, usage, text
        r = await client.post(server.url + path, json=body)
        assert r.status_code == 200, r.text
        j = r.json()
        c = j["choices"][0]
        return i, path, j["usage"], c.get("text", (c.get("message") or {}).get("content"))

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*[one(client, i) for i in range(64)])

    results = asyncio.run(main())
    assert len(results) == 64
    for i, path, usage, text in results:
        assert usage is not None and usage["completion_tokens"] == 6, (i, usage)
        if path == "/v1/completions":
            assert usage["prompt_tokens"] == len(tok.encode(prompts[i]))
        assert usage["total_tokens"] == usage["prompt_tokens"] + 6 and isinstance(text, str)
    wait_idle(server.url)
