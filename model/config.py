"""Model architecture: `ModelConfig`, a table of known shapes, and parsers for HF and GGUF metadata.

Architecture only (house rule 1): anything about capacity, dtype or device lives in the service Settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from model.loaders.errors import CheckpointError

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
                raise CheckpointError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.rope_dim == 0:
            object.__setattr__(self, "rope_dim", self.head_dim)
        if self.rope_dim != self.head_dim:
            raise CheckpointError(f"partial rotary embeddings (rope_dim {self.rope_dim} != head_dim {self.head_dim}) are not supported")
        if self.head_dim % 2:
            raise CheckpointError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise CheckpointError(f"n_heads {self.n_heads} must be a positive multiple of n_kv_heads {self.n_kv_heads}")
        if self.rope_scaling.rope_type not in SUPPORTED_ROPE_TYPES:
            raise CheckpointError(
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

    @classmethod
    def from_name(cls, name: str) -> "ModelConfig":
        try:
            return KNOWN_SHAPES[name]
        except KeyError:
            raise KeyError(f"unknown model shape {name!r}; known: {', '.join(sorted(KNOWN_SHAPES))}") from None

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """From a transformers `LlamaConfig` dict (config.json), v4 (`rope_theta`/`rope_scaling`) or v5 (`rope_parameters`)."""
        archs = cfg.get("architectures") or []
        if cfg.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
            raise CheckpointError(
                f"{source}: unsupported architecture (model_type={cfg.get('model_type')!r}, architectures={archs}); "
                "llamascope serves LLaMA-family checkpoints (model_type 'llama')"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise CheckpointError(f"{source}: {flag}=true is not supported (LLaMA has no projection biases)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{source}: hidden_act {cfg.get('hidden_act')!r} is not supported, only 'silu' (SwiGLU)")
        rope = dict(cfg.get("rope_scaling") or {})
        rope.update(cfg.get("rope_parameters") or {})
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        try:
            n_heads = cfg["num_attention_heads"]
            scaling = RopeScaling(
                rope_type=rope_type,
                factor=float(rope.get("factor", 1.0)),
                low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
            )
            return cls(
                vocab_size=cfg["vocab_size"],
                dim=cfg["hidden_size"],
                n_layers=cfg["num_hidden_layers"],
                n_heads=n_heads,
                n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
                hidden_dim=cfg["intermediate_size"],
                norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_scaling=scaling,
                max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                head_dim=cfg.get("head_dim") or 0,
            )
        except KeyError as e:
            raise CheckpointError(f"{source}: missing required key {e.args[0]!r}") from None
        except CheckpointError as e:
            raise CheckpointError(f"{source}: {e}") from None

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], source: str = "gguf") -> "ModelConfig":
        """From GGUF metadata (`llama.*` keys, see ggml's docs/gguf.md "LLaMA" section)."""
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise CheckpointError(f"{source}: unsupported architecture {arch!r} (general.architecture); only 'llama' is served")

        def key(name: str, default: Any = KeyError) -> Any:
            if f"llama.{name}" in meta:
                return meta[f"llama.{name}"]
            if default is KeyError:
                raise CheckpointError(f"{source}: missing metadata key 'llama.{name}'")
            return default

        n_heads = int(key("attention.head_count"))
        dim = int(key("embedding_length"))
        vocab = key("vocab_size", None)
        if vocab is None:
            vocab = len(meta.get("tokenizer.ggml.tokens") or [])
            if not vocab:
                raise CheckpointError(f"{source}: neither llama.vocab_size nor tokenizer.ggml.tokens is present")
        scaling_type = key("rope.scaling.type", "none")
        scaling = RopeScaling()
        if scaling_type == "linear":
            scaling = RopeScaling(rope_type="linear", factor=float(key("rope.scaling.factor")))
        elif scaling_type not in ("none", ""):
            scaling = RopeScaling(rope_type=scaling_type)  # rejected in __post_init__ unless supported
        # Llama 3.1 scaling travels in GGUF as a `rope_freqs.weight` tensor of per-frequency divisors, not as
        # metadata: the loader applies it to the model's RoPE (model/loaders/gguf.py).
        head_dim = int(key("attention.key_length", 0) or 0)
        try:
            return cls(
                vocab_size=int(vocab),
                dim=dim,
                n_layers=int(key("block_count")),
                n_heads=n_heads,
                n_kv_heads=int(key("attention.head_count_kv", n_heads)),
                hidden_dim=int(key("feed_forward_length")),
                norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
                rope_theta=float(key("rope.freq_base", 10000.0)),
                rope_scaling=scaling,
                max_seq_len=int(key("context_length", 2048)),
                tie_embeddings=False,  # decided by the loader: tied when the file has no output.weight
                head_dim=head_dim,
                rope_dim=int(key("rope.dimension_count", 0) or 0),
            )
        except CheckpointError as e:
            raise CheckpointError(f"{source}: {e}") from None


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
