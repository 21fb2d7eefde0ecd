"""The batched sampler's processing against HF transformers' own logits processors (the peer's implementation, not
a restatement of ours): on random logits and random histories, the filtered distribution each row is drawn from
equals what transformers' processors, chained in the order `generate` chains them
(`GenerationMixin._get_logits_processor`), give that row alone.

Presence and frequency penalties have no processor in transformers; there the OpenAI API reference's formula is
written out below (`mu[j] -= c[j] * alpha_frequency + (c[j] > 0) * alpha_presence`, output tokens only)."""

from __future__ import annotations

import random

import pytest
import torch

from model.engine.sampler import Sampler, SamplingRow
from model.engine.sampling_params import SamplingParams

lp = pytest.importorskip("transformers.generation.logits_process")

V = 256
EOS = (3, 7)  # the stop ids min_tokens masks (EOS + stop_token_ids, chosen by the engine)


def openai_penalties(scores: torch.Tensor, output_ids: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI API reference, "Frequency and presence penalties", on output tokens (a prompt is not penalised)."""
    counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=V).float()  # (V,)
    return scores - counts * frequency - (counts > 0).float() * presence


def hf_process(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """logits (V,) -> the row's processed logits by transformers' processors, as `generate` orders them: sequence
    bias, repetition penalty, min new tokens, then (sampling only) temperature, top-k, top-p, min-p."""
    p = row.params
    history = torch.tensor([list(row.prompt_token_ids) + list(row.output_token_ids)], dtype=torch.long)  # (1, L)
    x = logits.float().unsqueeze(0).clone()  # (1, V)
    if p.logit_bias:
        x = lp.SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias.items()})(history, x)
    if p.repetition_penalty != 1.0 and history.shape[1]:
        x = lp.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(history, x)
    if p.min_tokens:
        x = lp.MinNewTokensLengthLogitsProcessor(len(row.prompt_token_ids), p.min_tokens, list(row.stop_ids))(history, x)
    x = openai_penalties(x[0], list(row.output_token_ids), p.presence_penalty, p.frequency_penalty).unsqueeze(0)
    if not p.greedy:
        x = lp.TemperatureLogitsWarper(p.temperature)(history, x)
        if p.top_k > 0:
            x = lp.TopKLogitsWarper(p.top_k)(history, x)
        if p.top_p < 1.0:
            x = lp.TopPLogitsWarper(p.top_p)(history, x)
        if p.min_p > 0.0:
            x = lp.MinPLogitsWarper(p.min_p)(history, x)
    return x[0]


GRID = dict(
    temperature=[0.0, 0.3, 0.7, 1.0, 1.6],
    top_k=[0, 1, 5, 40, 300],
    top_p=[1.0, 0.95, 0.6, 0.2],
    min_p=[0.0, 0.02, 0.2],
    repetition_penalty=[1.0, 1.1, 1.7, 0.8],
    presence_penalty=[0.0, 0.4, -1.0, 2.0],
    frequency_penalty=[0.0, 0.3, -0.5, 1.5],
    min_tokens=[0, 4, 30],
)


def random_row(rng: random.Random, only: str | None) -> SamplingRow:
    """Random params from GRID (all of them, or one field with the others neutral) and a random history."""
    kw = {k: rng.choice(vs) for k, vs in GRID.items()} if only is None else {}
    if only is not None and only != "logit_bias":
        kw[only] = rng.choice(GRID[only][1:])
    if only in (None, "logit_bias"):
        kw["logit_bias"] = {rng.randrange(V): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 12))}
    if only not in (None, "temperature"):
        kw.setdefault("temperature", 1.0)
    prompt = [rng.randrange(V) for _ in range(rng.randrange(0, 40))]
    output = [rng.randrange(V // 4) for _ in range(rng.randrange(0, 60))]  # repeats: counts above 1
    params = SamplingParams(**kw)
    return SamplingRow(params, prompt, output, params.make_generator("cpu"), frozenset(EOS))


@pytest.mark.parametrize("only", [None, "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                  "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens"])
def test_filtered_distribution_equals_transformers_processors(only):
    rng = random.Random(f"hf-{only}")
    gen = torch.Generator().manual_seed(len(only or "all"))
    rows = [random_row(rng, only) for _ in range(24)]
    logits = torch.randn(len(rows), V, generator=gen) * 4  # (B, V): peaked enough that top-p / min-p cut
    got = Sampler(V).process(logits, rows)  # (B, V), every row in one batch
    for i, row in enumerate(rows):
        want = hf_process(logits[i], row)
        # The same tokens survive, and the distribution over them is the same (float32 rounding apart: the
        # sampler subtracts penalties in one fused step, HF in separate ones).
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(want)), (i, row.params)
        torch.testing.assert_close(got[i].softmax(-1), want.softmax(-1), rtol=1e-5, atol=1e-7, msg=lambda m: f"{i}: {m}")
    if only in ("top_k", "top_p", "min_p"):  # the filters did cut something
        assert any(not torch.isfinite(got[i]).all() for i in range(len(rows)))
