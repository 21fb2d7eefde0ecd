"""Weight-only int8 / int4 linear layers for CPU decode, and the swap that installs them after a model is loaded.

Batch-1 decode reads every weight once per token, so its speed is weight bytes / memory bandwidth: 1 byte per
weight (int8) or half a byte (int4) instead of 4 (float32) moves that ceiling 4x / 8x. Activations stay in the
model's dtype; only the matmul kernels see quantized weights.

Formats (the layouts of PyTorch's own packed CPU kernels):
    int8  per output channel, symmetric:  w[n, k] = q[n, k] * s[n],                  q int8 in [-127, 127]
          `torch.ops.aten._weight_int8pack_mm(x, q, s)`   (fast with bfloat16 activations only, on AVX2)
    int4  groups of G = 32 along k:       w[n, k] = (q[n, k] - 8) * s[n, g] + z[n, g],  q in [0, 15], g = k // G
          `_convert_weight_to_int4pack_for_cpu` + `_weight_int4pack_mm_for_cpu`   (bfloat16 activations)
          GGUF Q4_0 (w = d (q - 8)) and Q4_1 (w = d q + m) blocks are groups of 32 with this very form:
          s = d, z = 0 (Q4_0) or z = m + 8 d (Q4_1); `Int4Linear.from_gguf_blocks` maps them without a float round
          trip (the only rounding: d and m from float16 to the kernel's bfloat16).

Per-phase compute: the packed kernels are bandwidth kernels. With many rows (prefill) float32 GEMM is several
times faster on AVX2 than either kernel, so above `max_kernel_rows` rows a layer dequantizes its weight to
float32 and runs `F.linear` in float32, whatever the activation dtype (a transient copy of one matrix, amortized
over the rows; bfloat16 GEMM with many rows is the slowest option on AVX2). So `--dtype bfloat16 --quantization
int8` decodes with bfloat16 activations (no casts around the kernels, half the KV bytes) and prefills in float32.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

Quantization = Literal["none", "int8", "int4"]
QUANTIZATIONS: tuple[str, ...] = ("none", "int8", "int4")
GROUP_SIZE = 32  # int4 group along the input dim; GGUF Q4_0/Q4_1 blocks hold 32 weights
KERNEL_DTYPE = torch.bfloat16  # activations, scales and zeros as the packed CPU kernels take them fastest
MAX_KERNEL_ROWS = 16  # rows at or below which the packed kernel runs; above, dequantize + float GEMM


class QuantLinear(nn.Module):
    """A bias-free linear `y = x W^T` over a quantized W (out_features, in_features); `layer(x)` as nn.Linear."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.max_kernel_rows = MAX_KERNEL_ROWS

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        x2 = x.reshape(-1, self.in_features)  # (M, in)
        if x2.shape[0] <= self.max_kernel_rows:
            y = self._kernel(x2.to(KERNEL_DTYPE)).to(x.dtype)  # (M, out)
        else:  # float32 compute whatever the activation dtype: bfloat16 GEMM is several times slower on AVX2
            y = F.linear(x2.float(), self.dequantize(torch.float32)).to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def _kernel(self, x: Tensor) -> Tensor:  # (M, in) bfloat16 -> (M, out) bfloat16
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:  # -> (out, in)
        raise NotImplementedError

    @property
    def decode_bytes(self) -> int:
        """Bytes the kernel reads per call: what one decode token streams through this layer."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, max_kernel_rows={self.max_kernel_rows}"


class Int8Linear(QuantLinear):
    def __init__(self, qweight: Tensor, scales: Tensor) -> None:
        """qweight (N, K) int8, scales (N,): w = qweight * scales."""
        super().__init__(qweight.shape[1], qweight.shape[0])
        self.register_buffer("weight", qweight.contiguous())  # (N, K) int8
        self.register_buffer("scales", scales.to(KERNEL_DTYPE).contiguous())  # (N,)

    @classmethod
    def from_float(cls, w: Tensor) -> "Int8Linear":
        """Symmetric per-output-channel rounding (absmax / 127), as torchao's int8 weight-only does."""
        w = w.detach().float()  # (N, K)
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(KERNEL_DTYPE).float()  # rounded as the kernel keeps it
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scales)

    @classmethod
    def cat(cls, layers: list["Int8Linear"]) -> "Int8Linear":
        """Stack layers with the same input along the output dim (fused q/k/v, gate/up)."""
        return cls(torch.cat([m.weight for m in layers]), torch.cat([m.scales for m in layers]))

    def _kernel(self, x: Tensor) -> Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return (self.weight.to(dtype) * self.scales.to(dtype)[:, None]).to(dtype)

    @property
    def decode_bytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes


class Int4Linear(QuantLinear):
    def __init__(self, q: Tensor, scales: Tensor, zeros: Tensor) -> None:
        """q (N, K) integers in [0, 15]; scales, zeros (N, K / 32): w = (q - 8) * scale + zero per group."""
        N, K = q.shape
        if K % GROUP_SIZE or N % 16:
            raise ValueError(f"int4 needs in_features % {GROUP_SIZE} == 0 and out_features % 16 == 0, got ({N}, {K})")
        super().__init__(K, N)
        q = q.to(torch.uint8)
        # The kernel's packing depends on the CPU's vector width (AVX2 vs AVX-512), so it is built here, on the
        # machine that runs it, and a plain copy (two nibbles per byte, k even in the low one) serves dequantize().
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
        self.register_buffer("nibbles", (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous())  # (N, K/2) uint8
        sz = torch.stack([scales, zeros], dim=-1).to(KERNEL_DTYPE)  # (N, K/G, 2)
        self.register_buffer("scales_and_zeros", sz.transpose(0, 1).contiguous())  # (K/G, N, 2) as the kernel wants

    @classmethod
    def from_float(cls, w: Tensor) -> "Int4Linear":
        """Asymmetric min/max rounding per group of 32 (gpt-fast's `group_quantize_tensor`, 4 bits)."""
        w = w.detach().float()
        N, K = w.shape
        g = w.reshape(N, K // GROUP_SIZE, GROUP_SIZE)
        lo, hi = g.amin(-1), g.amax(-1)  # (N, K/G)
        scales = ((hi - lo) / 15).clamp(min=1e-6).to(KERNEL_DTYPE).float()
        zeros = (lo + 8 * scales).to(KERNEL_DTYPE).float()
        q = torch.round((g - (zeros - 8 * scales)[..., None]) / scales[..., None]).clamp(0, 15)
        return cls(q.reshape(N, K), scales, zeros)

    @classmethod
    def from_gguf_blocks(cls, raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> "Int4Linear":
        """GGUF Q4_0 / Q4_1 blocks of a (N, K) weight -> the same weights as int4 groups, no float round trip.

        ggml `block_q4_0` = {f16 d; u8 qs[16]}, `block_q4_1` = {f16 d; f16 m; u8 qs[16]} (ggml-common.h); weight j of
        a block is qs[j] & 0xF for j < 16 and qs[j - 16] >> 4 for j >= 16.
        """
        q, scales, zeros = gguf_q4_groups(raw, qtype, shape)
        return cls(torch.from_numpy(q), torch.from_numpy(scales), torch.from_numpy(zeros))

    @classmethod
    def cat(cls, layers: list["Int4Linear"]) -> "Int4Linear":
        qs, ss, zs = zip(*(m.unpacked() for m in layers))
        return cls(torch.cat(qs), torch.cat(ss), torch.cat(zs))

    def unpacked(self) -> tuple[Tensor, Tensor, Tensor]:
        """-> q (N, K) uint8, scales (N, K/G) float32, zeros (N, K/G) float32."""
        q = torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1).reshape(self.out_features, self.in_features)
        sz = self.scales_and_zeros.transpose(0, 1).float()  # (N, K/G, 2)
        return q, sz[..., 0], sz[..., 1]

    def _kernel(self, x: Tensor) -> Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_and_zeros)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        q, scales, zeros = self.unpacked()
        N, K = q.shape
        g = (q.reshape(N, K // GROUP_SIZE, GROUP_SIZE).float() - 8) * scales[..., None] + zeros[..., None]
        return g.reshape(N, K).to(dtype)

    @property
    def decode_bytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


def gguf_q4_groups(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_0 / Q4_1 bytes of a (N, K) tensor -> q (N, K) uint8 in [0, 15], scales and zeros (N, K/32) float32."""
    N, K = shape
    header = {"Q4_0": 2, "Q4_1": 4}[qtype]  # bytes of f16 d (and f16 m) before the 16 bytes of nibbles
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(N, K // GROUP_SIZE, header + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, K/G)
    qs = blocks[..., header:]  # (N, K/G, 16)
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(N, K)  # block j<16: low nibbles; j>=16: high nibbles
    if qtype == "Q4_0":
        zeros = np.zeros_like(d)
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zeros = m + 8 * d
    return q, d, zeros


_QUANT_CLASSES: dict[str, type[QuantLinear]] = {"int8": Int8Linear, "int4": Int4Linear}


def _quantized(name: str, weight: Tensor, cls: type[QuantLinear], prequantized: dict[str, QuantLinear]) -> QuantLinear:
    return prequantized[name] if name in prequantized else cls.from_float(weight)


def quantize_model(model: nn.Module, mode: Quantization, prequantized: dict[str, QuantLinear] | None = None) -> nn.Module:
    """Swap the model's linear layers for weight-only quantized ones, in place; returns the model.

    Every block's projections (fused q/k/v and gate/up become one quantized module each, `wqkv` / `w13`, and the
    separate wq/wk/wv/w1/w3 are dropped) take `mode`; the LM head takes int8 in both modes, as llama.cpp keeps
    the default model's tied head in Q8_0: it is the largest matrix, the most sensitive to rounding, and the int4
    CPU kernel is slowest on it. The embedding table stays in the model's dtype (it is gathered, not multiplied).
    `prequantized` (our module names, e.g. "layers.0.attention.wq") supplies layers mapped straight from a file.
    """
    if mode == "none":
        return model
    if mode not in _QUANT_CLASSES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if model.device.type != "cpu":
        raise ValueError(f"quantization {mode!r} uses PyTorch's packed CPU kernels; the model is on {model.device}")
    cls, pre = _QUANT_CLASSES[mode], prequantized or {}
    for i, layer in enumerate(model.layers):
        att, ffn = layer.attention, layer.feed_forward
        p = f"layers.{i}."
        att.wqkv = cls.cat([_quantized(p + f"attention.{n}", getattr(att, n).weight, cls, pre) for n in ("wq", "wk", "wv")])
        ffn.w13 = cls.cat([_quantized(p + f"feed_forward.{n}", getattr(ffn, n).weight, cls, pre) for n in ("w1", "w3")])
        att.wq = att.wk = att.wv = ffn.w1 = ffn.w3 = None
        att.wo = _quantized(p + "attention.wo", att.wo.weight, cls, pre)
        ffn.w2 = _quantized(p + "feed_forward.w2", ffn.w2.weight, cls, pre)
    model.output = Int8Linear.from_float(model.output.weight)
    model.quantization = mode
    return model


def linear_weights(model: nn.Module) -> list[Tensor | nn.Module]:
    """Every matrix a decode token multiplies by, as the model holds it (fused float weight or quantized module)."""
    out: list[Tensor | nn.Module] = []
    for layer in model.layers:
        att, ffn = layer.attention, layer.feed_forward
        out += [att.wqkv] if att.wqkv is not None else [att.wq.weight, att.wk.weight, att.wv.weight]
        out += [att.wo if isinstance(att.wo, QuantLinear) else att.wo.weight]
        out += [ffn.w13] if ffn.w13 is not None else [ffn.w1.weight, ffn.w3.weight]
        out += [ffn.w2 if isinstance(ffn.w2, QuantLinear) else ffn.w2.weight]
    return out + [model.output if isinstance(model.output, QuantLinear) else model.output.weight]


def decode_bytes(w: Tensor | nn.Module) -> int:
    return w.decode_bytes if isinstance(w, QuantLinear) else w.nbytes


def apply_linear(x: Tensor, w: Tensor | nn.Module) -> Tensor:
    """`x W^T` whether W is a float weight tensor or a quantized module."""
    return F.linear(x, w) if isinstance(w, Tensor) else w(x)
