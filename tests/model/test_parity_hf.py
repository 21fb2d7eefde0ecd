"""Our block stack vs transformers' LlamaForCausalLM on the same random weights (float32, max abs diff <= 1e-4)."""

from __future__ import annotations

import pytest
import torch

from hf_checkpoints import save_tiny_llama
from model.kv_cache import KVCache
from model.loaders.hf import load_hf

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

CONFIGS = {
    "mha-untied-theta1e4": dict(num_attention_heads=4, num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    "gqa-tied-theta1e4": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    "mqa-untied-llama3": dict(num_attention_heads=4, num_key_value_heads=1, rope_parameters=LLAMA3_ROPE),
    "gqa-tied-llama3-3layers": dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=128, num_hidden_layers=3,
                                    tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    "gqa-linear-scaling": dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}),
    "explicit-head-dim": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}


def _prompts(vocab: int, batch: int = 3, length: int = 19) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, length), generator=g)  # (B, T)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    hf = save_tiny_llama(tmp_path, **CONFIGS[name])
    ours = load_hf(tmp_path)
    tokens = _prompts(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens)
        # RoPE sees only relative distance, so spread the positions out (gaps of 211, distances up to ~4000):
        # that turns the low frequencies, where llama3 / linear scaling act, which short prompts barely move.
        pos = (torch.arange(tokens.shape[1]) * 211).expand_as(tokens)
        ref_far = hf(tokens, position_ids=pos).logits
        got_far = ours(tokens, pos)
    assert ref.abs().max() > 1.0  # logits are not trivially small
    assert (got - ref).abs().max().item() <= 1e-4
    assert (got_far - ref_far).abs().max().item() <= 1e-4
    assert (ref - ref_far).abs().max().item() > 1e-2  # positions matter, so the check above means something


def test_sharded_checkpoint_loads_and_matches(tmp_path):
    hf = save_tiny_llama(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ours = load_hf(tmp_path)
    tokens = _prompts(hf.config.vocab_size)
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


def test_kv_cache_matches_full_forward(tmp_path):
    """Prefill in two chunks then decode one token at a time == one uncached forward over the whole sequence."""
    save_tiny_llama(tmp_path, num_key_value_heads=1)
    ours = load_hf(tmp_path)
    tokens = _prompts(ours.config.vocab_size, batch=2, length=16)
    pos = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        full = ours(tokens)
        cache = KVCache.for_model(ours, batch_size=2, max_seq_len=32)
        parts = [ours(tokens[:, :5], pos[:, :5], cache), ours(tokens[:, 5:11], pos[:, 5:11], cache)]
        parts += [ours(tokens[:, t : t + 1], pos[:, t : t + 1], cache) for t in range(11, 16)]
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= 1e-4


def test_batch_rows_are_independent(tmp_path):
    save_tiny_llama(tmp_path)
    ours = load_hf(tmp_path)
    tokens = _prompts(ours.config.vocab_size, batch=3)
    with torch.no_grad():
        batched = ours(tokens)
        single = torch.cat([ours(tokens[i : i + 1]) for i in range(3)])
    assert (batched - single).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 0.15), (torch.float16, 0.02)])
def test_half_precision_dtypes(tmp_path, dtype, tol):
    """bfloat16 / float16 weights and activations track float32 within their precision (relative to logit scale)."""
    hf = save_tiny_llama(tmp_path)
    ours = load_hf(tmp_path, dtype=dtype)
    assert all(p.dtype == dtype for p in ours.parameters())
    tokens = _prompts(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens)
    assert got.dtype == dtype
    assert ((got.float() - ref).abs().max() / ref.abs().max()).item() <= tol
    assert (got.float().argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(tmp_path):
    hf = save_tiny_llama(tmp_path)
    ours = load_hf(tmp_path, device="cuda")
    tokens = _prompts(hf.config.vocab_size)
    with torch.no_grad():
        assert (ours(tokens.cuda()).cpu() - hf(tokens).logits).abs().max().item() <= 1e-3


def test_fused_projections_stack_the_checkpoints_parts(tmp_path):
    """One matmul for q/k/v and one for gate/up (gpt-fast's `wqkv`): the loader stacks the checkpoint's parts, in
    order, into the fused weight (the logits tests above prove the math; this pins the layout)."""
    hf = save_tiny_llama(tmp_path)
    ours = load_hf(tmp_path)
    for a, b in zip(ours.layers, hf.model.layers):
        att, mlp = b.self_attn, b.mlp
        assert torch.equal(a.attention.wqkv.weight, torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]))
        assert torch.equal(a.feed_forward.w13.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
