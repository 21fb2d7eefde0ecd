"""Model architecture: `ModelConfig` and a table of known shapes. A checkpoint's metadata keys are parsed into it by
model/loaders/config_keys.py.

Architecture only (docs/development.md rule 1): anything about capacity, dtype or device lives in the service Settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """An architecture this implementation cannot run (the loaders report it as a ConfigError naming the file)."""

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
QK_NORMS = ("none", "head", "projection")
NORM_PLACEMENTS = ("pre", "post")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    `linear`: positions divided by `factor` (Chen et al. 2023, "Extending Context Window ... Positional Interpolation").
    `llama3`: per-frequency interpolation of Meta's Llama 3.1 (`meta-llama/llama-models`, `apply_scaling`):
    wavelengths longer than original_max_position_embeddings / low_freq_factor are divided by `factor`, shorter
    than .../high_freq_factor are kept, and the band between is blended linearly.
    `longrope`: Phi-3's per-frequency divisors (Ding et al. 2024, "LongRoPE"; transformers' modeling_rope_utils
    `_compute_longrope_parameters`): `long_factor` where the served context exceeds
    original_max_position_embeddings, else `short_factor`, and cos/sin scaled by `attention_factor`. The choice is
    made once for the model's context (`ModelConfig.max_seq_len`), as llama.cpp does (`get_rope_factors`: n_ctx
    against the original context), so every token of every sequence is rotated by the same frequencies.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int  # SwiGLU inner width
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    head_dim: int = 0  # 0 -> dim // n_heads
    # Dimensions RoPE rotates per head (GGUF `rope.dimension_count`); 0 -> head_dim. Partial rotary is not
    # implemented: a value other than head_dim is rejected in __post_init__.
    rope_dim: int = 0
    # The family switches (docs/engine.md "Checkpoints"): at their defaults the block is LLaMA's. Every execution path
    # honours them (the module path, the native CPU step, Triton, tensor parallelism, the probes).
    architecture: str = "llama"  # the checkpoint's family, as its file names it: for messages, never a switch
    qkv_bias: bool = False  # biases on q, k and v (Qwen2), added after the projection, quantized or not
    # RMSNorm of q and k before RoPE: "head" over each head's E values, one (E,) gain shared by the heads (Qwen3);
    # "projection" over the whole H E (K E) projection with an (H E,) / (K E,) gain (OLMo-2)
    qk_norm: str = "none"
    sliding_window: int = 0  # a query at position p attends to keys at positions > p - window (Mistral v0.1); 0: all
    norm_placement: str = "pre"  # "pre": norm -> sub-block -> residual add (LLaMA); "post": sub-block -> norm -> add (OLMo-2)
    # Granite's multipliers (transformers modeling_granite.py): the embeddings times embedding_multiplier, each
    # sub-block's output times residual_multiplier before its residual add, attention scores times
    # attention_multiplier instead of 1/sqrt(E) (0: 1/sqrt(E)), the logits divided by logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 0.0
    logits_scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ConfigError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.rope_dim == 0:
            object.__setattr__(self, "rope_dim", self.head_dim)
        if self.rope_dim != self.head_dim:
            raise ConfigError(f"partial rotary embeddings (rope_dim {self.rope_dim} != head_dim {self.head_dim}) are not supported")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads {self.n_heads} must be a positive multiple of n_kv_heads {self.n_kv_heads}")
        if self.rope_scaling.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope scaling type {self.rope_scaling.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.rope_scaling.rope_type == "longrope":
            half = self.head_dim // 2
            if len(self.rope_scaling.short_factor) != half or len(self.rope_scaling.long_factor) != half:
                raise ConfigError(f"longrope needs {half} short and long factors (head_dim / 2), got "
                                  f"{len(self.rope_scaling.short_factor)} and {len(self.rope_scaling.long_factor)}")
        if self.qk_norm not in QK_NORMS:
            raise ConfigError(f"qk_norm must be one of {', '.join(QK_NORMS)}, got {self.qk_norm!r}")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ConfigError(f"norm_placement must be one of {', '.join(NORM_PLACEMENTS)}, got {self.norm_placement!r}")
        if self.sliding_window < 0:
            raise ConfigError(f"sliding_window must be >= 0, got {self.sliding_window}")

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (grouped-query attention, Ainslie et al. 2023)."""
        return self.n_heads // self.n_kv_heads

    @property
    def attention_scale(self) -> float:
        """The factor of q k^T in softmax: 1/sqrt(E) (Vaswani et al. 2017), or Granite's attention_multiplier."""
        return self.attention_multiplier or self.head_dim ** -0.5

    def num_parameters(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        attn += (self.n_heads + 2 * self.n_kv_heads) * self.head_dim if self.qkv_bias else 0
        attn += {"head": 2 * self.head_dim, "projection": (self.n_heads + self.n_kv_heads) * self.head_dim}.get(self.qk_norm, 0)
        ffn = 3 * self.dim * self.hidden_dim
        per_layer = attn + ffn + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * per_layer + self.dim + head

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _llama3_scaling(factor: float) -> RopeScaling:
    return RopeScaling("llama3", factor, 1.0, 4.0, 8192)


# Known shapes (gpt-fast's `transformer_configs` idea): for building random models in tests and benchmarks,
# and for sizing memory before a checkpoint is at hand. Values from each model's published config.json.
KNOWN_SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(49152, 576, 30, 9, 3, 1536, 1e-5, 100000.0, max_seq_len=8192, tie_embeddings=True),
    "smollm2-360m": ModelConfig(49152, 960, 32, 15, 5, 2560, 1e-5, 100000.0, max_seq_len=8192, tie_embeddings=True),
    "smollm2-1.7b": ModelConfig(49152, 2048, 24, 32, 32, 8192, 1e-5, 130000.0, max_seq_len=8192, tie_embeddings=True),
    "tinyllama-1.1b": ModelConfig(32000, 2048, 22, 32, 4, 5632, 1e-5, 10000.0, max_seq_len=2048),
    "llama-2-7b": ModelConfig(32000, 4096, 32, 32, 32, 11008, 1e-5, 10000.0, max_seq_len=4096),
    "llama-3.2-1b": ModelConfig(128256, 2048, 16, 32, 8, 8192, 1e-5, 500000.0, _llama3_scaling(32.0), 131072, True),
    "llama-3.2-3b": ModelConfig(128256, 3072, 28, 24, 8, 8192, 1e-5, 500000.0, _llama3_scaling(32.0), 131072, True),
    "llama-3.1-8b": ModelConfig(128256, 4096, 32, 32, 8, 14336, 1e-5, 500000.0, _llama3_scaling(8.0), 131072),
    "llama-3.1-70b": ModelConfig(128256, 8192, 80, 64, 8, 28672, 1e-5, 500000.0, _llama3_scaling(8.0), 131072),
    # the other families' switches on (model/loaders/families.py)
    "qwen2.5-1.5b": ModelConfig(151936, 1536, 28, 12, 2, 8960, 1e-6, 1e6, max_seq_len=32768, tie_embeddings=True,
                                architecture="qwen2", qkv_bias=True),
    "qwen3-4b": ModelConfig(151936, 2560, 36, 32, 8, 9728, 1e-6, 1e6, max_seq_len=40960, tie_embeddings=True,
                            head_dim=128, architecture="qwen3", qk_norm="head"),
    "mistral-7b-v0.1": ModelConfig(32000, 4096, 32, 32, 8, 14336, 1e-5, 10000.0, max_seq_len=32768,
                                   architecture="mistral", sliding_window=4096),
}
