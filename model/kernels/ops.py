"""One dispatch point per op (vLLM's `CustomOp`: forward_native / forward_cpu / forward_cuda behind one call).

Each function below picks, for the tensors it is given, the native C++ kernel (CPU, float32/bfloat16, built), the
Triton kernel (CUDA) or the PyTorch implementation, and the caller never knows which. The PyTorch implementations
are the references the tests compare the kernels with (`kernels.disabled()` runs them everywhere). Notation as in
model/transformer.py; N packed tokens, R rows attending over the pool, W block-table width, NB pool blocks, bs block size.

    rms_norm          (..., D)                      Zhang & Sennrich 2019
    silu_mul          (..., 2F) -> (..., F)         SwiGLU's gate, Shazeer 2020
    rope_             (B, T, heads, E) in place     RoPE, rotate-half layout
    linear            (..., in) @ float W           one reduction order per output for any row count (native)
    quantized_linear  (M, in) @ int8 / int6 / int4 W  integer block dot products, any row count (native)
    paged_write       k, v (N, K, E) -> pool slots (an int8 cache's rows quantized: kv_int8.py)
    greedy_pick       logits (B, V) -> (B,)           torch.argmax of nan_to_num(logits, nan=-inf)
    decode_attention  q (N, H, E) rows over their block tables (PagedAttention's decode, Kwon et al. 2023),
                      optionally recording attention telemetry (attention_telemetry.py)
    prefill_attention a step's prefill chunks over their block tables in one launch (Triton, on CUDA)
"""

from __future__ import annotations

import os
import sys
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from model.attention import sdpa
from model.kernels import attention_telemetry, kv_int8, usable
from model.kernels import native as native_kernels
from model.kernels.attention_telemetry import AttentionTelemetry

KERNEL_DTYPE = torch.bfloat16  # activations, scales and zeros as PyTorch's packed CPU kernel takes them fastest


class QuantLinear(Protocol):
    """What these ops read of a weight-only quantized layer (model/quantize/'s modules); a Protocol, so the kernels
    do not import the modules that call them."""

    out_features: int
    native_op: str  # the native kernel's name: "int8_linear" / "int4_linear"

    def native_buffers(self) -> list[Tensor] | None: ...

    def kernel_row_limit(self, native: bool) -> float: ...

    def packed_matmul(self, x: Tensor) -> Tensor: ...

    def reference_dequantize(self, dtype: torch.dtype) -> Tensor: ...

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor: ...


_fused_elementwise = False


def fused_elementwise(on: bool | None = None) -> bool:
    """Whether RMSNorm, SiLU-mul and RoPE run as single Triton kernels on CUDA tensors (triton_elementwise.py);
    `on` sets it. Off by default until measured on a GPU (benchmarks/gpu.py measures both)."""
    global _fused_elementwise
    if on is not None:
        _fused_elementwise = on
    return _fused_elementwise


def _elementwise(x: Tensor):
    """triton_elementwise where it serves x: CUDA, switched on, Triton present."""
    if not (_fused_elementwise and x.is_cuda):
        return None
    from model.kernels import triton_elementwise

    return triton_elementwise if triton_elementwise.triton is not None else None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:  # (..., D) -> (..., D)
    native = usable(x, weight)
    if native is not None and x.dtype == weight.dtype:
        return native.rms_norm(x.contiguous(), weight, eps)  # the same math in one pass per row
    fused = _elementwise(x)
    if fused is not None and x.dtype == weight.dtype:
        return fused.rms_norm(x, weight, eps)
    # Statistics in float32 whatever the activation dtype, cast back before the gain (as Meta and HF do).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul(gate_up: Tensor) -> Tensor:  # (..., 2F) -> (..., F): silu(gate) * up
    native = usable(gate_up)
    if native is not None:
        return native.silu_mul(gate_up)
    fused = _elementwise(gate_up)
    if fused is not None:
        return fused.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary_tables(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x (B, T, n, E) rotated by `transformer.rotary_tables`' cos and signed sin (B, T, 1, E): x * cos +
    swap_halves(x) * signed_sin, which is x * cos + rotate_half(x) * sin (rotate-half layout) in four ops."""
    B, T, n, E = x.shape
    swapped = x.reshape(B, T, n, 2, E // 2).flip(3).reshape(B, T, n, E)  # (x2, x1)
    return x * cos + swapped * signed_sin


def rope_(x: Tensor, cos: Tensor, signed_sin: Tensor, n_rot: int) -> Tensor:
    """Rotate the first `n_rot` heads of x (B, T, heads, E) in place (`apply_rotary_tables`); returns x."""
    native = usable(x, cos)
    if native is not None and cos.dtype == x.dtype and x.is_contiguous() and cos.is_contiguous() and signed_sin.is_contiguous():
        native.rope_(x, cos, signed_sin, n_rot)  # one pass over q and k heads
        return x
    fused = _elementwise(x)
    if fused is not None and cos.dtype == x.dtype and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        return fused.rope_(x, cos, signed_sin, n_rot)
    x[:, :, :n_rot] = apply_rotary_tables(x[:, :, :n_rot], cos, signed_sin)
    return x


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x (..., in) @ weight (out, in)^T -> (..., out) for a float weight: natively with one reduction order per output
    whatever the number of rows (model/kernels/csrc/float_linear.cpp: batch invariance), else `F.linear`."""
    native = usable(x, weight)
    if native is not None and x.dtype == weight.dtype and weight.is_contiguous():
        y = native.float_linear(x.reshape(-1, x.shape[-1]).contiguous(), weight)  # (M, out)
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def linear_argmax(x: Tensor, weight: Tensor) -> Tensor | None:
    """x (M, in), a float32 weight (out, in) -> (M,) int64: `greedy_pick(linear(x, weight))`, natively without forming
    the (M, out) product (csrc/float_linear.cpp: an LM head's logits are most of its cost to write and read back).
    None where that kernel does not apply (no native kernels, not float32): then the caller forms the logits."""
    native = usable(x, weight)
    if native is None or x.dtype != torch.float32 or weight.dtype != torch.float32 or not weight.is_contiguous():
        return None
    return native.float_linear_argmax(x.contiguous(), weight)


def lora_expand(t: Tensor, bt: Tensor) -> Tensor:
    """t (n, r) @ bt (r, out) -> (n, out) float32: LoRA's expanding product (B stored transposed), each output summed
    over r in order by fused multiply-adds whatever the number of rows (csrc/lora.cpp), else one float32 matmul."""
    native = usable(t, bt)
    if native is not None and t.dtype == bt.dtype and bt.is_contiguous():
        return native.lora_expand(t.contiguous(), bt)
    return t.float() @ bt.float()


def quantized_linear(layer: "QuantLinear", x: Tensor) -> Tensor:
    """x (M, in) -> (M, out) in x's dtype through a weight-only quantized layer.

    Native: one kernel for any number of rows (activations rounded to int8 blocks, exact integer block sums,
    llama.cpp's scheme), so a row's result does not depend on how many rows share its step. Without it: PyTorch's
    packed kernel up to the layer's `kernel_row_limit`, else the weight dequantized to float32 and one float32 GEMM."""
    native = usable(x) if x.device.type == "cpu" else None
    if native is not None:
        y = getattr(native, layer.native_op)(x.contiguous(), *layer.native_buffers())  # (M, out padded to 8) float32
        if y.shape[1] != layer.out_features:  # an int8 layer's zero rows past out_features (model/quantize/)
            y = y[:, : layer.out_features].contiguous()
    elif x.shape[0] <= layer.kernel_row_limit(False):
        y = layer.packed_matmul(x.to(KERNEL_DTYPE))
    else:
        # Float32 compute whatever the activation dtype (bfloat16 GEMM is several times slower on AVX2).
        y = F.linear(x.float(), layer.dequantize(torch.float32))
    return y.to(x.dtype)


def dequantize(layer: "QuantLinear", dtype: torch.dtype = torch.float32) -> Tensor:
    """A quantized layer's weight -> (out, in) in `dtype`: natively in one pass (bitwise the PyTorch values), else
    the layer's PyTorch `reference_dequantize`."""
    buffers = layer.native_buffers()
    native = native_kernels() if buffers is not None and dtype == torch.float32 and buffers[0].device.type == "cpu" else None
    if native is not None:
        return getattr(native, layer.native_op.replace("_linear", "_dequantize"))(*buffers)[: layer.out_features]
    return layer.reference_dequantize(dtype)


def greedy_pick(logits: Tensor) -> Tensor:  # (B, V) -> (B,) int64
    """Each row's torch.argmax of nan_to_num(logits, nan=-inf): torch.argmax itself where the row's maximum is
    finite, and still an answer for a row of NaN, inf or only -inf (one bad row must not fail the batch). No check of
    the result follows it, so on a device it is two kernels and no sync."""
    native = usable(logits)
    if native is not None and logits.dtype == torch.float32 and logits.is_contiguous():
        return native.argmax_rows(logits)  # one vectorized pass, the same index
    return logits.nan_to_num(nan=float("-inf")).argmax(dim=-1)


def paged_write(k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, slots: Tensor) -> None:
    """Write one step's k, v (N, K, E) into their pool slots (N,) (block * bs + offset) of pools (NB, bs, K, E), or
    (NB, bs, K, E + 4) for an int8 cache (kv_int8.py)."""
    native = usable(k)
    if native is not None and native_pool(k.dtype, k_pool.dtype):
        native.paged_write(k, v, k_pool, v_pool, slots)
    else:  # a 16-bit or int8 cache: rounded once, here
        kv_int8.write_slots(k_pool, slots, k)
        kv_int8.write_slots(v_pool, slots, v)


NARROW_KV = (torch.float16, torch.bfloat16, torch.int8)


def native_pool(act: torch.dtype, pool: torch.dtype) -> bool:
    """The native kernels' (activations, cache) pairs: one dtype, or float32 over a 16-bit or int8 cache."""
    return act == pool or (act == torch.float32 and pool in NARROW_KV)


def decode_attention_backend(q: Tensor, k_pool: Tensor) -> str:
    """Which implementation `decode_attention` runs for q's device and dtype: "native", "triton" or "torch"."""
    native = usable(q)
    if native is not None and native_pool(q.dtype, k_pool.dtype):
        return "native"
    if (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and _triton().available(q, k_pool.shape[1], k_pool.dtype):
        return "triton"
    return "torch"


def triton_fallbacks() -> dict[str, int]:
    """Fallbacks of the Triton kernels' set-up in this process (triton_attention.FALLBACKS), without importing Triton
    where nothing has."""
    mod = sys.modules.get("model.kernels.triton_attention")
    return dict(mod.FALLBACKS) if mod is not None else {"triton_cache": 0}


def _triton():
    """model/kernels/triton_attention.py, imported where it can run (CUDA, or Triton's interpreter): importing Triton
    is a noticeable share of a start-up that a CPU server would pay for nothing."""
    from model.kernels import triton_attention

    return triton_attention


def prefill_tiles(chunks: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """`prefill_attention`'s tiles for chunks (first packed row, rows, first position) (triton_attention.py)."""
    return _triton().prefill_tiles(chunks)


def prefill_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, tiles: Tensor, tables: Tensor, out: Tensor) -> None:
    """A step's prefill chunks, as tiles (Tn, 4) of consecutive rows of q (N, H, E) (model/kernels/
    triton_attention.py's `prefill_tiles`), attend causally over their chunks' blocks (C, W) in pools (NB, bs, K, E)
    in one launch; writes those rows of out. Where `decode_attention_backend` is "triton"."""
    _triton().paged_prefill_attention(q, k_pool, v_pool, tiles, tables, out)


def decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, rows: Tensor, tables: Tensor, lens: Tensor,
                     out: Tensor, telemetry: AttentionTelemetry | None = None, window: int = 0,
                     scale: float = 0.0) -> None:
    """Rows `rows` (R,) of q (N, H, E) attend over their block tables (R, W) up to their lengths (R,) in pools
    (NB, bs, K, E) (E + 4: an int8 cache, kv_int8.py); writes those rows of out (N, H, E). Native and Triton walk the tables in place (no gather); the
    PyTorch reference gathers each row's blocks and masks past its length. `telemetry`: the rows with a slot also
    record their sink mass and top-k keys (model/kernels/attention_telemetry.py); the output is the same either way.
    `window`: a sliding window (0: none): a row of length n attends to positions [n - window, n) only, and the blocks
    before them are never read (they may be back in the pool: model/engine/kv_cache_manager.py). `scale`: the
    attention scale (0: 1/sqrt(E))."""
    if rows.numel() == 0:
        return
    backend = decode_attention_backend(q, k_pool)
    if backend == "native":
        if telemetry is None:
            usable(q).paged_decode_attention(q, k_pool, v_pool, rows, tables, lens, out, window, scale)
        else:
            usable(q).paged_decode_attention_telemetry(q, k_pool, v_pool, rows, tables, lens, out, *telemetry,
                                                       window, scale)
    elif backend == "triton":
        _triton().paged_decode_attention(q, k_pool, v_pool, rows, tables, lens, out, telemetry, window, scale)
    else:
        R, (_, bs, K, _), E = tables.shape[0], k_pool.shape, q.shape[-1]
        if k_pool.dtype == torch.int8:  # the query rounded as the kernels round it (kv_int8.round_query)
            q, scale = kv_int8.round_query(q, scale), 1.0
        W = -(-int(lens.max()) // bs)  # the blocks the longest row uses: the rest of the table is never read
        first = (lens - window).clamp(min=0) if window else torch.zeros_like(lens)  # (R,) each row's first key
        B0 = int(first.min()) // bs  # blocks before every row's window are not gathered
        ids = tables[:, B0:W].reshape(-1)  # (R * (W - B0),)
        S = (W - B0) * bs
        kd = kv_int8.read_blocks(k_pool, ids, q.dtype).view(R, S, K, E)  # (R, S, K, E): positions B0 bs ..
        vd = kv_int8.read_blocks(v_pool, ids, q.dtype).view(R, S, K, E)
        pos = torch.arange(B0 * bs, W * bs, device=q.device)
        seen = (pos < lens.unsqueeze(1)) & (pos >= first.unsqueeze(1))  # (R, S)
        out[rows] = sdpa(q[rows].unsqueeze(1), kd, vd, seen[:, None, None, :], scale=scale).squeeze(1)  # (R, H, E)
        if telemetry is not None:
            attention_telemetry.reference(q[rows], kd, lens, telemetry, first=first, offset=B0 * bs, scale=scale)
