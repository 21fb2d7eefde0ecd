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
