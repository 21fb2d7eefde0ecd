"""The sink + window KV cache (model/features/kv_window/schedule.py): the engine computes what the paper's formulation computes
(tests/streaming_reference.py: unrotated keys rotated at cache positions, one token at a time), whatever the
chunking, batch, decode path or preemption; its blocks stay bounded; generation runs past the context."""

from __future__ import annotations

import random

import pytest
import torch

from model import kernels
from model.engine import Engine, EngineConfig, RequestOptions, SamplingParams
from model.features import KVWindow
from streaming_reference import StreamingReference
from test_engine import assert_pool_clean, run
from tiny import byte_tokenizer

BS = 4


def _engine(model, **kw) -> Engine:
    cfg = dict(num_blocks=96, block_size=BS, max_num_batched_tokens=64, max_model_len=40)
    cfg.update(kw)
    return Engine(model, byte_tokenizer(), EngineConfig(**cfg))


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _params(window: KVWindow, max_tokens: int, **kw) -> tuple[SamplingParams, RequestOptions]:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw), RequestOptions(kv_window=window)


def _reference(model, window: KVWindow, prompt: list[int], tokens: list[int]) -> tuple[list[int], list[float], list[float]]:
    """The reference's greedy tokens after the prompt, its logprobs of `tokens`, and of the prompt's tokens 1..P-1."""
    lp = StreamingReference(model, window, BS).logprobs(prompt + tokens)  # (T, V)
    seq, P = prompt + tokens, len(prompt)
    greedy = lp[P - 1 : -1].argmax(-1).tolist()
    return greedy, [lp[P - 1 + i, t].item() for i, t in enumerate(tokens)], [lp[i, seq[i + 1]].item() for i in range(P - 1)]


def test_schedule_arithmetic():
    w = KVWindow(sink_tokens=4, window=10)
    # up to S + W + bs - 1 nothing is evicted; then a block at every bs tokens
    assert [w.evicted(t, 4) for t in (0, 13, 14, 17, 18, 21, 22)] == [0, 0, 0, 0, 4, 4, 8]
    for t in range(200):  # each query sees W .. W + bs - 1 earlier window tokens once the window is full
        if t >= 4 + 10:
            assert 10 <= t - 4 - w.evicted(t, 4) <= 13
        n = w.chunk_limit(t, 4)  # a chunk never crosses an eviction point
        assert n >= 1 and w.evicted(t + n - 1, 4) == w.evicted(t, 4) and w.evicted(t + n, 4) > w.evicted(t, 4)
    assert w.chunk_limit(0, 4) == 18 and w.max_cache_tokens(4) == 18
    with pytest.raises(ValueError, match="window"):
        KVWindow(4, 0).validate()


@pytest.mark.parametrize("sinks, window", [(2, 6), (4, 5), (0, 7), (5, 3)])
def test_windowed_generation_is_the_papers_streaming_attention(model, sinks, window):
    """Sinks inside a block (rows moved on eviction), a whole sink block (dropped from the table), none (the paper's
    window-only control) and sinks spilling into a second block; prompt logprobs (chunked prefill) and generated
    logprobs (decode) both equal the token-at-a-time reference, long past the context (max_model_len 40)."""
    w = KVWindow(sinks, window)
    prompt = _prompt(23, seed=sinks)
    engine = _engine(model)
    got = run(engine, {"a": (prompt, *_params(w, 70, logprobs=0, prompt_logprobs=0))})["a"][0]
    tokens = got["tokens"]
    assert len(tokens) == 70 and got["finish_reason"] == "length" and len(prompt) + 70 > engine.max_model_len
    greedy, lps, plps = _reference(model, w, prompt, tokens)
    assert tokens == greedy
    assert [lp.logprob for lp in got["logprobs"]] == pytest.approx(lps, abs=2e-4)
    assert [lp.logprob for lp in got["prompt_logprobs"][1:]] == pytest.approx(plps, abs=2e-4)
    assert engine.kv.num_evicted_blocks == (len(prompt) + 70 - 1 - sinks - window) // BS
    assert_pool_clean(engine)


@pytest.mark.parametrize("family", ["mistral", "granite", "qwen3"])
def test_windowed_generation_on_the_families(family):
    """The sink + window cache beside a family's switches: Mistral's own sliding window (8 keys, over cache
    positions, inside the kv_window's 4 + 10), Granite's attention scale, Qwen3's q/k norms: the engine still
    computes the streaming reference's tokens and logprobs."""
    from tiny import tiny_family

    model = tiny_family(family)
    w = KVWindow(4, 10)
    prompt = _prompt(23, seed=7)
    engine = _engine(model)
    got = run(engine, {"a": (prompt, *_params(w, 50, logprobs=0, prompt_logprobs=0))})["a"][0]
    greedy, lps, plps = _reference(model, w, prompt, got["tokens"])
    assert got["tokens"] == greedy
    assert [lp.logprob for lp in got["logprobs"]] == pytest.approx(lps, abs=2e-4)
    assert [lp.logprob for lp in got["prompt_logprobs"][1:]] == pytest.approx(plps, abs=2e-4)
    assert engine.kv.num_evicted_blocks > 0
    assert_pool_clean(engine)


def test_blocks_held_stay_within_the_bound(model):
    w = KVWindow(3, 9)
    engine = _engine(model, max_num_batched_tokens=12)  # long prompt in chunks, then decode
    engine.add_request("a", _prompt(50, 1), *_params(w, 60))
    most = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            most = max(most, len(seq.block_ids))
            assert seq.cache_len <= w.max_cache_tokens(BS)
    assert most <= (w.sink_tokens + w.window) / BS + 2
    assert_pool_clean(engine)


@pytest.mark.parametrize("kv", ["auto", "float16", "int8"])
def test_batched_with_others_prefix_cache_and_paths_give_the_same_tokens(model, kv):
    """Windowed and ordinary requests in one batch, sharing prompt prefixes (the prefix cache serves the ordinary
    ones and never the windowed), on every decode path: the windowed tokens are those of the request alone; over a
    float16 and an int8 cache too (its keys re-rotated in float32 and rounded once to float16, or quantized again,
    at each eviction)."""
    w = KVWindow(2, 6)
    shared = _prompt(12, 7)
    reqs = {"w1": (shared + [5], *_params(w, 40)), "w2": (shared + [9, 4], *_params(w, 33)),
            "plain": (shared + [5], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),
            "plain2": (shared, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2))}
    alone = {r: run(_engine(model, kv_cache_dtype=kv), {r: reqs[r]})[r][0]["tokens"] for r in ("w1", "w2")}
    configs = [{}, {"native_step": False}, {"decode_graphs": "eager"}]
    for cfg in configs:
        engine = _engine(model, kv_cache_dtype=kv, **cfg)
        got = run(engine, reqs, arrive_at={"w2": 3, "plain2": 5})
        assert {r: got[r][0]["tokens"] for r in alone} == alone, cfg
        assert_pool_clean(engine)
    assert engine.kv.num_cached_prompt_tokens > 0  # the ordinary requests did share their prefix
    with kernels.disabled():  # the PyTorch reference decode attention (gather + SDPA)
        got = run(_engine(model, kv_cache_dtype=kv), reqs, arrive_at={"w2": 3, "plain2": 5})
    assert {r: got[r][0]["tokens"] for r in alone} == alone


@pytest.mark.parametrize("kv", ["auto", "float16", "int8"])
def test_preempted_windowed_sequence_recomputes_the_same_cache(model, kv):
    """A pool too small for everyone: windowed sequences are preempted (their blocks freed, evictions forgotten)
    and recomputed in chunks, which land on the same keys at the same cache positions as before."""
    w = KVWindow(2, 6)
    reqs = {str(i): (_prompt(2 + i, 20 + i), *_params(w, 45)) for i in range(5)}
    alone = {r: run(_engine(model, kv_cache_dtype=kv), {r: p})[r][0]["tokens"] for r, p in reqs.items()}
    tight = _engine(model, num_blocks=8, max_model_len=32, kv_cache_dtype=kv)  # short prompts start in 1-2 blocks and grow to 3: not all five fit
    got = run(tight, reqs)
    assert tight.scheduler.num_preemptions > 0
    assert {r: c[0]["tokens"] for r, c in got.items()} == alone
    assert_pool_clean(tight)


def test_window_must_fit_the_context(model):
    engine = _engine(model)
    with pytest.raises(ValueError, match="kv_window.*exceeds the context length of 40"):
        engine.add_request("a", [1, 2], *_params(KVWindow(4, 33), 5))
    # without a window the usual limit holds; with one, a prompt longer than the context streams through
    with pytest.raises(ValueError, match="exceeds the context length"):
        engine.add_request("b", _prompt(60, 1), SamplingParams(max_tokens=5))
    engine.add_request("c", _prompt(60, 1), *_params(KVWindow(4, 8), 5))


def test_eviction_rotates_keys_with_the_models_rope(model):
    """The context shift re-rotates a key at position p to p - bs exactly as RoPE at p - bs would rotate it."""
    from model.engine.context_shift import ContextShift
    from model.features.kv_window import evict
    from model.kernels.ops import apply_rotary_tables
    from model.transformer import rotary_tables

    engine = _engine(model)
    cache = engine.cache
    shift = ContextShift(model, cache)
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(model.config.n_layers, 20, model.config.n_kv_heads, model.config.head_dim, generator=g)
    w, table = KVWindow(2, 6), [5, 9, 3, 7, 11]

    def rotated(positions):  # raw keys rotated at `positions`, (L, n, K, E)
        cos, sin = rotary_tables(*model.rope(torch.tensor([positions])), torch.float32)
        return torch.stack([apply_rotary_tables(raw[l, : len(positions)][None], cos, sin)[0] for l in range(raw.shape[0])])

    L = raw.shape[0]
    flat = cache.k.view(L, -1, *cache.k.shape[3:])
    slots = [table[c // BS] * BS + c % BS for c in range(18)]
    flat[:, slots] = rotated(list(range(18)))  # 18 tokens at cache positions 0..17
    ev = evict(table, w, 18, BS)
    assert ev.block_ids == [5, 3, 7, 11] and ev.released == 9 and ev.copy == (9, 5, 2)
    shift.apply(ev)
    # after: sinks 0, 1 unchanged; old positions 6..17 now at 2..13, rotated for their new positions
    new_slots = [ev.block_ids[c // BS] * BS + c % BS for c in range(14)]
    got = flat[:, new_slots]
    assert torch.allclose(got[:, :2], rotated([0, 1]), atol=1e-6)
    # the key of old position 6 + i is raw[6 + i] rotated at 2 + i
    cos, sin = rotary_tables(*model.rope(torch.tensor([list(range(2, 14))])), torch.float32)
    expect = torch.stack([apply_rotary_tables(raw[l, 6:18][None], cos, sin)[0] for l in range(L)])
    assert torch.allclose(got[:, 2:], expect, atol=1e-5)
