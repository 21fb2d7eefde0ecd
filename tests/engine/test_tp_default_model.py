"""The default model (SmolLM2-135M, Q4_1 GGUF, 9 query / 3 KV heads) split three ways: each rank cuts its rows from
the quantized blocks and un-permutes Q/K per slice, and the chat answer, its logprobs and the logits match TP=1."""

from __future__ import annotations

import pytest
import torch

from model.engine import Engine, EngineConfig
from model.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # three processes load the default model (86 s on 2 cores shared with other work)


def _answer(model, tok, ids):
    engine = Engine(model, tok, EngineConfig(kv_cache_bytes=32 << 20))
    engine.add_request("a", ids, SamplingParams(max_tokens=10, temperature=0, logprobs=1))
    tokens, lps = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
            lps += [lp.logprob for lp in out.logprobs or []]
    return tokens, lps


def test_tp3_answers_like_tp1(default_model, default_gguf):
    from model.parallel.rank0 import launch

    tok = default_model.tokenizer
    # float32 greedy answer without a near-tie (tests/model/test_default_model.py): rounding order cannot flip a token
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]))
    ref, ref_lp = _answer(default_model.model, tok, ids)
    three = launch(default_gguf, 3)
    try:
        assert three.model.kv_config.n_kv_heads == 1 and three.model.kv_config.n_heads == 3
        got, got_lp = _answer(three.model, tok, ids)
        with torch.inference_mode():
            x = torch.tensor([ids])
            a, b = default_model.model(x), three.model(x)
    finally:
        three.model.close()
    assert got == ref and len(got) == 10
    assert max(abs(p - q) for p, q in zip(ref_lp, got_lp)) <= 1e-4
    assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()
