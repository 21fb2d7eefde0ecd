"""The HTTP-overhead benchmark's sides (benchmarks/http_overhead.py) on a tiny random model: the in-process engine
built by the service's start-up code, the raw-socket client and the httpx client over a live server; each stream
yields its 64 tokens and a positive inter-token latency."""

from __future__ import annotations

import asyncio

import torch

from benchmarks import http_overhead as ho
from benchmarks.tiny_checkpoint import write_tiny_checkpoint
from live_server import LiveServer
from model.loaders.checkpoint import load_model
from service.config import Settings
from service.main import create_app


def test_every_side_streams_its_tokens(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # server, engine and clients share the process
    try:
        path = write_tiny_checkpoint(tmp_path / "tiny-llama", seed=5)
        ours = ho.InProcess(str(path))
        try:
            prompts = ho.workloads(ours.vocab, seed=3)
            assert [len(p) for p in prompts.values()] == [1, ho.CONCURRENT]
            app = create_app(Settings(model=str(path), kv_cache_bytes=64 << 20), loaded=load_model(path), wait_ready=True)
            with LiveServer(app) as live:
                for side in (ours, ho.OverHttp(live.url, "raw"), ho.OverHttp(live.url, "httpx")):
                    for p in prompts.values():
                        assert asyncio.run(ho._run_side(side, p[:4])) > 0
        finally:
            ours.close()
    finally:
        torch.set_num_threads(threads)
