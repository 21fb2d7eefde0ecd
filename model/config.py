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

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    `linear`: positions divided by `factor` (Chen et al. 2023, "Extending Context Window ... Positional Interpolation").
    `llama3`: per-frequency interpolation of Meta's Llama 3.1 (`meta-llama/llama-models`, `apply_scaling`):
    wavelengths longer than original_max_position_embeddings / low_freq_factor are divided by `factor`, shorter
    than .../high_freq_factor are kept, and the band between is blended linearly.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (grouped-query attention, Ainslie et al. 2023)."""
        return self.n_heads // self.n_kv_heads

    def num_parameters(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
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
}
