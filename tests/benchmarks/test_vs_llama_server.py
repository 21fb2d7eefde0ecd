"""The llama-server comparison's workloads (benchmarks/vs_llama_server.py) against our server on a tiny random model
over HTTP: they run, every answer is the requested 64 tokens, and the batch-invariance check finds every answer the
same alone and among 24 (token texts and logprob floats). llama-server itself is never started in CI."""

from __future__ import annotations

import torch

from benchmarks import vs_llama_server as vs
from benchmarks.tiny_checkpoint import write_tiny_checkpoint
from live_server import LiveServer
from model.loaders.checkpoint import load_model
from service.config import Settings
from service.main import create_app


def test_workloads_and_invariance_check_over_http(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server shares the process with the clients
    try:
        loaded = load_model(write_tiny_checkpoint(tmp_path / "tiny-llama", seed=4))
        app = create_app(Settings(kv_cache_bytes=64 << 20), loaded=loaded, wait_ready=True)
        vocab = loaded.model.config.vocab_size
        with LiveServer(app) as live:
            assert vs.single_stream(live.url, vocab, seed=0)["decode_tok_s"] > 0
            assert vs.single_stream(live.url, vocab, seed=3, client="httpx")["decode_tok_s"] > 0
            assert vs.concurrent(live.url, vocab, seed=1)["throughput_tok_s"] > 0
            assert vs.prefill(live.url, vocab, seed=2, tokens=256)["prefill_tok_s"] > 0
            inv = vs.invariance(live.url, vocab)
        assert inv["logprobs_returned"], inv
        assert inv["texts_differ"] == 0 and inv["logprobs_differ"] == 0, inv
    finally:
        torch.set_num_threads(threads)


def test_missing_peer_is_a_clear_exit(tmp_path, capsys):
    assert vs.main(["--llama-server", str(tmp_path / "absent"), "--out", str(tmp_path / "x.json")]) == 2
    assert "llama-server not found" in capsys.readouterr().err
