"""Batch invariance: a request's greedy tokens and logprobs are bit-identical whatever shares its steps.

Alone, among 24 concurrent requests, with its prompt prefilled in small chunks beside other sequences' decode rows,
and preempted and recomputed (its prompt and generated tokens prefilled again): the same tokens, the same logprob
floats, the same prompt logprobs, on float32, bfloat16, int8 and int4, and for the float32-activation precisions
over a 16-bit KV cache too (float16, bfloat16: each key and value rounded once when written) and an int8 one (each
head's row of a token quantized once, with its own scale, when written). What makes it hold (qgemm.h, paged_cache.py):
one linear kernel per precision whose per-output arithmetic does not depend on the number of rows, and every row,
prefill rows included, attending over the paged pool through the same per-row kernel. Without the native kernels
(PyTorch's GEMM, SDPA for prefill) none of this is promised, so the test needs them."""

from __future__ import annotations

import random

import pytest
import torch

from model import kernels
from model.engine import Engine, EngineConfig
from model.engine.sampling_params import SamplingParams
from model.quantize import quantize_model
from tiny import PRECISIONS, byte_tokenizer, tiny_model

pytestmark = pytest.mark.skipif(kernels.native() is None, reason=f"native kernels: {kernels.status()}")

def _prompts(n: int = 24) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(256) for _ in range(rng.randint(3, 45))] for _ in range(n)]


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)


def _run(engine: Engine, prompts: list[list[int]], arrive_every: int = 0) -> dict[str, tuple]:
    """Every request's (tokens, logprobs, prompt logprobs) as plain values; request i joins at step i * arrive_every."""
    got: dict[str, dict] = {str(i): {"tokens": [], "logprobs": [], "prompt": None} for i in range(len(prompts))}
    pending, step = list(enumerate(prompts)), 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] * arrive_every <= step:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, _params())
        for o in engine.step():
            g = got[o.request_id]
            g["tokens"] += o.token_ids
            g["logprobs"] += [(lp.token_id, lp.logprob, lp.rank, tuple(lp.top)) for lp in o.logprobs]
            if o.prompt_logprobs is not None:
                g["prompt"] = [None if lp is None else (lp.token_id, lp.logprob, tuple(lp.top)) for lp in o.prompt_logprobs]
        step += 1
    return {r: (g["tokens"], g["logprobs"], g["prompt"]) for r, g in got.items()}


def _engine(precision_model, **kw) -> Engine:
    return Engine(precision_model, byte_tokenizer(), EngineConfig(**{"num_blocks": 256, "block_size": 4, **kw}))


# Each precision with its default cache, and the float32 ones also over a 16-bit and an int8 cache (on CPU these are
# for float32 activations: a bfloat16 model's cache is bfloat16 already)
CASES = [(p, kv) for p in PRECISIONS for kv in ("auto", "float16", "bfloat16", "int8")
         if kv == "auto" or p[1] == torch.float32]


@pytest.fixture(scope="module", params=CASES, ids=[f"{p[0]}-kv-{kv}" for p, kv in CASES])
def case(request):
    (_, dtype, mode), kv = request.param
    return quantize_model(tiny_model(seed=3, dtype=dtype), mode), {"kv_cache_dtype": kv}


@pytest.fixture(scope="module")
def precision_model(case):  # (this module's: one per case, overriding the conftest's one per precision)
    return case[0]


@pytest.fixture(scope="module")
def kv(case) -> dict:
    return case[1]


@pytest.fixture(scope="module")
def alone(precision_model, kv):
    """Each request on its own, one after another (the prefix cache stays cold: random prompts share nothing)."""
    engine = _engine(precision_model, **kv)
    out = {}
    for i, p in enumerate(_prompts()):
        out.update({str(i): v for v in _run(engine, [p]).values()})
    return out


@pytest.mark.parametrize("scenario", ["24-concurrent", "chunked-prefill", "preempted"])
def test_requests_are_bitwise_the_same_whatever_shares_their_steps(precision_model, kv, alone, scenario):
    prompts = _prompts()
    if scenario == "24-concurrent":  # all at once: prefills of up to 24 prompts packed into 512-token steps
        engine = _engine(precision_model, **kv)
        got = _run(engine, prompts)
    elif scenario == "chunked-prefill":  # 7-token budget: prompts in chunks, beside other sequences' decode rows
        engine = _engine(precision_model, max_num_batched_tokens=7, **kv)
        got = _run(engine, prompts, arrive_every=2)
    else:  # a pool too small for everyone: the newest are preempted and recomputed from their tokens
        engine = _engine(precision_model, num_blocks=40, max_num_batched_tokens=64, **kv)
        got = _run(engine, prompts)
        assert engine.scheduler.num_preemptions > 0
    assert engine.stats().steps_by_path["native"] > 0
    quantized = precision_model.quantization != "none"
    auto = torch.float16 if quantized and precision_model.dtype == torch.float32 else precision_model.dtype
    assert engine.cache.k.dtype == (auto if kv["kv_cache_dtype"] == "auto" else getattr(torch, kv["kv_cache_dtype"]))
    assert got.keys() == alone.keys()
    for r in alone:
        assert got[r] == alone[r], r  # tokens, logprob floats and prompt logprob floats, compared exactly


def test_plain_greedy_rows_pick_without_logits_the_tokens_their_logits_give(monkeypatch):
    """A step whose every logits row is a plain greedy row (no logprobs, penalties or bias) picks on the native path
    without forming the logits (`Transformer.greedy_picks`, csrc/float_linear.cpp): in steps that prefill beside
    decode rows and in decode-only steps, the same tokens as the same requests asking for logprobs (whose steps form
    the logits and sample from them), all at once and one at a time."""
    from model.kernels import ops

    picked: list[int] = []
    real = ops.linear_argmax
    monkeypatch.setattr(ops, "linear_argmax", lambda x, w: picked.append(x.shape[0]) or real(x, w))
    model, prompts = tiny_model(seed=3), _prompts()

    def tokens(logprobs, **kw) -> dict[str, list[int]]:
        engine = _engine(model, **kw)
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=logprobs)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for o in engine.step():
                got[o.request_id] += o.token_ids
        return got

    want = tokens(logprobs=1)
    assert not picked  # a row asking for logprobs forms its step's logits
    assert tokens(logprobs=None) == want
    assert max(picked) == len(prompts) and len(picked) >= 10  # the first step prefills all 24; then decode steps
    picked.clear()
    assert tokens(logprobs=None, max_num_seqs=1) == want
    assert picked and max(picked) == 1
