"""The benchmark harness end to end at --quick sizes on the default model: the JSON it writes holds every number
with a sane value, and ours and transformers did the same work (identical greedy tokens)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # loads the default model twice (ours and transformers'): about a minute on 2 cores

ROOT = Path(__file__).resolve().parents[2]
STREAM_KEYS = {"num_tokens", "ttft_s", "decode_tok_s", "total_s"}
CONCURRENT_KEYS = {"num_requests", "num_output_tokens", "wall_s", "throughput_tok_s", "ttft_p50_s", "ttft_p99_s",
                   "latency_p50_s", "latency_p99_s"}


def _positive(d: dict, keys: set[str]) -> None:
    for k in keys:
        assert isinstance(d[k], (int, float)) and math.isfinite(d[k]) and d[k] > 0, (k, d[k])


def test_quick_run_against_transformers(tmp_path):
    out = tmp_path / "results.json"
    # As a user runs it, from the repository root, in its own process: its memory figures and thread count
    # are then its own, not the test session's.
    threads = torch.get_num_threads()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_engine", "--quick", "--device", "cpu", "--threads", str(threads),
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Single stream" in proc.stdout and "Concurrent" in proc.stdout
    r = json.loads(out.read_text())
    ws, wc = r["workload"]["single_stream"], r["workload"]["concurrent"]
    assert r["quick"] and wc["num_requests"] <= 8 and ws["new_tokens"] <= 32  # --quick's sizes

    assert {"machine", "model", "engine_config", "workload", "single_stream", "concurrent", "memory",
            "ratios"} <= r.keys()
    assert r["machine"]["threads"] == threads and r["machine"]["torch_version"]
    assert r["model"]["dtype"] == "float32" and r["model"]["device"] == "cpu"

    single = r["single_stream"]
    for side in ("ours", "hf_generate", "hf_forward_loop"):
        assert STREAM_KEYS <= single[side].keys()
        _positive(single[side], STREAM_KEYS)
        assert single[side]["num_tokens"] == ws["new_tokens"]
        assert single[side]["ttft_s"] <= single[side]["total_s"]
    # The cheap proof that both sides measure the same work: greedy, EOS ignored, same weights -> same tokens.
    assert single["tokens_match"] == {"hf_generate": {"equal": True, "first_mismatch": None},
                                      "hf_forward_loop": {"equal": True, "first_mismatch": None}}
    assert len(single["ours_tokens"]) == ws["new_tokens"]

    conc = r["concurrent"]
    for side in ("ours", "hf_sequential", "hf_batched"):
        _positive(conc[side], CONCURRENT_KEYS)
        assert conc[side]["num_requests"] == wc["num_requests"]
        assert conc[side]["num_output_tokens"] == wc["num_requests"] * wc["new_tokens"]
        assert conc[side]["ttft_p50_s"] <= conc[side]["ttft_p99_s"] <= conc[side]["wall_s"]
    assert conc["ours"]["prefix_cache_hit_tokens"] == 0  # random prompts: nothing served from the cache
    assert conc["hf_sequential"]["extrapolated"] is False  # --quick runs every request

    mem = r["memory"]
    assert mem["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads of 64, float32
    assert mem["weights_mb"] > 0 and mem["kv_pool_mb"] > 0
    # Both big allocations are resident while serving (the pool is faulted in at start), so the peak holds them.
    assert mem["ours_serve"]["peak_rss_mb"] >= mem["weights_mb"] + mem["kv_pool_mb"]

    for phase, peers in (("single_stream", ("hf_generate", "hf_forward_loop")),
                         ("concurrent", ("hf_sequential", "hf_batched"))):
        for peer in peers:
            assert all(v is not None and v > 0 for v in r["ratios"][phase][peer].values()), (phase, peer)


def test_quick_decode_benchmark_per_setting(tmp_path):
    """`bench_decode` (per dtype / quantization, against the bandwidth ceiling) at --quick sizes, ours only."""
    out = tmp_path / "decode.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_decode", "--quick", "--settings", "float32", "int8", "int4",
         "--skip-hf", "--skip-llama-cpp", "--telemetry", "--threads", str(torch.get_num_threads()), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["read_bandwidth_gb_s"] > 0 and set(r["sides"]) == {"float32", "int8", "int4"}
    keys = {"decode_tok_s", "weight_bytes_per_token", "bandwidth_ceiling_tok_s", "pct_of_bandwidth_ceiling",
            "matmul_only_ms", "decode_step_ms", "step_over_matmul"}
    for side in r["sides"].values():
        _positive(side, keys | {"telemetry_decode_tok_s", "telemetry_over_plain"})
        assert side["telemetry_same_tokens"] is True  # telemetry changes no token
    b = {k: v["weight_bytes_per_token"] for k, v in r["sides"].items()}
    assert b["float32"] > 3.5 * b["int8"] and b["int8"] > b["int4"]  # int4 blocks, int8 head: between 4x and 8x


def test_quick_streaming_benchmark(tmp_path):
    """`benchmarks.streaming` (the sink + window cache over HTTP) at --quick sizes: two servers, perplexity under
    full attention and a window with and without sinks, generation past a 512-token context."""
    out = tmp_path / "streaming.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.streaming", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert [e["setting"] for e in r["perplexity"]] == ["full attention", "window 128 + 4 sinks", "window 128, no sinks"]
    for e in r["perplexity"]:
        _positive(e, {"perplexity", "vs_full", "seconds"})
    runs = r["generation"]["runs"]
    assert [g["tokens"] for g in runs] == [256, 256] and all(g["finish_reason"] == "length" for g in runs)
    assert r["generation"]["max_model_len"] == 512 and len(runs[0]["rolling_perplexity"]) == 1
    # the text scored on the 512-context server, with and without sinks, per 256 tokens (511 logprobs: 2 entries)
    text = r["generation"]["text"]
    assert [e["kv_window"]["sink_tokens"] for e in text] == [4, 0]
    assert all(len(e["rolling_perplexity"]) == 2 and e["perplexity"] > 0 for e in text)


def test_gpu_profile_dry_run_on_cpu(tmp_path):
    """The prepared GPU profile (`benchmarks/gpu_profile.py`) on tiny stand-ins, CPU: a table for each model's static
    decoder and engine, the engine's over decode steps only."""
    out = tmp_path / "profile.txt"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_profile", "--dry-run", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    for name in ("llama-2-7b", "smollm2-135m"):
        assert f"== {name}: static decoder" in text and f"== {name}: engine, 4 streams, decode steps" in text
    assert "aten::" in text  # the profiler's tables, not only the headers


def test_gpu_script_dry_run_on_cpu(tmp_path):
    """The prepared GPU script (`benchmarks/gpu.py`) on tiny stand-ins of both shapes, CPU: every path but the
    CUDA graph capture itself (the static decoder runs its step eagerly), so the script cannot rot unseen. It also
    builds every engine of a full-size run for the real shapes on the meta device and checks their pools."""
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--dry-run", "--device", "cpu", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    # the full-size run's engines, real shapes: the 7B's eager engine holds its 256-token stream, the served one
    # all 128 concurrent requests (16 blocks each)
    seven_b = {e["role"]: e for e in r["sizing"]["llama-2-7b"]}
    assert all(e["ok"] for shape in r["sizing"].values() for e in shape)
    assert seven_b["eager"]["num_blocks"] >= 16 and seven_b["served"]["num_blocks"] >= 128 * 16
    assert seven_b["eager"]["kv_mib"] == seven_b["eager"]["num_blocks"] * 8  # 8 MiB blocks
    assert len(r["models"]) == 2 and r["measured_copy_bandwidth_gb_s"] > 0
    for m in r["models"].values():
        assert "errors" not in m, m["errors"]
        # every decode path computes the same function: float32, so within 1e-3 nats and every token equal
        assert set(m["agreement"]) == {"engine_graphs_vs_eager", "static_vs_engine"}
        for c in m["agreement"].values():
            assert c["agree"] and c["first_divergence"] is None and c["max_abs_logprob_diff"] <= c["tolerance"] == 1e-3
        assert m["last_logits_max_abs_diff_vs_hf"] <= 1e-4 * max(1.0, m["last_logits_max_abs_hf"])  # same weights
        _positive(m, {"engine_single_tok_s", "engine_eager_single_tok_s", "graph_single_tok_s", "hf_single_tok_s",
                      "ceiling_tok_s_hbm_spec"})
        assert set(m["engine_concurrent_tok_s"]) == set(m["graph_tok_s"]) == set(m["hf_batched_tok_s"]) == {"1", "2"}
        assert m["engine_preemptions"] == {"1": 0, "2": 0}


def test_gemm_benchmark_reports_every_precision(tmp_path):
    out = tmp_path / "gemm.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gemm", "--rows", "1", "5", "--rounds", "1", "--stream-mb", "8",
                           "--head", "4096", "64", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())["rows"]
    assert set(r) == {"1", "5"}
    for row in r.values():
        _positive(row["gmac_s"], {"int4", "int8", "float32"})
        assert math.isfinite(row["int4_over_float32"]) and row["int4_over_float32"] > 0
    stream = json.loads(out.read_text())["stream"]
    _positive(stream["gb_s"], {"int4", "int8", "float32", "read"})
    head = json.loads(out.read_text())["head"]
    assert head["shape"] == [4096, 64] and set(head["rows"]) == {"1", "5"}
    for row in head["rows"].values():
        _positive(row["gmac_s"], {"ours", "torch"})


def test_attention_memory_benchmark_times_every_shape(tmp_path):
    out = tmp_path / "attention.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.attention_memory", "--shapes", "default", "8b", "--lengths", "40",
                           "100", "--reps", "1", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    runs = {(r["shape"], r["positions"]): r for r in result["runs"]}
    assert set(runs) == {("default", 40), ("default", 100), ("8b", 40), ("8b", 100)}
    assert runs[("default", 100)]["layers"] == 30 and runs[("8b", 40)]["layers"] == 32
    for r in runs.values():
        assert r["ms_per_step"] > 0 and r["gbs"] > 0
    assert result["read_bandwidth_gbs"] > 0 and result["kv_dtype"] == "float16"


def test_prefill_attention_benchmark_times_a_chunk_against_a_base_build(tmp_path):
    from model import kernels

    if kernels.native() is None:
        pytest.skip("native kernels off")
    base = kernels.build_dir() / kernels.module_name() / f"{kernels.module_name()}.so"
    out = tmp_path / "prefill.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.prefill_attention", "--shapes", "default", "--lengths", "100",
                           "--rows", "40", "--reps", "1", "--base-so", str(base), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert (run["shape"], run["positions"]) == ("default", 100)
    assert run["new"]["ms"] > 0 and run["base"]["gflops"] > 0 and run["ratio"] > 0
    assert run["bitwise_equal"] is True  # the same build on both sides


def test_shapes_writes_a_q4_k_m_file_of_q4_k_and_q6_k_blocks(tmp_path):
    """write_random's Q4_K_M (no llama-quantize): Q6_K in attn_v and ffn_down, Q4_K elsewhere, as the gguf package
    reads the file; it loads as Q4_K int4 and Q6_K int6 layers and serves a greedy token."""
    from gguf import GGUFReader

    from benchmarks.kernel_ab import kind
    from benchmarks.shapes import Shape, write_random
    from model.loaders import default_model_path, load_model
    from model.quantize import QuantLinear
    from tiny import greedy_tokens

    path = tmp_path / "kq.gguf"
    write_random(path, Shape(2, 256, 4, 2, 512, True, 10000.0), default_model_path(), "Q4_K_M")
    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) == 2}
    assert {n: t for n, t in types.items() if n != "token_embd.weight"} == {
        f"blk.{i}.{m}.weight": "Q6_K" if m in ("attn_v", "ffn_down") else "Q4_K" for i in range(2)
        for m in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    m = load_model(path, quantization="auto")
    kinds = {kind(x) for n, x in m.model.named_modules() if isinstance(x, QuantLinear) and "embed" not in n}
    assert {"Int4Linear-kq", "Int6Linear"} <= kinds
    assert len(greedy_tokens(m.model, [[1, 2, 3]], n=2)[0]) == 2


@pytest.mark.parametrize("name", ["qwen2.5-1.5b", "qwen3-4b", "mistral-7b"])
def test_shapes_writes_each_familys_file_as_the_converter_does(tmp_path, name):
    """benchmarks.shapes' random files of the families' shapes (here at 2 layers and a tenth of the width, the same
    heads) load as their family with its switches, and serve a greedy token."""
    import dataclasses

    from benchmarks.shapes import SHAPES, write_random
    from model.loaders import default_model_path, load_model
    from model.loaders.gguf_file import open_gguf, read_metadata

    full = SHAPES[name]
    small = dataclasses.replace(full, n_layers=2, dim=full.n_heads * 16, ffn=256, head_dim=32 if full.head_dim else 0)
    path = tmp_path / f"{name}.gguf"
    write_random(path, small, default_model_path())
    meta = read_metadata(open_gguf(path))
    assert meta["general.architecture"] == full.arch
    m = load_model(path, quantization="auto")
    c = m.model.config
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == (2, full.n_heads, full.n_kv_heads, small.hd)
    assert c.qkv_bias == full.qkv_bias and (c.qk_norm == "head") == full.qk_norm
    assert m.quantization == "int8"  # Q8_0 blocks served at their own precision
    from tiny import greedy_tokens

    assert len(greedy_tokens(m.model, [[1, 2, 3]], n=2)[0]) == 2
