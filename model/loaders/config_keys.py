"""A checkpoint's architecture keys -> `ModelConfig`: HF `config.json` (transformers' `LlamaConfig`, v4 and v5 key
names) and GGUF metadata (`llama.*` keys, ggml's docs/gguf.md "LLaMA" section). Anything this implementation cannot
run is a CheckpointError naming the file and the key."""

from __future__ import annotations

from typing import Any, Mapping

from model.config import ConfigError, ModelConfig, RopeScaling
from model.loaders.errors import CheckpointError


def config_from_hf(cfg: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
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
        return ModelConfig(
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
    except (CheckpointError, ConfigError) as e:
        raise CheckpointError(f"{source}: {e}") from None

def config_from_gguf(meta: Mapping[str, Any], source: str = "gguf") -> ModelConfig:
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
        return ModelConfig(
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
    except (CheckpointError, ConfigError) as e:
        raise CheckpointError(f"{source}: {e}") from None
