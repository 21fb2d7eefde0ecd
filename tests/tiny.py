"""A tiny random LLaMA with a byte-level tokenizer, for engine tests that need text as well as tokens."""

from __future__ import annotations

import torch

from benchmarks.tiny_checkpoint import BOS, EOS, byte_backend
from model.config import ModelConfig
from model.text.tokenizer import Tokenizer
from model.transformer import Transformer


def byte_tokenizer() -> Tokenizer:
    """256 byte tokens (GPT-2's byte-to-unicode alphabet, no merges) + <eos> 256 + <bos> 257."""
    return Tokenizer(byte_backend(), bos_id=BOS, eos_id=EOS, stop_ids={EOS}, add_bos=False)


# (name, dtype, quantization) of the precisions the engine tests run at (tests/engine/conftest.py's `precision_model`)
PRECISIONS = [("float32", torch.float32, "none"), ("bfloat16", torch.bfloat16, "none"),
              ("int8", torch.float32, "int8"), ("int4", torch.float32, "int4")]


def tiny_model(seed: int = 0, dtype=torch.float32, **overrides) -> Transformer:
    cfg = dict(vocab_size=258, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, max_seq_len=512)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**cfg))
    with torch.no_grad():  # spread-out logits so greedy choices are not near-ties
        for p in model.parameters():
            p.normal_(0, 0.3 if p.ndim > 1 else 1.0)
        model.tie_weights()
    return model.to(dtype).eval().requires_grad_(False)


def greedy_tokens(model: Transformer, prompts: list[list[int]], n: int = 10, **config) -> list[list[int]]:
    """Each prompt's first `n` greedy tokens (EOS ignored), all prompts submitted to one engine at once."""
    from model.engine import Engine, EngineConfig
    from model.engine.sampling_params import SamplingParams

    engine = Engine(model, byte_tokenizer(), EngineConfig(**{"num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 64, **config}))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.token_ids
    return [out[str(i)] for i in range(len(prompts))]


# The LLaMA-family switches (model/config.py) as tiny models turn them on: the architectures of
# model/loaders/families.py, built directly (tests/hf_checkpoints.py saves the same through transformers).
FAMILY_SWITCHES: dict[str, dict] = {
    "llama": {},
    "qwen2": dict(qkv_bias=True, rope_theta=1e6),
    "qwen3": dict(qk_norm="head", head_dim=32),
    "mistral": dict(sliding_window=8),
    "phi3": dict(max_seq_len=64, rope_scaling=__import__("model.config", fromlist=["RopeScaling"]).RopeScaling(
        "longrope", 4.0, original_max_position_embeddings=16, short_factor=tuple(1.0 + 0.1 * i for i in range(8)),
        long_factor=tuple(1.0 + 0.7 * i for i in range(8)), attention_factor=1.5 ** 0.5)),
    "granite": dict(embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.08, logits_scaling=4.0),
    "olmo2": dict(norm_placement="post", qk_norm="projection"),
}


def tiny_family(family: str, seed: int = 0, dtype=torch.float32, **overrides) -> Transformer:
    """`tiny_model` with `family`'s switches on (FAMILY_SWITCHES)."""
    return tiny_model(seed, dtype, **{**FAMILY_SWITCHES[family], **overrides})
