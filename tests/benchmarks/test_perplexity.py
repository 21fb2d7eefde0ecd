"""benchmarks/perplexity.py's llama-perplexity scoring (`chunked_perplexity`) against the same rule computed the slow
way: every scored token's log-likelihood from its own forward over the chunk up to it."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.perplexity import chunked_perplexity
from tests.tiny import byte_tokenizer, tiny_model


@pytest.mark.parametrize("add_bos", [True, False])
def test_chunked_perplexity_scores_the_second_half_of_each_chunk(add_bos):
    model, tok = tiny_model(seed=3), byte_tokenizer()
    tok.add_bos = add_bos
    ctx = 12
    ids = list(torch.randint(0, 256, (3 * ctx + 5,), generator=torch.Generator().manual_seed(0)).tolist())
    ppl, scored = chunked_perplexity(model, tok, ids, ctx)

    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in (0, ctx, 2 * ctx):  # whole chunks only: the 5 ids after them are not scored
            chunk = ids[start : start + ctx]
            if add_bos:  # llama-perplexity puts BOS in place of each chunk's first token
                chunk[0] = tok.bos_id
            for t in range(ctx // 2, ctx - 1):  # position t predicts token t + 1
                logits = model(torch.tensor([chunk[: t + 1]]))[0, -1].double()
                nll -= torch.log_softmax(logits, -1)[chunk[t + 1]].item()
                count += 1
    assert scored == count == 3 * (ctx - 1 - ctx // 2)
    assert ppl == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_engine_perplexity_over_an_int8_cache_is_close_to_float32s():
    """`--kv-cache-dtypes ... int8` scores the prompt through the engine over an int8 pool: a perplexity close to
    the float32 cache's (a tiny random model's, whose perplexity is large), not equal (the cache did round)."""
    from types import SimpleNamespace

    from benchmarks.perplexity import engine_perplexity

    lm = SimpleNamespace(model=tiny_model(seed=3), tokenizer=byte_tokenizer())
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    ppl = {kv: engine_perplexity(lm, ids, kv)[1] for kv in ("float32", "int8")}
    assert ppl["int8"] != ppl["float32"] and ppl["int8"] / ppl["float32"] == pytest.approx(1.0, abs=0.01)
