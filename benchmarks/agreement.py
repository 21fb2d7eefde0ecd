"""Whether two decode paths computed the same function: greedy tokens and top-k log-probabilities, step by step.

Two paths that differ only in kernels (the Triton paged kernel vs gather + SDPA, a CUDA graph vs eager launches,
another bfloat16 summation order) give logits that differ by rounding. Over 128 greedy tokens on random weights a
near-tie then flips a token without any bug, and every later step sees another context, so "the token sequences
are equal" is a coin toss, not a check. What `compare` checks instead, up to and including the first step where the
greedy tokens differ (the last step at which both paths saw the same context):

- the log-probabilities of the reference's top-k tokens: max |difference| <= `tolerance` (a token in the reference's
  top-k but not in the other's counts with the least its log-probability can differ, against the other's k-th);
- the first `first` tokens: equal, or the first difference falls on a near-tie, i.e. the reference ranks the other
  path's token within 2 x `tolerance` of its own (each side's rounding can move a log-probability by `tolerance`).

This is what vLLM's tests do for kernels that are not bitwise equal (`check_logprobs_close` in
tests/models/utils.py: stop at the first differing token, and require each side's token in the other's top-k).

The stated tolerances, in nats, per dtype: float32 1e-3 (summation order only; measured ~1e-5 on CPU);
bfloat16 0.15: its 8 significant bits put a logit of magnitude ~20 (random 7B weights, SmolLM2's head) within
20 * 2^-8 = 0.08 of its exact value after the last rounding alone, on each of the two sides; float16 (11 bits) 0.02.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.15, torch.float16: 0.02}
FIRST_TOKENS = 8  # the greedy tokens that must be equal (near-ties excepted)
TOP_K = 5  # log-probabilities compared per step (the engine returns at most max_logprobs = 20)


@dataclass(frozen=True)
class StepLogprobs:
    token: int  # the greedy token of this step
    top: dict[int, float]  # the step's top-k token ids -> log-probability (the greedy token among them)

    @classmethod
    def from_logits(cls, logits: torch.Tensor, k: int = TOP_K) -> "StepLogprobs":
        """logits (V,) of one position -> its greedy token and top-k log-probabilities (float32 log-softmax)."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        values, ids = lp.topk(k)
        return cls(int(ids[0]), dict(zip(ids.tolist(), values.tolist())))


def _worst_step_diff(ref: StepLogprobs, other: StepLogprobs) -> float:
    floor = min(other.top.values())  # every token outside the other's top-k has at most this log-probability
    return max(abs(lp - other.top[t]) if t in other.top else max(0.0, lp - floor) for t, lp in ref.top.items())


def compare(ref: list[StepLogprobs], other: list[StepLogprobs], tolerance: float, first: int = FIRST_TOKENS) -> dict:
    """The record benchmarks/gpu.py writes for a pair of decode paths (`agree` sums it up; see the module doc)."""
    n = min(len(ref), len(other))
    if n == 0:
        raise ValueError("compare: no steps")
    first = min(first, n)
    diverge = next((i for i in range(n) if ref[i].token != other[i].token), None)
    last = n - 1 if diverge is None else diverge  # steps 0..last saw the same context on both sides
    worst = max(_worst_step_diff(a, b) for a, b in zip(ref[: last + 1], other[: last + 1]))
    margin = None
    if diverge is not None:
        r = ref[diverge]
        margin = r.top[r.token] - r.top.get(other[diverge].token, min(r.top.values()))
    first_equal = diverge is None or diverge >= first
    near_tie = margin is not None and margin <= 2 * tolerance
    return {
        "steps": n,
        "first_tokens": first,
        "first_tokens_equal": first_equal,
        "first_divergence": diverge,  # step index, or None: every compared token equal
        "ref_margin_at_divergence": margin,  # the reference's log-prob gap between its token and the other's
        "max_abs_logprob_diff": worst,
        "tolerance": tolerance,
        "agree": worst <= tolerance and (first_equal or near_tie),
    }


def summary(c: dict) -> str:
    """One line of the report."""
    tokens = (f"first {c['first_tokens']} tokens equal" if c["first_tokens_equal"]
              else f"tokens differ at step {c['first_divergence']} (reference margin {c['ref_margin_at_divergence']:.3f})")
    return (f"{tokens}, max |d logprob| {c['max_abs_logprob_diff']:.2e} (tolerance {c['tolerance']:g}) over "
            f"{c['steps']} steps: {'agree' if c['agree'] else 'DISAGREE'}")
