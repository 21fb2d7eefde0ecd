"""Tiny random HF LLaMA checkpoints written to disk, the way users' checkpoints arrive (config.json + safetensors),
for the loader, parity and tensor-parallel tests; HF transformers writes them (a test dependency only)."""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_llama_config(**overrides):
    """A transformers LlamaConfig small enough for CPU tests; overrides take HF names."""
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def save_tiny_llama(directory: Path, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Random-weight LlamaForCausalLM saved as safetensors in `directory`; returns the HF model (float32, eval)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides)).eval()
    with torch.no_grad():  # HF init gives ~N(0, 0.02): too flat to tell a wrong attention from a right one
        for p in model.parameters():
            p.normal_(0, 0.3 if p.ndim > 1 else 1.0)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return model


def save_tiny_checkpoint(directory: Path, **overrides) -> Path:
    """A random HF LLaMA (`save_tiny_llama`) with the byte-level tokenizer (258 ids) beside it, servable by path."""
    save_tiny_llama(directory, vocab_size=258, **overrides)
    from tiny import byte_tokenizer

    byte_tokenizer()._tk.save(str(directory / "tokenizer.json"))
    return directory


# Tiny random checkpoints of each LLaMA-family architecture llamascope serves (model/loaders/families.py), saved by
# transformers' own <Family>ForCausalLM: each turns its switches on in a way a wrong implementation cannot pass
# (explicit head_dim unlike hidden / heads, a window shorter than the test prompts, longrope past its original
# context, multipliers far from 1).
WINDOW = 8  # Mistral's sliding window in the tests: shorter than their prompts (19 tokens and more)
FAMILY_CONFIGS: dict[str, dict] = {
    "qwen2": dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen3": dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "mistral": dict(sliding_window=WINDOW, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # longrope past its original context of 16 (a served context of 64: an attention factor of sqrt(1.5))
    "phi3": dict(original_max_position_embeddings=16, max_position_embeddings=64, pad_token_id=0,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 16}),
    "granite": dict(embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.08, logits_scaling=4.0),
    "olmo2": dict(),
}
FAMILIES = list(FAMILY_CONFIGS)


def family_config(family: str, **overrides):
    """transformers' config of a tiny `family` model (the sizes of `tiny_llama_config`); overrides take HF names."""
    import transformers

    cls = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig", "phi3": "Phi3Config",
           "granite": "GraniteConfig", "olmo2": "Olmo2Config"}[family]
    kw = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kw.update(FAMILY_CONFIGS[family])
    kw.update(overrides)
    if family == "phi3":  # longrope's factors, one per frequency (head_dim / 2 of them)
        half = (kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"]) // 2
        kw["rope_parameters"] = {**kw["rope_parameters"], "short_factor": [1.0 + 0.1 * i * 8 / half for i in range(half)],
                                 "long_factor": [1.0 + 0.7 * i * 8 / half for i in range(half)]}
    return getattr(transformers, cls)(**kw)


def save_tiny_family(directory: Path, family: str, seed: int = 0, weight_std: float = 0.3, **overrides):
    """A random-weight `family` model saved by its own transformers class (safetensors + config.json) in `directory`;
    returns the HF model (float32, eval). Every parameter random, norms and biases included (a norm of ones or a zero
    bias would hide a missing one); matrices of std `weight_std` (wider models need less to stay out of chaos)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # (biases smaller: Qwen2's q/k biases add a q_b k_b term to every score)
            p.normal_(0, weight_std if p.ndim > 1 else 0.1 if name.endswith(".bias") else 1.0)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def save_tiny_family_checkpoint(directory: Path, family: str, seed: int = 0, **overrides) -> Path:
    """`save_tiny_family` with the byte-level tokenizer (258 ids) beside it, servable by path."""
    save_tiny_family(directory, family, seed, vocab_size=258, **overrides)
    from tiny import byte_tokenizer

    byte_tokenizer()._tk.save(str(directory / "tokenizer.json"))
    return directory
