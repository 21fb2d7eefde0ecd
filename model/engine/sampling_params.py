"""`SamplingParams`: the engine-facing form of an OpenAI request's sampling fields, validated with ranges named.
What a request carries beside its sampling (interventions, reads, per-row features, kv window) is its
`RequestOptions` (model/engine/request_options.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real

import torch

# vLLM's `_SAMPLING_EPS`: temperatures below it are greedy, since dividing by them overflows float32.
SAMPLING_EPS = 1e-5


def _bad(name: str, allowed: str, value: object) -> ValueError:
    return ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_int(name: str, value: object, lo: int, hi: int | None = None, hi_text: str | None = None) -> None:
    allowed = f"an integer in [{lo}, {hi_text or hi}]" if hi is not None else f"an integer >= {lo}"
    if not isinstance(value, Integral) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        raise _bad(name, allowed, value)


def _check_float(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> None:
    allowed = f"a finite number in {'(' if lo_open else '['}{lo}, {hi}]"
    if not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value):
        raise _bad(name, allowed, value)
    if value < lo or (lo_open and value == lo) or value > hi:
        raise _bad(name, allowed, value)


@dataclass
class SamplingParams:
    """The engine-facing form of an OpenAI request's sampling fields (the service converts its pydantic model)."""

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # below SAMPLING_EPS (so 0) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off; values above the vocabulary are clamped to it
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # used by the engine, not the sampler
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # the engine leaves EOS out of stop_ids; the sampler needs nothing for it
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and top-k alternatives
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # With logprobs set: each sampled token's TokenLogprobs also carries the raw logprobs of these token ids (the
    # metric of an activation-patching sweep, model/probes/patching.py)
    score_token_ids: tuple[int, ...] = ()
    # "delta": an output each step the choice gets tokens (streaming); "final": one output when it ends, with
    # everything (vLLM's RequestOutputKind.FINAL_ONLY: a non-streamed request, no per-token work for the client)
    output_kind: str = "delta"

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def validate(self, vocab_size: int, max_logprobs: int = 20) -> None:
        """Raise ValueError naming the first bad field and its allowed range."""
        _check_int("n", self.n, 1)
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens, f"max_tokens={self.max_tokens}")
        _check_float("temperature", self.temperature, 0.0, math.inf)
        _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("top_k", self.top_k, -1)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, math.inf, lo_open=True)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise _bad("logit_bias", "a dict of token id -> bias", self.logit_bias)
            for tok, bias in self.logit_bias.items():
                _check_int(f"logit_bias key {tok!r}", tok, 0, vocab_size - 1)
                _check_float(f"logit_bias[{tok}]", bias, -100.0, 100.0)
        if self.seed is not None:  # torch.Generator.manual_seed's accepted range
            _check_int("seed", self.seed, -(2**63), 2**64 - 1)
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise _bad("stop", "a list of non-empty strings", self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise _bad("stop_token_ids", "a list of token ids", self.stop_token_ids)
        for tok in self.stop_token_ids:
            _check_int("stop_token_ids", tok, 0, vocab_size - 1)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, max_logprobs, f"max_logprobs={max_logprobs}")
        for tok in self.score_token_ids:
            _check_int("score_token_ids", tok, 0, vocab_size - 1)
        if self.score_token_ids and self.logprobs is None:
            raise _bad("score_token_ids", "given with logprobs (>= 0)", self.score_token_ids)
        if self.output_kind not in ("delta", "final"):
            raise _bad("output_kind", '"delta" or "final"', self.output_kind)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, "a boolean", getattr(self, name))

    def make_generator(self, device: torch.device | str, offset: int = 0) -> torch.Generator | None:
        """The per-sequence generator the engine creates once (None when unseeded); it must live on the
        logits' device, and its state carries the sequence's randomness from step to step. `offset` (the
        choice index) gives each of n > 1 choices of a seeded request its own stream."""
        if self.seed is None:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed + offset) % 2**64)
        return gen
