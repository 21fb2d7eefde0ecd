"""`SpeculativeConfig`: what `--speculative-config` says, named and shaped as vLLM's `speculative_config`
(vllm/config/speculative.py) so that a vLLM user's JSON carries over:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "self", "quantization": "int4", "num_speculative_tokens": 4}

`"model": "self"` drafts with the served checkpoint loaded again at another quantization (the int4 copy of a model
drafting for its own float32 weights). `disable_by_batch_size`: no drafting while this many sequences or more are
running (vLLM's key; at high concurrency a CPU step is compute-bound and rejected rows cost what they compute)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # rows beyond this are nearly always rejected and cost a row each
# measured on the default model (benchmarks/speculative.py, docs/performance.md "Speculative decoding")
DEFAULT_PROMPT_LOOKUP = (2, 5)  # (min, max) when neither is given
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
DRAFT_QUANTIZATIONS = ("auto", "none", "int8", "int4")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram: the longest and shortest suffix n-gram looked up in the sequence's earlier tokens
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # draft_model: a GGUF file or HF directory with the target's vocabulary, or "self"; its weights' quantization
    model: str | None = None
    quantization: str | None = None
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From the flag's JSON (or a dict). ValueError naming the problem for anything else."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"--speculative-config needs {key!r}")
        config = cls(**value)
        config.validate()
        return config.with_defaults()

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config: unknown method {self.method!r}; this server has {list(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        for key in ("prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"--speculative-config: {key} must be a positive integer, got {v!r}")
        if self.method == "ngram":
            if self.model is not None or self.quantization is not None:
                raise ValueError("--speculative-config: 'model' and 'quantization' are for method 'draft_model'")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"--speculative-config: prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("--speculative-config: method 'draft_model' needs 'model' (a checkpoint path, or "
                                 "'self' for the served checkpoint at another quantization)")
            if self.quantization is not None and self.quantization not in DRAFT_QUANTIZATIONS:
                raise ValueError(f"--speculative-config: quantization must be one of {list(DRAFT_QUANTIZATIONS)}, "
                                 f"got {self.quantization!r}")
            if self.model == "self" and self.quantization in (None, "auto"):
                raise ValueError("--speculative-config: a 'self' draft model needs a 'quantization' other than the "
                                 "served one (e.g. 'int4')")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError("--speculative-config: prompt_lookup_* are for method 'ngram'")

    def with_defaults(self) -> SpeculativeConfig:
        """vLLM's rule for the lookup bounds: one given sets the other; neither gives the default (measured here)."""
        if self.method != "ngram":
            return self
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo, hi = DEFAULT_PROMPT_LOOKUP
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        return SpeculativeConfig(**{**asdict(self), "prompt_lookup_min": lo, "prompt_lookup_max": hi})

    def to_dict(self) -> dict[str, Any]:
        """What /v1/models shows: the fields that apply to the method."""
        return {k: v for k, v in asdict(self).items() if v is not None}
