"""The int8 KV cache's blocks (`--kv-cache-dtype int8`), in PyTorch: what the native kernels write and read, for the
paths without them (the module path's writes on a device, the reference attention, SDPA over a prefill chunk's
gathered blocks, the context shift's re-rotation).

Each head's row of one token (E values of K or V) is stored as E int8 quants and the float32 scale they share: E + 4
bytes, so a pool is (NB, bs, K, E + 4) int8 (`row_width`). That is llama.cpp's q8_0 (ggml-common.h `block_q8_0`: a
scale with its 32 quants; ggml-quants.c `quantize_row_q8_0_ref`) with one scale per head row: the same bytes per value
at E = 64 (68 per 64 values) and one scale per key, so a score is one dot product times the key's scale and the
query's (`round_query`; model/kernels/csrc/paged_attention.cpp and the Triton kernels). A scale per token and head
is written with its token and never changes, so appending to a block, sharing a cached prefix block or dropping
rejected drafts touches no other token's numbers (a scale per block would have to be recomputed as the block fills).

Within a block the bs * K rows' quants come first, then their bs * K scales, both (head, position)-ordered (`parts`;
ops.h `kv_slot` in C++), rather than each scale beside its quants: a row of 64 quants is then one aligned cache line,
where a 68-byte row at 68-byte offsets straddled two lines more often than not; and a decode row's walk over one KV
head's positions reads that head's bs rows as one run of bs * E bytes and its bs scales as another, where
(position, head)-ordered rows put each line it read K * E bytes from the last, the other heads' between them. So a
block, not a row, is the unit to quantize or read here (`pack`, `read`, `read_blocks`), and slots are written and
read through `write_slots` / `read_slots`.

    d = max|x| * float32(1 / 127)        q = round_half_even(x / d) in [-127, 127]        x' = q * d

The native writer (`store_kv_row`) computes the same floats in the same order, so both store the same bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

SCALE_BYTES = 4  # a float32 scale for each row's quants
_INV_127 = 1.0 / 127.0  # torch multiplies a float32 tensor by it as float32(1 / 127), as the native writer does


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The pool's last dimension for heads of `head_dim`: E, or E + 4 for an int8 cache."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:  # (..., E) float -> quants (..., E) int8, scales (..., 1) float32
    xf = x.float()
    d = xf.abs().amax(-1, keepdim=True) * _INV_127  # (..., 1)
    q = torch.where(d > 0, xf / d, torch.zeros_like(xf)).round().clamp(-127, 127).to(torch.int8)
    return q, d


def dequantize(q: Tensor, d: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:  # (..., E), (..., 1) -> (..., E)
    return (q.float() * d).to(dtype)


def round_query(q: Tensor, scale: float = 0.0) -> Tensor:
    """Queries q (..., E) over an int8 cache, times the attention scale (0: 1/sqrt(E)) and rounded to int8 per head
    row as the keys are (`quantize`), back in float32 (..., E): attention with scale 1 over these and the dequantized
    keys is what the native kernel computes, whose scores are integer products of the quants times the two scales
    (model/kernels/csrc/paged_attention.cpp's `QuantizedQueries`, as llama.cpp scores a q8_0 cache)."""
    # float32's 1 / sqrt(E), as the kernel computes it (a Python number: no copy to the device, which a CUDA graph's
    # capture would refuse); a float32 tensor times a Python number is computed in float32
    s = scale or torch.tensor(float(q.shape[-1])).sqrt().reciprocal().item()
    return dequantize(*quantize(q.float() * s))


def parts(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Int8 blocks (..., bs, K, E + 4), contiguous in their last three dimensions -> views of their quants
    (..., bs, K, E) and their scales (..., bs, K, 1) float32 (both stored head by head: views with strides); writing
    to a view writes the blocks."""
    *lead, bs, K, width = blocks.shape
    E, n = width - SCALE_BYTES, bs * K * (width - SCALE_BYTES)
    flat = blocks.view(*lead, bs * K * width)
    quants = flat[..., :n].view(*lead, K, bs, E).transpose(-2, -3)  # (..., bs, K, E)
    scales = flat[..., n:].view(torch.float32).view(*lead, K, bs).transpose(-1, -2)  # (..., bs, K)
    return quants, scales.unsqueeze(-1)


def views(pool: Tensor) -> tuple[Tensor, ...]:
    """A pool's (..., NB, bs, K, width) parts that a position's row has one slice of: the pool itself for a float
    cache; an int8 cache's quants and scales (`parts`). Copying a position's slice of each copies its row."""
    return parts(pool) if pool.dtype == torch.int8 else (pool,)


def pack(x: Tensor) -> Tensor:  # (..., bs, K, E) float -> int8 blocks (..., bs, K, E + 4)
    *lead, bs, K, E = x.shape
    out = torch.empty(*lead, bs, K, E + SCALE_BYTES, dtype=torch.int8, device=x.device)
    q, d = parts(out)
    q[...], d[...] = quantize(x)
    return out


def read(blocks: Tensor, dtype: torch.dtype) -> Tensor:
    """Pool blocks (..., bs, K, row_width) as `dtype` values (..., bs, K, E): an int8 cache's dequantized, a float
    cache's widened."""
    if blocks.dtype == torch.int8:
        return dequantize(*parts(blocks), dtype).contiguous()  # (stored head by head: the values in position order)
    return blocks.to(dtype)


def read_blocks(pool: Tensor, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """Blocks `ids` (n,) of pool (NB, bs, K, row_width), gathered, as `dtype` values of their positions
    (n * bs, K, E)."""
    blocks = read(pool.index_select(0, ids), dtype)  # (n, bs, K, E)
    return blocks.view(-1, *blocks.shape[-2:])


def _slot_index(pool: Tensor, slots: Tensor) -> tuple:
    """Slots (n,) (block * bs + offset) as an index of pool (..., NB, bs, K, width) or of its `parts`."""
    bs = pool.shape[-3]
    return ..., slots // bs, slots % bs, slice(None), slice(None)


def write_slots(pool: Tensor, slots: Tensor, x: Tensor) -> None:
    """x (..., n, K, E) into slots (n,) (block * bs + offset) of pool (..., NB, bs, K, row_width): rounded once to a
    16-bit cache, quantized to an int8 one."""
    at = _slot_index(pool, slots)
    if pool.dtype == torch.int8:
        q, d = parts(pool)
        q[at], d[at] = quantize(x)
    else:
        pool[at] = x.to(pool.dtype)


def read_slots(pool: Tensor, slots: Tensor, dtype: torch.dtype) -> Tensor:
    """Slots (n,) of pool (..., NB, bs, K, row_width) as `dtype` values (..., n, K, E)."""
    at = _slot_index(pool, slots)
    if pool.dtype == torch.int8:
        q, d = parts(pool)
        return dequantize(q[at], d[at], dtype)
    return pool[at].to(dtype)


def as_stored(x: Tensor, pool_dtype: torch.dtype) -> Tensor:
    """x (..., E) as a cache of `pool_dtype` would give it back, in x's dtype (a prefill chunk attending to its own
    fresh keys and values reads what the cache holds)."""
    if pool_dtype == torch.int8:
        return dequantize(*quantize(x), x.dtype)
    return x.to(pool_dtype).to(x.dtype)
