"""A checkpoint's architecture keys -> `ModelConfig`: HF `config.json` (transformers' configuration_<family>.py, v4
and v5 key names) and GGUF metadata (`<arch>.*` keys, ggml's docs/gguf.md and the keys llama.cpp's converter writes,
gguf-py/gguf/constants.py), for the families of model/loaders/families.py. Anything this implementation cannot run is
a CheckpointError naming the file and the key."""

from __future__ import annotations

import math
from typing import Any, Mapping

from model.config import ConfigError, ModelConfig, RopeScaling
from model.loaders.errors import CheckpointError
from model.loaders.families import BY_GGUF_ARCH, FAMILIES, Family, supported_gguf, supported_hf


def config_from_hf(cfg: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """From a transformers config dict (config.json) of a family in `families.FAMILIES`, v4 (`rope_theta` /
    `rope_scaling`) or v5 (`rope_parameters`) key names."""
    archs = cfg.get("architectures") or []
    family = hf_family(cfg)
    if family is None:
        raise CheckpointError(
            f"{source}: unsupported architecture (model_type={cfg.get('model_type')!r}, architectures={archs}); "
            f"llamascope serves these model_types: {supported_hf()}"
        )
    name = family.name
    # Attention biases: Qwen2's q/k/v always; a LLaMA-style `attention_bias` would add one to o_proj too.
    if cfg.get("attention_bias") and name != "qwen2":
        raise CheckpointError(f"{source}: attention_bias=true is not supported for {name} (a bias on o_proj)")
    if cfg.get("mlp_bias"):
        raise CheckpointError(f"{source}: mlp_bias=true is not supported (SwiGLU without biases)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act {cfg.get('hidden_act')!r} is not supported, only 'silu' (SwiGLU)")
    rope = dict(cfg.get("rope_scaling") or {})
    rope.update(cfg.get("rope_parameters") or {})
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    try:
        n_heads = cfg["num_attention_heads"]
        max_seq_len = int(cfg.get("max_position_embeddings", 2048))
        head_dim = 0 if name == "granite" else cfg.get("head_dim") or 0  # Granite: hidden_size / heads
        partial = next((float(x) for x in (rope.get("partial_rotary_factor"), cfg.get("partial_rotary_factor"))
                        if x is not None and float(x) != 1.0), 1.0)
        if partial != 1.0:
            raise CheckpointError(f"partial_rotary_factor {partial} (partial rotary embeddings) is not supported")
        scaling = _hf_rope_scaling(rope, rope_type, cfg, max_seq_len)
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
            max_seq_len=max_seq_len,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_dim=head_dim,
            architecture=name,
            qkv_bias=name == "qwen2",
            qk_norm={"qwen3": "head", "olmo2": "projection"}.get(name, "none"),
            sliding_window=_hf_sliding_window(cfg, name),
            norm_placement="post" if name == "olmo2" else "pre",
            embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)) if name == "granite" else 1.0,
            residual_multiplier=float(cfg.get("residual_multiplier", 1.0)) if name == "granite" else 1.0,
            attention_multiplier=float(cfg.get("attention_multiplier", 0.0) or 0.0) if name == "granite" else 0.0,
            logits_scaling=float(cfg.get("logits_scaling", 1.0)) if name == "granite" else 1.0,
        )
    except KeyError as e:
        raise CheckpointError(f"{source}: missing required key {e.args[0]!r}") from None
    except (CheckpointError, ConfigError) as e:
        raise CheckpointError(f"{source}: {e}") from None


def hf_family(cfg: Mapping[str, Any]) -> Family | None:
    """The family of a transformers config (its model_type; a LlamaForCausalLM without one is LLaMA), or None."""
    family = FAMILIES.get(cfg.get("model_type"))
    if family is None and "LlamaForCausalLM" in (cfg.get("architectures") or []) and not cfg.get("model_type"):
        family = FAMILIES["llama"]
    return family


def _hf_rope_scaling(rope: Mapping[str, Any], rope_type: str, cfg: Mapping[str, Any], max_seq_len: int) -> RopeScaling:
    if rope_type in ("longrope", "su"):  # Phi-3's 128k variants ("su": the name of its first configs)
        # transformers `_compute_longrope_parameters`: the original context from the config's top level where it
        # has one (Phi-3), the factor from the two contexts, the attention factor unless given
        original = int(rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                       or max_seq_len)
        factor = float(rope.get("factor") or max_seq_len / original)
        attention = rope.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return RopeScaling(rope_type="longrope", factor=factor, original_max_position_embeddings=original,
                           short_factor=tuple(float(x) for x in rope["short_factor"]),
                           long_factor=tuple(float(x) for x in rope["long_factor"]), attention_factor=float(attention))
    return RopeScaling(
        rope_type=rope_type,
        factor=float(rope.get("factor", 1.0)),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
    )


def _hf_sliding_window(cfg: Mapping[str, Any], family: str) -> int:
    """The one sliding window every layer has, or 0. transformers' rule: `layer_types` where the config lists them;
    else Qwen2/Qwen3 slide only with `use_sliding_window`, in layers >= `max_window_layers`; Mistral and Phi-3 slide
    in every layer when `sliding_window` is set. A mix of sliding and full layers is refused (one window per model)."""
    window = int(cfg.get("sliding_window") or 0)
    n = int(cfg.get("num_hidden_layers") or 0)
    if cfg.get("layer_types"):
        sliding = [t == "sliding_attention" for t in cfg["layer_types"]]
    elif family in ("qwen2", "qwen3"):
        first = int(cfg.get("max_window_layers") or 0)
        sliding = [bool(cfg.get("use_sliding_window")) and i >= first for i in range(n)]
    elif family in ("mistral", "phi3"):
        sliding = [window > 0] * n
    else:
        sliding = [False] * n
    if not any(sliding) or not window:
        return 0
    if not all(sliding):
        raise CheckpointError(f"sliding-window attention in {sum(sliding)} of {len(sliding)} layers is not supported "
                              "(one window for every layer, or none)")
    return window

def config_from_gguf(meta: Mapping[str, Any], source: str = "gguf") -> ModelConfig:
    """From GGUF metadata: `<arch>.*` keys (ggml's docs/gguf.md; the keys llama.cpp's converter writes for each
    architecture of `families.FAMILIES`). Phi-3's longrope factors are tensors, not metadata: `with_longrope` adds
    them once the file's tensors are at hand."""
    arch = meta.get("general.architecture")
    family = BY_GGUF_ARCH.get(arch)
    if family is None:
        raise CheckpointError(f"{source}: unsupported architecture {arch!r} (general.architecture); "
                              f"llamascope serves these GGUF architectures: {supported_gguf()}")

    def key(name: str, default: Any = KeyError) -> Any:
        if f"{arch}.{name}" in meta:
            return meta[f"{arch}.{name}"]
        if default is KeyError:
            raise CheckpointError(f"{source}: missing metadata key '{arch}.{name}'")
        return default

    n_heads = int(key("attention.head_count"))
    dim = int(key("embedding_length"))
    vocab = key("vocab_size", None)
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens") or [])
        if not vocab:
            raise CheckpointError(f"{source}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")
    scaling_type = key("rope.scaling.type", "none")
    scaling = RopeScaling()
    if scaling_type == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(key("rope.scaling.factor")))
    elif scaling_type == "longrope":
        pass  # the factors are tensors: `with_longrope`
    elif scaling_type not in ("none", ""):
        scaling = RopeScaling(rope_type=scaling_type)  # rejected in __post_init__ unless supported
    # Llama 3.1 scaling travels in GGUF as a `rope_freqs.weight` tensor of per-frequency divisors, not as
    # metadata: the loader applies it to the model's RoPE (model/loaders/gguf.py).
    head_dim = int(key("attention.key_length", 0) or 0)
    name = family.name
    granite = name == "granite"
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
            architecture=name,
            qkv_bias=name == "qwen2",
            qk_norm={"qwen3": "head", "olmo2": "projection"}.get(name, "none"),
            # llama.cpp's converter writes no window for Mistral (arch llama); a file that has the key gets it
            sliding_window=int(key("attention.sliding_window", 0) or 0),
            norm_placement="post" if name == "olmo2" else "pre",
            embedding_multiplier=float(key("embedding_scale", 1.0)) if granite else 1.0,
            residual_multiplier=float(key("residual_scale", 1.0)) if granite else 1.0,
            attention_multiplier=float(key("attention.scale", 0.0)) if granite else 0.0,
            logits_scaling=float(key("logit_scale", 1.0)) if granite else 1.0,
        )
    except (CheckpointError, ConfigError) as e:
        raise CheckpointError(f"{source}: {e}") from None


def with_longrope(config: ModelConfig, meta: Mapping[str, Any], long: list[float], short: list[float],
                  source: str = "gguf") -> ModelConfig:
    """Phi-3's longrope from GGUF: the `rope_factors_long` / `rope_factors_short` tensors and the
    `<arch>.rope.scaling.original_context_length` / `.attn_factor` keys the converter writes (conversion/phi.py
    `generate_extra_tensors`)."""
    arch = meta.get("general.architecture")
    original = int(meta.get(f"{arch}.rope.scaling.original_context_length") or config.max_seq_len)
    scaling = RopeScaling(rope_type="longrope", factor=config.max_seq_len / original,
                          original_max_position_embeddings=original, short_factor=tuple(short), long_factor=tuple(long),
                          attention_factor=float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0)))
    try:
        return config.replace(rope_scaling=scaling)
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from None
