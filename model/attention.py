"""Attention over this call's keys only (no cache), and the SDPA call every attention path shares.

An attention context turns one layer's q, k, v into attention output, and may edit a block's outputs
(`edit`: interventions, model/interventions.py). Three implement `attend`:
`CausalAttention` (here: keys are the call's own tokens), `kv_cache.KVCache` (contiguous per-row cache, for
`model.generate`) and `model.engine.paged_cache.PagedKVCache` (the engine's block pool, ragged batches).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class AttentionContext(Protocol):
    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (B, T, H, E), k/v (B, T, K, E) of this call's tokens (RoPE applied) -> (B, T, H, E)."""
        ...

    def edit(self, layer: int, site: str, x: Tensor) -> Tensor:
        """Block `layer`'s activation at `site` ("attention_output", "mlp_output" before their residual adds,
        "resid_mid" between them, "mlp_input" the feed-forward's input, "block_output" after the block), x (B, T, D)
        -> the same, edited (model/interventions.py) or as it is.
        Inside the attention module, per head: "head_q", "head_k", "head_v" (B, T, H | K | K, E), views of the
        fused projection before RoPE, edited in place (the return value is not used), and "head_output" (B, T, H, E),
        the heads' outputs before wo."""
        ...

    def adapt(self, layer: int, site: str, x: Tensor, y: Tensor) -> Tensor:
        """Block `layer`'s projection at `site` ("qkv", "o", "w13", "w2"), its input x (B, T, in) and output y
        (B, T, out) -> y with the changes of the per-row features its rows carry (`Part.adapt`,
        model/features/protocol.py: an adapter's deltas), or y as it is."""
        ...


class KVCacheContext(AttentionContext, Protocol):
    def begin_forward(self, positions: Tensor) -> None:
        """Called once per forward with positions (B, T), before any layer's `attend`."""
        ...


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, is_causal: bool = False,
         scale: float = 0.0) -> Tensor:
    """q (B, T, H, E), k/v (B, S, K, E), mask (B, 1, T, S) bool (True = attend) -> (B, T, H, E).

    Scaled dot-product attention (Vaswani et al. 2017), softmax(q k^T / sqrt(E)) v, or softmax(scale q k^T) v for a
    `scale` other than 0 (Granite's attention multiplier). SDPA picks flash / memory-efficient kernels where it can and
    shares each KV head across its H/K query heads without copying (grouped-query attention, `enable_gqa`).
    """
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, is_causal=is_causal, enable_gqa=q.shape[2] != k.shape[2], scale=scale or None,
    )  # (B, H, T, E)
    return out.transpose(1, 2)


def causal_mask(q_pos: Tensor, k_pos: Tensor, window: int = 0) -> Tensor:
    """q_pos (..., T), k_pos (..., S) -> (..., T, S) bool: key positions <= the query's, and with a sliding `window`
    (Mistral; transformers' `sliding_window_overlay`) > the query's - window, so a query sees `window` keys."""
    mask = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
    if window:
        mask &= k_pos.unsqueeze(-2) > q_pos.unsqueeze(-1) - window
    return mask


class CausalAttention:
    """Keys are this call's tokens: the query at position p sees keys at positions <= p (and > p - window)."""

    def __init__(self, positions: Tensor | None, window: int = 0, scale: float = 0.0) -> None:
        # positions None means 0..T-1 in every row: SDPA's causal fast path, no mask tensor (unless windowed).
        self.positions, self.window, self.scale = positions, window, scale
        self.mask = None if positions is None else causal_mask(positions, positions, window).unsqueeze(1)  # (B, 1, T, T)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.mask is None and self.window and q.shape[1] > self.window:
            pos = torch.arange(q.shape[1], device=q.device)
            self.mask = causal_mask(pos, pos, self.window)[None, None]  # (1, 1, T, T)
        return sdpa(q, k, v, self.mask, is_causal=self.mask is None, scale=self.scale)

    def edit(self, layer: int, site: str, x: Tensor) -> Tensor:
        return x

    def adapt(self, layer: int, site: str, x: Tensor, y: Tensor) -> Tensor:
        return y
