"""The load harness (benchmarks/load.py) in CI: 300 mixed requests at concurrency 32 against a live server on a tiny
random model, bursts above the queue limit included (each fired while the engine thread is held busy, as a long step
would hold it: a tiny model drains a queue faster than one process's clients can fill it, and a burst that never
meets a full queue would leave the 429 path untested). Zero 5xx, zero hung requests, zero KV blocks left in use, no
running or waiting sequences, and every counter in /metrics consistent with the client's own counts."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from benchmarks.load import LoadConfig, run_load
from benchmarks.tiny_checkpoint import write_tiny_checkpoint
from live_server import LiveServer, idle_stats, is_idle
from model.loaders.checkpoint import load_model
from service.config import Settings
from service.main import create_app


def test_short_load_run_keeps_every_promise(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server shares the process (and the cores) with 32 clients
    try:
        loaded = load_model(write_tiny_checkpoint(tmp_path / "tiny-llama", seed=6))  # with a chat template
        app = create_app(Settings(max_waiting=64, max_num_seqs=16, kv_cache_bytes=64 << 20), loaded=loaded,
                         wait_ready=True)
        with LiveServer(app) as live:
            report = run_load(live.url, LoadConfig(num_requests=300, concurrency=32, seed=1),
                              before_burst=lambda: _hold_engine(app, seconds=1.0))
            print(report.summary())
            assert report.requests == 300
            assert report.ok, report.summary()
            assert report.server_5xx == 0 and report.hung == 0 and not report.inconsistencies
            assert report.kv_blocks_in_use == 0 and report.running == 0 and report.waiting == 0
            assert set(report.status_counts) <= {"200", "429", "disconnected", "aborted"}, report.status_counts
            assert report.status_counts.get("429", 0) > 0  # the bursts went past the queue limit
            assert report.status_counts["200"] >= 150
            assert report.ttft_ms["n"] > 0 and report.itl_ms["n"] > 0
            assert report.rss_growth_mb is not None
            # the engine's own snapshot agrees with its gauges
            assert is_idle(idle_stats(app))
    finally:
        torch.set_num_threads(threads)


class _Hold:
    """An engine job (model/engine/async_engine.py's EngineJob) that keeps the engine thread busy for a while."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.started = seconds, threading.Event()

    def step(self, budget_s: float) -> bool:
        self.started.set()
        time.sleep(self.seconds)
        return True


async def _hold_engine(app, seconds: float) -> None:
    """Returns once the engine thread has begun `seconds` of other work (the burst is fired meanwhile)."""
    hold = _Hold(seconds)
    asyncio.ensure_future(app.state.server.engine.run_job(hold))
    assert await asyncio.to_thread(hold.started.wait, 30), "the engine never ran the hold"
