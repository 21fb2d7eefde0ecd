"""Fault injection through the engine's test hook: an exception in one engine step fails exactly the requests
scheduled in that step (a 500 envelope, or an SSE error event when streaming); every other request in flight
finishes normally, the engine keeps serving, no KV block leaks, and the metrics count what happened."""

from __future__ import annotations

import asyncio
import json

import httpx

from live_server import engine_core, idle_stats, is_idle, tiny_live_server
from service.config import Settings
from test_service_load import scrape, wait_idle
from tiny import tiny_model

NUM_REQUESTS, MAX_TOKENS, MARK = 12, 24, 100  # request i's prompt starts with token MARK + i


def test_a_failing_step_fails_only_its_requests():
    # Four sequences at a time, so the failing step has company both inside it and waiting outside it.
    server = tiny_live_server(Settings(max_num_seqs=4, max_num_batched_tokens=64), tiny_model(seed=5))
    failed: set[int] = set()

    def hook(scheduled):
        # Fire once, on the first step that decodes several requests while others wait.
        decoding = [s for s in scheduled if s.seq.output_token_ids]
        if not failed and len(decoding) >= 2 and live.app.state.server.stats.num_waiting:  # (the last step's count)
            failed.update(s.seq.prompt_token_ids[0] - MARK for s in scheduled)
            raise RuntimeError("injected fault at /secret/internal/path.py")

    async def one(client: httpx.AsyncClient, i: int):
        body = {"prompt": [MARK + i, 1, 2, 3, 4, 5], "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
        if i % 2:
            events = []
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            errors = [c["error"] for c in chunks if "error" in c]
            reasons = [ch["finish_reason"] for c in chunks if "choices" in c for ch in c["choices"] if ch["finish_reason"]]
            return i, ("error" if errors else "ok"), errors, reasons
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return i, r.status_code, [r.json()["error"]], r.text
        return i, "ok", [], [r.json()["choices"][0]["finish_reason"]] * (r.json()["usage"]["completion_tokens"] == MAX_TOKENS)

    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_REQUESTS)))

    with server as live:
        before = wait_idle(live.url)
        engine_core(live.app).step_fault_hook = hook
        results = asyncio.run(main(live.url))
        engine_core(live.app).step_fault_hook = None
        after = wait_idle(live.url)

        assert failed and len(failed) < NUM_REQUESTS, failed
        for i, outcome, errors, detail in results:
            if i in failed:
                assert outcome == (500 if i % 2 == 0 else "error"), (i, outcome)
                assert len(errors) == 1 and errors[0]["type"] == "server_error", errors
                assert set(errors[0]) == {"message", "type", "param", "code"}
                assert "secret" not in json.dumps(errors) and "Traceback" not in str(detail)
            else:
                assert outcome == "ok" and not errors and detail == ["length"], (i, outcome, errors, detail)

        # The engine keeps serving, and nothing is left behind.
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert httpx.get(live.url + "/health").status_code == 200
        assert is_idle(idle_stats(live.app))
        assert (after["llamascope_kv_cache_usage_ratio"], after["llamascope_num_requests_running"],
                after["llamascope_num_requests_waiting"]) == (0, 0, 0)

        def delta(name):
            return after.get(name, 0) - before.get(name, 0)

        assert delta('llamascope_request_finish_total{"finish_reason": "error"}') == len(failed)
        assert delta('llamascope_request_finish_total{"finish_reason": "length"}') == NUM_REQUESTS - len(failed)
        failed_plain = sum(1 for i in failed if i % 2 == 0)
        assert delta('llamascope_requests_total{"endpoint": "completions", "status": "500"}') == failed_plain
        assert delta('llamascope_requests_total{"endpoint": "completions", "status": "200"}') == NUM_REQUESTS - failed_plain
        final = scrape(live.url)
        assert final['llamascope_requests_total{"endpoint": "completions", "status": "200"}'] >= NUM_REQUESTS - failed_plain + 1
