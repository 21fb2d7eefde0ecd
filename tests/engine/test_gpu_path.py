"""The CUDA path's bookkeeping, checked on the CPU: what a first deployment on a GPU would otherwise find.

Each test stands in for the one piece of the device it needs: CUDA graph capture (tests/fake_cuda_graphs.py), a
device that runs beside the host (benchmarks/simulated_device.py), `torch.cuda.set_device`, pinned memory (a
`Tensor.to` that refuses a copy to a device from memory that was not pinned), the attention backend's answer."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from benchmarks.simulated_device import SimulatedStream
from model import kernels
from model.engine import Engine, EngineConfig, RequestOptions
from model.engine import async_engine, stream as stream_mod
from model.features.structured.masks import AllowedTokens, _apply_allowed
from model.kernels import ops
from fake_cuda_graphs import fake_capture
from test_engine import _prompts, assert_pool_clean, greedy, run
from tiny import byte_tokenizer, tiny_model

native = pytest.mark.skipif(kernels.native() is None, reason=f"native kernels: {kernels.status()}")


def _engine(mode: str, model=None, **kw) -> Engine:
    cfg = dict(num_blocks=48, block_size=4, max_num_seqs=6, max_num_batched_tokens=40, decode_graphs=mode)
    cfg.update(kw)
    return Engine(model if model is not None else tiny_model(), byte_tokenizer(), EngineConfig(**cfg))


def _tokens(results: dict) -> dict:
    return {r: c[0]["tokens"] for r, c in results.items()}


@native
def test_lora_graphs_are_captured_when_an_adapter_loads_never_during_a_step(monkeypatch):
    """Loading (or unloading) an adapter captures the adapted graphs of every bucket then, between steps; steps
    under adapters only replay them, and give the ordinary step's tokens."""
    from test_lora_engine import random_adapter

    model = tiny_model()
    engine = _engine("eager", model)
    rec = fake_capture(monkeypatch, engine)
    engine.runner.capture_graphs()
    buckets = engine.runner.graphs.buckets
    assert sorted(rec.keys) == sorted((b, e, False) for b in buckets for e in (False, True))
    rec.keys.clear()
    engine.feature("lora").add(random_adapter("a", model.config, 4, 1))
    assert sorted(rec.keys) == sorted((b, e, True) for b in buckets for e in (False, True))
    prompts = _prompts(5, seed=8, lo=5, hi=20)

    def serve(engine):
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy(8), RequestOptions(lora="a" if i % 2 else None))
        out = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
        return out

    got = serve(engine)
    off = _engine("off", model)
    off.feature("lora").add(random_adapter("a", model.config, 4, 1))
    assert got == serve(off)
    assert rec.during_step == [] and engine.runner.path_counts["cuda_graph"] > 5
    rec.keys.clear()
    engine.feature("lora").remove("a")  # no adapter left: nothing to capture, and the adapted graphs are gone
    assert rec.keys == [] and not any(k[2] for k in engine.runner.graphs.graphs)
    assert_pool_clean(engine)


@native
def test_a_failed_capture_is_logged_counted_and_decodes_eagerly(monkeypatch, caplog):
    engine = _engine("eager")
    rec = fake_capture(monkeypatch, engine)
    rec.fail = {(4, False, False)}
    with caplog.at_level(logging.ERROR, logger="llamascope.engine"):
        engine.runner.capture_graphs()
    assert "CUDA graph capture failed for batch size 4" in caplog.text
    assert engine.stats().fallbacks == {"triton_decode_attention": 0, "decode_graphs": 0, "triton_cache": 0,
                                        "graph_capture": 1}
    prompts = _prompts(4, seed=2, hi=20)
    requests = {str(i): (p, greedy(8)) for i, p in enumerate(prompts)}
    arrive = {str(i): 3 * i for i in range(4)}  # 1 and 2 rows replay their graphs, 3 and 4 (bucket 4) run eagerly
    assert _tokens(run(engine, requests, arrive)) == _tokens(run(_engine("off"), requests, arrive))
    assert engine.runner.path_counts["native"] > 0 and engine.runner.path_counts["cuda_graph"] > 0
    assert rec.during_step == []


@native
def test_captured_graphs_are_counted_against_the_kv_cache_budget(monkeypatch):
    """Captured graphs keep memory of their own (their logits, the pool's working set): with capture on, the KV
    pool gets --kv-cache-bytes less that estimate; without capture (or with num_blocks given), all of it."""
    from fake_cuda_graphs import stub_cuda
    from model.engine.cuda_graphs import CudaGraphs
    from model.engine.paged_cache import PagedKVCache, kv_config

    stub_cuda(monkeypatch)
    monkeypatch.setattr(CudaGraphs, "enabled", staticmethod(lambda mode, *a: mode != "off"))  # as on CUDA
    model, budget = tiny_model(), 4 << 20
    per_block = PagedKVCache.bytes_per_block(kv_config(model), 4, model.dtype)
    cfg = dict(block_size=4, max_num_seqs=6, max_num_batched_tokens=40, kv_cache_bytes=budget)
    captured = Engine(model, byte_tokenizer(), EngineConfig(decode_graphs="auto", **cfg))
    reserve = CudaGraphs.memory_estimate(model.config, 6, model.dtype)
    V, bs = model.config.vocab_size, [1, 2, 4, 8]
    assert reserve >= 4 * sum(bs) * V * 4  # at least every graph's logits
    assert captured.graph_reserve == reserve and captured.kv.num_blocks == (budget - reserve) // per_block
    assert captured.runner.graphs.capture and len(captured.runner.graphs.graphs) == 2 * len(bs)
    eager = Engine(model, byte_tokenizer(), EngineConfig(decode_graphs="eager", **cfg))
    assert eager.graph_reserve == 0 and eager.kv.num_blocks == budget // per_block
    fixed = Engine(model, byte_tokenizer(), EngineConfig(decode_graphs="auto", num_blocks=40, **cfg))
    assert fixed.kv.num_blocks == 40


def test_the_graph_probe_asks_for_the_kv_caches_dtype(monkeypatch):
    """Whether decode graphs can run depends on the attention kernel over the cache the engine will have: an int8
    cache's pools, not the model's dtype."""
    seen = []
    real = ops.decode_attention_backend

    def spy(q, pool):
        seen.append(pool.dtype)
        return real(q, pool)

    monkeypatch.setattr(ops, "decode_attention_backend", spy)
    engine = _engine("eager", kv_cache_dtype="int8")
    assert seen and set(seen) == {torch.int8}, seen
    assert engine.decode_attention == ops.decode_attention_backend(torch.zeros(1, 1, 16), engine.cache.k[0])


def test_every_thread_that_steps_the_model_binds_its_device(monkeypatch):
    """CUDA's current device is per thread: the engine thread sets the model's before its first step."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set", torch.device(d))))
    stream_mod.bind_device("cuda:1")
    stream_mod.bind_device("cpu")  # nothing to bind off CUDA
    assert calls == [("set", torch.device("cuda:1"))]
    bound = []
    monkeypatch.setattr(async_engine, "bind_device",
                        lambda d: bound.append((torch.device(d), threading.current_thread().name)))
    engine = async_engine.AsyncEngine(_engine("off"))
    engine.start()
    engine.stop()
    assert bound == [(torch.device("cpu"), "llamascope-engine")]


def test_the_draft_models_runner_runs_on_the_models_stream():
    """A draft model on a device that runs beside the host: its runner stages inputs in buffers of its own and
    records events on that device's stream (not the CPU's, whose events are complete at once), and speculation
    still changes no output."""
    from model.engine.speculative import SpeculativeConfig

    from model.quantize import quantize_model

    model, draft = tiny_model(seed=4), quantize_model(tiny_model(seed=4), "int8")
    model.stream, draft.stream = SimulatedStream(), SimulatedStream()
    spec = SpeculativeConfig.parse({"method": "draft_model", "model": "self", "quantization": "int8",
                                    "num_speculative_tokens": 3,
                                    "disable_by_batch_size": None})
    engine = Engine(model, byte_tokenizer(), EngineConfig(num_blocks=96, block_size=4, max_num_seqs=4,
                                                          max_num_batched_tokens=64, speculative=spec),
                    draft_model=draft)
    runner = engine.drafter._propose.__self__.runner  # (the DraftModelProposer the speculator calls)
    assert runner.stream is draft.stream and runner.buffers.separate
    engine.drafter.row_cost = engine.drafter.draft_cost = 0.0
    requests = {str(i): (p, greedy(10)) for i, p in enumerate(_prompts(3, seed=5, hi=20))}
    plain = tiny_model(seed=4)
    assert _tokens(run(engine, requests)) == _tokens(run(Engine(plain, byte_tokenizer(), EngineConfig(
        num_blocks=96, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)), requests))


def test_pinned_block_tables_are_sized_for_the_rows_that_read_them():
    """On a device, the staging sets' block tables are pinned memory: one per decode row where only decode rows
    read tables (the Triton / gather paths), not one per token of a step as the native kernel's prefill rows need."""
    model = tiny_model()
    model.stream = SimulatedStream()  # a device path (separate buffers) on the CPU
    with kernels.disabled():  # no native kernel: prefill rows attend by chunk, as on a GPU
        engine = _engine("off", model, max_num_batched_tokens=64, max_model_len=160)
        b = engine.runner.buffers
        assert b.separate and b.dev["paged_tables"].shape == (6, 40)
        sizes = [t.numel() for t in b.host_buffers() if t.dim() == 2 and t.shape[1] == 40]
        assert sizes == [6 * 40] * 2  # (S, W) each set, never (T, W)
        requests = {str(i): (p, greedy(6)) for i, p in enumerate(_prompts(6, seed=1, hi=30))}
        got = _tokens(run(engine, requests))
        assert got == _tokens(run(_engine("off", tiny_model(), max_num_batched_tokens=64, max_model_len=160),
                                  requests))


def test_grammar_masks_reach_the_device_from_pinned_memory(monkeypatch):
    """The structured-output masks go to the device as their packed words, from pinned memory (a copy from pageable
    memory waits, and the unpacked (M, V) bytes are 32 times the words): a `Tensor.to` that refuses anything else,
    and a device stood in for by "meta"."""
    real_to, real_pin = torch.Tensor.to, torch.Tensor.pin_memory
    pinned: set[int] = set()

    def pin(self, *a, **k):
        t = self.clone()
        pinned.add(id(t))
        return t

    def to(self, *args, **kwargs):
        target = next((a for a in (*args, kwargs.get("device")) if isinstance(a, (str, torch.device))), None)
        if target is not None and torch.device(target).type != "cpu" and self.device.type == "cpu":
            assert id(self) in pinned, f"a copy of {tuple(self.shape)} to {target} from pageable memory"
            assert kwargs.get("non_blocking"), "a copy to the device that waits"
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    V = 1000
    words = torch.full((3, (V + 31) // 32), -1, dtype=torch.int32)
    logits = torch.zeros(4, V, device="meta")
    shifts = torch.arange(32, dtype=torch.int32, device="meta")
    out = _apply_allowed(logits, AllowedTokens(words, [0, 2, 3]), shifts)
    assert out.shape == (4, V) and out.device.type == "meta" and pinned
