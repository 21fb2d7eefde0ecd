"""Decode attention over the paged KV pool on CUDA, as a Triton kernel: no per-step gather of whole sequences.

The eager CUDA path gathers each decode group's blocks into a padded (B, S) copy every layer and step, then runs
SDPA with a length mask; this kernel instead walks each sequence's block table, one program per (decode row,
query head), with the online softmax of flash attention (Dao et al. 2022; PagedAttention's decode kernel, Kwon
et al. 2023). Same contract as the native CPU kernel (`model/kernels/csrc/paged_attention.cpp`):

    q (N, H, E) packed rows (token stride free, heads contiguous); k_pool, v_pool (NB, bs, K, E); rows (R,) the
    decode rows; tables (R, W) their block ids; lens (R,) their context lengths; out (N, H, E): rows `rows` written.

It needs Triton (shipped with PyTorch's CUDA builds) and a power-of-two block size. The test suite runs it on CPU
through Triton's interpreter (`TRITON_INTERPRET=1`, tests/test_triton_attention.py) against SDPA; no GPU has run
it yet in this project (see the README's performance section).
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

try:  # Triton is optional: CPU-only installs do not have it, and the CUDA path then gathers as before
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None


def available(q: Tensor, block_size: int) -> bool:
    """Whether this kernel can serve `q`'s decode rows: Triton present, a CUDA tensor (or Triton's interpreter),
    and a power-of-two block size (Triton's ranges are powers of two)."""
    if triton is None or block_size & (block_size - 1):
        return False
    return q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, rows_ptr, tables_ptr, lens_ptr, out_ptr,
        q_stride, W, scale,
        H: tl.constexpr, K: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, BS: tl.constexpr,
    ):
        r = tl.program_id(0)
        h = tl.program_id(1)
        row = tl.load(rows_ptr + r)
        n = tl.load(lens_ptr + r)
        kh = h // (H // K)  # grouped-query attention: query head h reads KV head h / (H / K)
        offs_e = tl.arange(0, E_PAD)
        e_mask = offs_e < E
        q = tl.load(q_ptr + row * q_stride + h * E + offs_e, mask=e_mask, other=0.0).to(tl.float32) * scale  # (E,)
        offs_s = tl.arange(0, BS)
        m_i = tl.max(tl.full((BS,), float("-inf"), tl.float32), axis=0)  # running max
        l_i = tl.sum(tl.zeros((BS,), tl.float32), axis=0)  # running sum of exp
        acc = tl.zeros((E_PAD,), tl.float32)
        for b in range(0, tl.cdiv(n, BS)):
            block = tl.load(tables_ptr + r * W + b)
            s_mask = b * BS + offs_s < n
            kv = ((block * BS + offs_s) * K + kh) * E  # (BS,) offsets of this block's rows for KV head kh
            mask = s_mask[:, None] & e_mask[None, :]
            k = tl.load(k_ptr + kv[:, None] + offs_e[None, :], mask=mask, other=0.0).to(tl.float32)  # (BS, E)
            scores = tl.where(s_mask, tl.sum(k * q[None, :], axis=1), float("-inf"))  # (BS,)
            m_new = tl.maximum(m_i, tl.max(scores, axis=0))
            p = tl.exp(scores - m_new)
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + kv[:, None] + offs_e[None, :], mask=mask, other=0.0).to(tl.float32)  # (BS, E)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        out = acc / l_i
        tl.store(out_ptr + (row * H + h) * E + offs_e, out.to(out_ptr.dtype.element_ty), mask=e_mask)


def paged_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, rows: Tensor, tables: Tensor, lens: Tensor,
                           out: Tensor) -> None:
    N, H, E = q.shape
    _, bs, K, _ = k_pool.shape
    if q.stride(-1) != 1 or q.stride(-2) != E or not (k_pool.is_contiguous() and v_pool.is_contiguous() and out.is_contiguous()):
        raise ValueError("paged_decode_attention: heads of q, the pools and out must be contiguous")
    R, W = tables.shape
    if R == 0:
        return
    _paged_decode_kernel[(R, H)](
        q, k_pool, v_pool, rows, tables, lens, out,
        q.stride(0), W, 1.0 / math.sqrt(E),
        H=H, K=K, E=E, E_PAD=triton.next_power_of_2(E), BS=bs,
    )
