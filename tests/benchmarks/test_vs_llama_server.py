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


def test_shapes_reads_what_llama_server_was_built_for(tmp_path):
    """benchmarks.shapes records llama-server's instruction set: from its log's system_info line (llama.cpp
    common/common.cpp's format) where it has one, else from its build's CMakeCache.txt (<build>/bin/llama-server)."""
    from benchmarks.shapes import AVX2_CMAKE, peer_built_for

    log = tmp_path / "peer.log"
    log.write_text("main: loading\nsystem_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | SSSE3 = 1 | "
                   "AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | OPENMP = 1 |\n")
    got = peer_built_for(tmp_path / "nowhere", log)
    assert got["instruction_set"] == "avx512-vnni" and {"AVX2", "AVX512", "F16C"} <= set(got["features"])
    (tmp_path / "build" / "bin").mkdir(parents=True)
    binary, quiet = tmp_path / "build" / "bin" / "llama-server", tmp_path / "quiet.log"
    binary.touch(), quiet.write_text("main: loading\n")
    cache = tmp_path / "build" / "CMakeCache.txt"
    # the AVX2-only build's options as cmake records them
    cache.write_text("\n".join(f"{o[2:].split('=')[0]}:BOOL={o.split('=')[1]}" for o in AVX2_CMAKE if o.startswith("-DGGML_")))
    assert peer_built_for(binary, quiet)["instruction_set"] == "avx2"
    cache.write_text("GGML_NATIVE:BOOL=ON\nGGML_AVX2:BOOL=ON\n")
    assert peer_built_for(binary, quiet)["instruction_set"] == "native"
    assert peer_built_for(tmp_path / "elsewhere" / "llama-server", quiet)["instruction_set"] == "unknown"
