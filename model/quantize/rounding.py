"""Float weights and activations rounded to the quantized formats' blocks: weights as ggml rounds them for Q8_0 and
Q4_1 (`int8_blocks`, `int4_groups`, a bounded piece of the matrix at a time: `by_rows`), activations as the native
kernels round them before their integer dot products (`round_activations`, for references in tests and probes)."""

from __future__ import annotations

import torch
from torch import Tensor

from model.quantize.layouts import GROUP_SIZE


def round_activations(x: Tensor, block: int = GROUP_SIZE) -> Tensor:
    """x (M, K) float32 -> x rounded as the native kernels round it before their integer dot products: int8 in
    blocks of `block` along K, d = max|x| / 127 per block, ties to even: 32 (ggml's `quantize_row_q8_0`) for int8 and
    int4 layers, 256 for int4 in Q4_K's own scales and for int6 (`quantize_row_q8_K`, the span of the weights' own d;
    a last partial block of K % 256 takes its own scale)."""
    M, K = x.shape
    pad = -K % block
    b = torch.nn.functional.pad(x, (0, pad)).reshape(M, -1, block)
    d = b.abs().amax(-1, keepdim=True) / 127  # (M, K/block, 1)
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(b * inv) * d).reshape(M, -1)[:, :K]


CHUNK_ELEMENTS = 1 << 22  # weights rounded at a time: a few float32 temporaries of 16 MB, whatever the matrix


def by_rows(rounding, w: Tensor) -> tuple[Tensor, ...]:
    """`rounding` (int8_blocks / int4_groups) applied to `CHUNK_ELEMENTS` of w (N, K) at a time, the pieces joined:
    the same arrays as one call, without float32 temporaries the size of the matrix (a 128k x 4k embedding in
    bfloat16 would need 2 GB per temporary)."""
    step = max(1, CHUNK_ELEMENTS // w.shape[1])
    parts = [rounding(w[a : a + step]) for a in range(0, w.shape[0], step)]
    return tuple(torch.cat(p) if len(p) > 1 else p[0] for p in zip(*parts))


def int8_blocks(w: Tensor) -> tuple[Tensor, Tensor]:
    """w (N, K) -> q (N, K) int8, d (N, K/32) float32: ggml's `quantize_row_q8_0_ref`, per block d = max|w| / 127,
    q = round(w / d) (half away from zero)."""
    w = w.detach().float()
    N, K = w.shape
    g = w.reshape(N, K // GROUP_SIZE, GROUP_SIZE)
    d = g.abs().amax(-1) / 127  # (N, K/G)
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    x = g * inv[..., None]
    q = (x.sign() * (x.abs() + 0.5).floor()).clamp(-127, 127)
    return q.reshape(N, K).to(torch.int8), d


def int4_groups(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """w (N, K) -> q (N, K) uint8 in [0, 15], d and m (N, K/32) float32: asymmetric min/max rounding per group of 32
    (gpt-fast's `group_quantize_tensor`, 4 bits; GGUF's Q4_1), d and m rounded to float16 as the layer keeps them."""
    w = w.detach().float()
    N, K = w.shape
    g = w.reshape(N, K // GROUP_SIZE, GROUP_SIZE)
    lo, hi = g.amin(-1), g.amax(-1)  # (N, K/G)
    d = ((hi - lo) / 15).clamp(min=1e-6).half().float()
    m = lo.half().float()
    q = torch.round((g - m[..., None]) / d[..., None]).clamp(0, 15)
    return q.reshape(N, K).to(torch.uint8), d, m
