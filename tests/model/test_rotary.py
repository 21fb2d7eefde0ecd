"""The prepared-table RoPE the forward uses equals the reference rotate-half formula."""

from __future__ import annotations

import torch

from model.config import ModelConfig
from model.transformer import RotaryEmbedding, apply_rotary, apply_rotary_tables, rotary_tables


def test_prepared_tables_equal_rotate_half():
    rope = RotaryEmbedding(ModelConfig(vocab_size=8, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64))
    positions = torch.tensor([[0, 5, 17, 300], [1, 2, 3, 4]])  # (B, T)
    cos, sin = rope(positions)
    x = torch.randn(2, 4, 6, 16)[:, :, :5]  # (B, T, heads, E), non-contiguous like the fused q/k slice
    for dtype in (torch.float32, torch.bfloat16):
        got = apply_rotary_tables(x.to(dtype), *rotary_tables(cos, sin, dtype))
        torch.testing.assert_close(got, apply_rotary(x.to(dtype), cos, sin), rtol=0, atol=0 if dtype == torch.float32 else 1e-2)
