"""The int8 KV cache's rows (`--kv-cache-dtype int8`), in PyTorch: what the native kernels write and read, for the
paths without them (the module path's writes on a device, the reference attention, SDPA over a prefill chunk's
gathered blocks, the context shift's re-rotation).

Each head's row of one token (E values of K or V) is stored as E int8 quants followed by the 4 bytes of its float32
scale: a pool row of E + 4 int8 (`row_width`). That is llama.cpp's q8_0 (ggml-common.h `block_q8_0`: a scale beside
its 32 quants; ggml-quants.c `quantize_row_q8_0_ref`) with one block per head row: the same bytes per value at E = 64
(68 per 64 values) and one scale per key, so a score is one dot product times one scale (the native kernel,
model/kernels/csrc/paged_attention.cpp, and the Triton kernel apply it so). A scale per token and head is written
with its token and never changes, so appending to a block, sharing a cached prefix block or dropping rejected
drafts touches no other token's numbers (a scale per block would have to be recomputed as the block fills).

    d = max|x| * float32(1 / 127)        q = round_half_even(x / d) in [-127, 127]        x' = q * d

The native writer (`store_kv_row`) computes the same floats in the same order, so both store the same bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

SCALE_BYTES = 4  # a float32 scale after each row's quants
_INV_127 = 1.0 / 127.0  # torch multiplies a float32 tensor by it as float32(1 / 127), as the native writer does


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The pool's last dimension for heads of `head_dim`: E, or E + 4 for an int8 cache."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize(x: Tensor) -> Tensor:  # (..., E) float -> (..., E + 4) int8
    xf = x.float()
    d = xf.abs().amax(-1, keepdim=True) * _INV_127  # (..., 1)
    q = torch.where(d > 0, xf / d, torch.zeros_like(xf)).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([q, d.view(torch.int8)], dim=-1)  # d (..., 1) float32 -> its 4 bytes (..., 4)


def scales(rows: Tensor) -> Tensor:  # (..., E + 4) int8 -> (..., 1) float32
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)


def dequantize(rows: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:  # (..., E + 4) int8 -> (..., E)
    return (rows[..., :-SCALE_BYTES].float() * scales(rows)).to(dtype)


def read(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """Pool rows (..., row_width) as `dtype` values (..., E): an int8 cache's dequantized, a float cache's widened."""
    return dequantize(rows, dtype) if rows.dtype == torch.int8 else rows.to(dtype)


def as_stored(x: Tensor, pool_dtype: torch.dtype) -> Tensor:
    """x (..., E) as a cache of `pool_dtype` would give it back, in x's dtype (a prefill chunk attending to its own
    fresh keys and values reads what the cache holds)."""
    if pool_dtype == torch.int8:
        return dequantize(quantize(x), x.dtype)
    return x.to(pool_dtype).to(x.dtype)
