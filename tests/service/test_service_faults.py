"""A failure inside generation: that request gets a 500 envelope (an SSE error event when streaming), others go on."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from model.loaders.checkpoint import LoadedModel
from live_server import engine_core, idle_stats, is_idle
from service.config import Settings
from service.main import create_app
from tiny import byte_tokenizer, tiny_model


@pytest.fixture(scope="module")
def tiny_server(tiny_live):
    with tiny_live(Settings(), tiny_model(seed=2)) as live:
        yield live


def _fail_next_forwards(monkeypatch, server, count: int = 1):
    """The next `count` steps fail as a failing forward would, whichever execution path the runner chose for them
    (the engine's fault hook)."""
    left = {"n": count}

    def flaky(scheduled):
        if left["n"] > 0:
            left["n"] -= 1
            raise RuntimeError("injected fault at /secret/internal/path.py")

    monkeypatch.setattr(engine_core(server.app), "step_fault_hook", flaky)


def test_non_streamed_failure_is_a_500_envelope(tiny_server, monkeypatch):
    _fail_next_forwards(monkeypatch, tiny_server)
    r = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
    assert r.status_code == 500
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
    assert "secret" not in r.text and "Traceback" not in r.text
    ok = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(tiny_server.url + "/health").status_code == 200


def test_streamed_failure_is_an_sse_error_event(tiny_server, monkeypatch):
    body = {"prompt": "hello", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c:
        # let the first step (prefill + first token) succeed, then fail the next forward
        with c.stream("POST", tiny_server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        _fail_next_forwards(monkeypatch, tiny_server)
    assert events[-1] == "[DONE]"
    errors = [json.loads(e) for e in events[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1 and errors[0]["error"]["type"] == "server_error" and "secret" not in events[-2]
    ok = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200
    assert is_idle(idle_stats(tiny_server.app))


def test_not_ready_is_503_with_the_reason(tmp_path):
    from fastapi.testclient import TestClient

    with TestClient(create_app(Settings(model=str(tmp_path / "missing.gguf")))) as client:
        import time

        for _ in range(100):
            h = client.get("/health")
            if "failed" in h.text:
                break
            time.sleep(0.05)
        assert h.status_code == 503 and "missing.gguf" in h.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready" and r.headers["retry-after"]


@pytest.mark.parametrize("log_prompts", [False, True])
def test_request_log_line_and_prompt_privacy(caplog, log_prompts):
    from fastapi.testclient import TestClient

    loaded = LoadedModel(tiny_model(seed=3), byte_tokenizer(), Path("tiny"), "tiny", 0.0)
    with TestClient(create_app(Settings(log_prompts=log_prompts), loaded=loaded, wait_ready=True)) as client:
        with caplog.at_level("INFO", logger="llamascope.service"):
            r = client.post("/v1/completions", json={"prompt": "my secret prompt", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("request id=")]
    assert len(lines) == 1
    line = lines[0]
    for part in ("endpoint=completions", "status=200", "prompt_tokens=16", "completion_tokens=3", "finish=length", "latency_ms="):
        assert part in line
    assert ("my secret prompt" in line) == log_prompts
