"""The engine's lifecycle never strands a client: stats are snapshots the engine thread publishes, every open stream
and pending submission ends when the engine thread ends (whatever ended it), a failing step still delivers the
outputs of the sequences it finished, and the prompts of one request are admitted together."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from model.async_engine import AsyncEngine, EngineDeadError
from model.engine import Engine, EngineConfig
from model.loaders.checkpoint import LoadedModel
from model.sampling import SamplingParams
from service.config import Settings
from service.main import create_app
from tiny import byte_tokenizer, tiny_model

TIMEOUT = 20  # seconds: a stranded client fails the test instead of hanging it


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def _loaded(seed: int = 0) -> LoadedModel:
    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return LoadedModel(tiny_model(seed=seed), tok, Path("tiny"), "tiny", 0.0)


def test_metrics_scrapes_read_a_snapshot_published_by_the_engine_thread(monkeypatch):
    """/metrics never walks the engine's live dicts from the event loop (a scrape racing the engine thread could
    raise "dictionary changed size during iteration"): Engine.stats() runs on the engine thread only."""
    threads: list[str] = []
    real = Engine.stats

    def spy(self):
        threads.append(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(Engine, "stats", spy)
    with TestClient(create_app(Settings(), loaded=_loaded(), wait_ready=True)) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200
        threads.clear()
        for _ in range(5):
            m = client.get("/metrics")
            assert m.status_code == 200 and "llamascope_num_requests_running" in m.text
    assert set(threads) <= {"llamascope-engine"}
