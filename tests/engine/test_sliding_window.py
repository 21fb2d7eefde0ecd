"""A model's own sliding window (Mistral v0.1, ModelConfig.sliding_window) in the paged cache: keys at positions <=
p - window are not attended on decode, prefill and chunked prefill, whatever the attention implementation; the
blocks wholly behind a sequence's window go back to the pool (KVCacheManager.release_behind_window) while the
prefix cache, preemption and n > 1 stay correct beside it."""

from __future__ import annotations

import random

import pytest
import torch

from model import kernels
from model.engine import Engine, EngineConfig
from model.engine.sampling_params import SamplingParams
from test_engine import assert_pool_clean, run
from tiny import byte_tokenizer, tiny_family

WINDOW, BS = 8, 4


@pytest.fixture(scope="module")
def mistral():
    return tiny_family("mistral")  # sliding_window 8


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _uncached(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq]))[0].float().log_softmax(-1)  # (T, V): the windowed causal mask


def _check(model, prompt: list[int], got: dict) -> None:
    """Greedy tokens, their logprobs and the prompt logprobs equal an uncached windowed forward's."""
    seq = prompt + got["tokens"]
    full = _uncached(model, seq)
    assert full[len(prompt) - 1 : -1].argmax(-1).tolist() == got["tokens"]
    for i, lp in enumerate(got["logprobs"]):
        assert abs(lp.logprob - full[len(prompt) - 1 + i, lp.token_id].item()) <= 1e-4
    if "prompt_logprobs" in got:
        for j in range(1, len(prompt)):
            assert abs(got["prompt_logprobs"][j].logprob - full[j - 1, prompt[j]].item()) <= 1e-4


@pytest.mark.parametrize("chunk", [64, 5])
@pytest.mark.parametrize("native", [True, False])
def test_window_on_decode_prefill_and_chunked_prefill(mistral, chunk, native):
    """Prompts of 3 to 45 tokens together, in one prefill or chunks of 5; the native fused step or the module path."""
    engine = Engine(mistral, byte_tokenizer(), EngineConfig(num_blocks=96, block_size=BS, max_num_batched_tokens=chunk,
                                                            native_step=native))
    prompts = {str(n): _prompt(n, n) for n in (3, 9, 20, 45)}
    res = run(engine, {k: (p, greedy(20, logprobs=0, prompt_logprobs=0)) for k, p in prompts.items()})
    for k, p in prompts.items():
        _check(mistral, p, res[k][0])
    assert_pool_clean(engine)


def test_the_pytorch_reference_ops_honour_the_window(mistral):
    """Kernels off: the gathered decode attention (its mask from each row's first key) and SDPA prefill chunks."""
    prompt = _prompt(30, 1)
    with kernels.disabled():
        engine = Engine(mistral, byte_tokenizer(), EngineConfig(num_blocks=64, block_size=BS, max_num_batched_tokens=7))
        got = run(engine, {"a": (prompt, greedy(16, logprobs=0, prompt_logprobs=0))})["a"][0]
    _check(mistral, prompt, got)


def test_blocks_behind_the_window_go_back_to_the_pool(mistral):
    """A 60-token prompt and 40 tokens: the sequence never holds more than the window's blocks (+ the chunk's and
    one partial), and the pool is whole again at the end."""
    engine = Engine(mistral, byte_tokenizer(), EngineConfig(num_blocks=64, block_size=BS, max_num_batched_tokens=6))
    prompt = _prompt(60, 2)
    engine.add_request("a", prompt, greedy(40, logprobs=0))
    held, tokens, logprobs = [], [], []
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.token_ids
            logprobs += o.logprobs
        seq = next(iter(engine.scheduler.running), None)
        if seq is not None:
            held.append(len(seq.block_ids) - seq.num_released_blocks)
    assert max(held) <= (WINDOW + 8 + 6) // BS + 2 < (60 + 40) // BS  # the window (rounded down to 8), a chunk
    _check(mistral, prompt, {"tokens": tokens, "logprobs": logprobs})
    assert_pool_clean(engine)


def test_prefix_cache_beside_the_window(mistral):
    """A shared 40-token prefix: the second request finds its blocks (released behind the first's window, they stay
    registered) and computes what it computes alone."""
    tok = byte_tokenizer()
    shared = _prompt(40, 3)
    a, b = shared + _prompt(5, 4), shared + _prompt(7, 5)
    alone = run(Engine(mistral, tok, EngineConfig(num_blocks=64, block_size=BS)), {"b": (b, greedy(12, logprobs=0))})
    engine = Engine(mistral, tok, EngineConfig(num_blocks=64, block_size=BS))
    run(engine, {"a": (a, greedy(12))})
    res = run(engine, {"b": (b, greedy(12, logprobs=0))})
    assert res["b"][0]["tokens"] == alone["b"][0]["tokens"]
    assert engine.kv.num_cached_prompt_tokens >= 32
    _check(mistral, b, res["b"][0])
    assert_pool_clean(engine)


def test_preemption_and_n_choices_beside_the_window(mistral):
    """A pool too small for every sequence at once (preemptions, recomputation), and n = 3 sharing a prompt."""
    prompts = {str(i): _prompt(20 + 7 * i, 10 + i) for i in range(5)}
    ref = {k: run(Engine(mistral, byte_tokenizer(), EngineConfig(num_blocks=64, block_size=BS)),
                  {k: (p, greedy(24))})[k][0]["tokens"] for k, p in prompts.items()}
    engine = Engine(mistral, byte_tokenizer(), EngineConfig(num_blocks=18, block_size=BS, max_num_batched_tokens=16))
    res = run(engine, {k: (p, greedy(24)) for k, p in prompts.items()})
    assert {k: res[k][0]["tokens"] for k in prompts} == ref
    assert engine.scheduler.num_preemptions > 0
    assert_pool_clean(engine)
    engine = Engine(mistral, byte_tokenizer(), EngineConfig(num_blocks=64, block_size=BS))
    res = run(engine, {"n": (prompts["3"], SamplingParams(n=3, max_tokens=16, temperature=0.8, seed=1, ignore_eos=True))})
    assert len(res["n"]) == 3
    assert_pool_clean(engine)


def test_released_blocks_are_never_read(mistral):
    """Every free block's keys and values set to NaN after each step: the native kernels read no position behind a
    row's window (a NaN read would reach the logits: 0 x NaN is NaN), so the tokens stay the uncached forward's."""
    engine = Engine(mistral, byte_tokenizer(), EngineConfig(num_blocks=48, block_size=BS, max_num_batched_tokens=5))
    prompts = {"a": _prompt(37, 6), "b": _prompt(13, 7)}
    for k, p in prompts.items():
        engine.add_request(k, p, greedy(30, logprobs=0))
    got = {k: {"tokens": [], "logprobs": []} for k in prompts}
    released = 0
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id]["tokens"] += o.token_ids
            got[o.request_id]["logprobs"] += o.logprobs
        free = torch.tensor(list(engine.kv.pool.free), dtype=torch.long)
        engine.cache.k[:, free] = float("nan")
        engine.cache.v[:, free] = float("nan")
        released = max(released, sum(s.num_released_blocks for s in engine.scheduler.running))
    assert released >= 4
    for k, p in prompts.items():
        _check(mistral, p, got[k])
