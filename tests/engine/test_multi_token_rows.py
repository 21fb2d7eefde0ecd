"""Rows of several new tokens (model/engine/engine.py's `drafter`): a decoding sequence computes 1, 3 or 5 tokens in
one step (its last token and 0, 2 or 4 drafts) beside other sequences' prefill chunks, every row's logits are
sampled, the drafts the samples agree with are kept and the K/V of the others rolled back. The tokens, logprobs and
top logprobs are bitwise those of decoding one token at a time, on each CPU path (the native fused step and the
module path) and precision (float32, bfloat16, int8, int4), with the rejected drafts' blocks back in the pool and none of them in the prefix cache.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from model import kernels
from model.engine import Engine, EngineConfig
from model.engine.sampling_params import SamplingParams
from drafting import PerSequence
from tiny import byte_tokenizer

pytestmark = pytest.mark.skipif(kernels.native() is None, reason=f"native kernels: {kernels.status()}")

PATHS = {"native": {}, "module": {"native_step": False}}
NEW_TOKENS = 48
# drafts proposed at successive steps of the drafting sequence: 0, 2 and 4 (rows of 1, 3 and 5 tokens); "bad2" is
# four drafts whose last two are wrong (a rollback of two), "bad4" four wrong ones
SCHEDULE = [4, 2, 0, "bad2", 4, 2, "bad4", 4, 0, 2, 4, 4]


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(7)
    return {"d": [rng.randrange(256) for _ in range(9)],  # the drafting sequence
            "p1": [rng.randrange(256) for _ in range(37)],  # long prompts: prefilled in chunks beside it
            "p2": [rng.randrange(256) for _ in range(29)]}


def _engine(model, path: str) -> Engine:
    # a 16-token step budget: the long prompts take several steps, in the same steps as the drafting rows
    return Engine(model, byte_tokenizer(), EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16,
                                                        max_num_seqs=8, **PATHS[path]))


def _serve(engine: Engine, prompts: dict[str, list[int]], arrive: dict[str, int]) -> dict[str, list]:
    """Every request's [(token, logprob, top)] in order; request r joins at step arrive[r]."""
    got: dict[str, list] = {r: [] for r in prompts}
    step = 0
    pending = dict(prompts)
    while pending or engine.has_unfinished():
        for r in [r for r in pending if arrive[r] <= step]:
            engine.add_request(r, pending.pop(r), _params())
        for out in engine.step():
            got[out.request_id] += [(t, lp.logprob, lp.top) for t, lp in zip(out.token_ids, out.logprobs)]
        step += 1
        assert step < 500
    return got


@pytest.mark.parametrize("path", list(PATHS))
def test_rows_of_several_tokens_equal_one_token_at_a_time(precision_model, path):
    model = precision_model
    prompts = _prompts()
    arrive = {"d": 0, "p1": 2, "p2": 5}
    reference = _serve(_engine(model, path), prompts, arrive)  # one token a row
    truth = [t for t, _, _ in reference["d"]]

    engine = _engine(model, path)
    plan = iter(SCHEDULE)
    proposed: list[tuple[int, int]] = []  # (drafts, of which wrong)

    def drafter(seq) -> list[int]:
        if seq.request.request_id != "d":
            return []
        kind = next(plan, 0)
        n_out = len(seq.output_token_ids)
        right = truth[n_out : n_out + 4]  # what decoding one at a time gives next
        if kind == "bad2":
            drafts = right[:2] + [(t + 1) % 256 for t in right[2:4]]
        elif kind == "bad4":
            drafts = [(t + 1) % 256 for t in right[:4]]
        else:
            drafts = right[:kind]
        proposed.append((len(drafts), sum(a != b for a, b in zip(drafts, right))))
        return drafts

    engine.drafter = PerSequence(drafter)
    rows = Counter()
    real_execute = engine.runner.execute

    def execute(scheduled):  # the row sizes the drafting sequence's steps really had
        for s in scheduled:
            if s.seq.request.request_id == "d":
                rows[s.num_new_tokens] += 1
        return real_execute(scheduled)

    engine.runner.execute = execute
    got = _serve(engine, prompts, arrive)
    assert got == reference  # tokens, logprob floats and top logprobs, bitwise, for every request
    assert {1, 3, 5} <= set(rows), rows
    assert (4, 2) in proposed and (4, 4) in proposed, proposed  # rollbacks of two and of four happened
    # nothing leaked: every block is back in the pool
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.requests


def test_a_rejected_draft_never_reaches_the_prefix_cache(precision_model):
    model = precision_model
    """Drafts rolled back leave no block hashed over them: a later request whose prompt continues the verified
    tokens is served their blocks from the cache, and one that continues with the rejected drafts is not."""
    tok = byte_tokenizer()
    engine = Engine(model, tok, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64))
    prompt = [5, 9, 33, 2, 71, 18, 40]  # 7 tokens: with the first output token, two full blocks
    reference = _serve(_engine(model, "native"), {"d": prompt}, {"d": 0})["d"]
    truth = [t for t, _, _ in reference]
    calls: list[list[int]] = []

    def drafter(seq) -> list[int]:
        n_out = len(seq.output_token_ids)
        bad = [(t + 1) % 256 for t in truth[n_out : n_out + 4]]
        calls.append(bad)
        return bad  # always rejected

    engine.drafter = PerSequence(drafter)
    got = _serve(engine, {"d": prompt}, {"d": 0})["d"]
    assert got == reference and calls[0] and len(calls[0]) == 4
    engine.drafter = None

    def cached_tokens(ids: list[int]) -> int:
        before = engine.kv.num_cached_prompt_tokens
        engine.add_request(f"probe{len(ids)}-{ids[-1]}", ids, SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        return engine.kv.num_cached_prompt_tokens - before

    # the first drafts sat at positions 8..11, a block of their own, after prompt + the first output token
    assert cached_tokens(prompt + truth[:1] + calls[0] + [1]) == 8  # blocks 0 and 1 only: the drafts' never cached
    assert cached_tokens(prompt + truth[:9] + [1]) == 16  # verified tokens' blocks are (17 tokens: 4 full blocks)
