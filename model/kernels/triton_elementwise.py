"""The elementwise steps of a block on CUDA as single Triton kernels: RMSNorm, SiLU-mul, and RoPE on q and k.

PyTorch runs each of these as a chain of kernels (RMSNorm: square, mean, rsqrt, two products and the casts between
them; RoPE: the half swap, two products and a sum, for q and k each), every one a launch and a pass over memory.
Each function here is one launch and one pass, with the same float32 arithmetic as `model/kernels/ops.py`'s
reference (statistics in float32, the gain after the cast back to the activation dtype, as Meta and HF do). They
matter where a step is not a CUDA graph (prefill and mixed steps: one launch a block instead of several), and for
the memory passes inside a graph.

`ops` dispatches to them on CUDA tensors only when `ops.fused_elementwise(True)` is set: their speed against
PyTorch's chains has not been measured on a GPU yet (benchmarks/gpu.py measures the eager engine with and without
them); until it has, the default is PyTorch's. The test suite runs them through Triton's interpreter
(tests/triton_interpret_check.py) against the references.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - where triton is absent the ops keep PyTorch's chains
    triton = None


if triton is not None:

    # Every value is loaded as float32 and rounded to the activation dtype exactly where PyTorch's chain rounds it
    # (a product of two 16-bit values is exact in float32, so rounding it once is the 16-bit product).

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, x_stride, out_stride, eps, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        x = tl.load(x_ptr + r * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        y = (x * inv).to(dt).to(tl.float32) * w  # cast back before the gain (Meta, HF)
        tl.store(out_ptr + r * out_stride + offs, y.to(dt), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, F, x_stride, out_stride, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = c < F
        gate = tl.load(x_ptr + r * x_stride + c, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + r * x_stride + F + c, mask=mask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        y = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up  # F.silu in the activation dtype, then *
        tl.store(out_ptr + r * out_stride + c, y.to(dt), mask=mask)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, x_tok_stride, n_rot, HALF: tl.constexpr, BLOCK: tl.constexpr):
        # one program per (token, head): x[h] = x * cos + swap_halves(x) * signed_sin, in place
        t = tl.program_id(0)
        h = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        base = x_ptr + t * x_tok_stride + h * 2 * HALF
        dt = x_ptr.dtype.element_ty
        x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        row = t * 2 * HALF
        c1 = tl.load(cos_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        # the reference's two products and sum, each rounded to the activation dtype as PyTorch's ops round them
        y1 = (x1 * c1).to(dt).to(tl.float32) + (x2 * s1).to(dt).to(tl.float32)
        y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        tl.store(base + offs, y1.to(dt), mask=mask)
        tl.store(base + HALF + offs, y2.to(dt), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:  # (..., D) -> (..., D)
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=weight.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, D, x2.stride(0), out.stride(0), eps,
                                         BLOCK=triton.next_power_of_2(D))
    return out.view(*x.shape[:-1], D)


def silu_mul(gate_up: Tensor) -> Tensor:  # (..., 2F) -> (..., F)
    F2 = gate_up.shape[-1]
    x2 = gate_up.reshape(-1, F2)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    F = F2 // 2
    out = torch.empty(x2.shape[0], F, dtype=gate_up.dtype, device=gate_up.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(F))
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(F, block))](x2, out, F, x2.stride(0), out.stride(0), BLOCK=block)
    return out.view(*gate_up.shape[:-1], F)


def rope_(x: Tensor, cos: Tensor, signed_sin: Tensor, n_rot: int) -> Tensor:
    """x (B, T, heads, E), heads contiguous: its first n_rot heads rotated in place by cos / signed sin
    (B, T, 1, E) in x's dtype (`transformer.rotary_tables`); returns x."""
    B, T, _, E = x.shape
    if x.stride(-1) != 1 or x.stride(-2) != E or x.stride(0) != T * x.stride(1):
        raise ValueError("rope_: x's heads must be contiguous within a token and tokens evenly spaced")
    cos, signed_sin = cos.reshape(B * T, E).contiguous(), signed_sin.reshape(B * T, E).contiguous()
    if B * T and n_rot:
        _rope_kernel[(B * T, n_rot)](x, cos, signed_sin, x.stride(1), n_rot, HALF=E // 2,
                                     BLOCK=triton.next_power_of_2(E // 2))
    return x
