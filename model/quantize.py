"""Weight-only int8 / int4 linear layers for CPU decode, and the swap that installs them after a model is loaded.

Batch-1 decode reads every weight once per token, so its speed is weight bytes / memory bandwidth: 1 byte per
weight (int8) or half a byte (int4) instead of 4 (float32) moves that ceiling 4x / 8x. Activations stay in the
model's dtype; only the matmul kernels see quantized weights.

Formats:
    int8  per output channel, symmetric:  w[n, k] = q[n, k] * s[n],            q int8 in [-127, 127], s bfloat16
    int4  groups of G = 32 along k:       w[n, k] = q[n, k] * d[n, g] + m[n, g],   q in [0, 15], g = k // G,
          two weights per byte (k even in the low nibble), d and m float16: GGUF's Q4_1 block form, and Q4_0's
          (w = d (q - 8)) with m = -8 d, so `Int4Linear.from_gguf_blocks` maps a file's blocks without rounding.

Kernels for few rows (decode), by what the machine has:
    native  model/kernels (C++, AVX2): `int8_linear` / `int4_linear` read the formats above directly, with the
            dequantization fused into integer dot products against int8-rounded activations (llama.cpp's scheme)
    torch   PyTorch's own packed CPU kernels where the native ones are off or could not be built:
            `torch.ops.aten._weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` (groups of 32, scale and zero
            z = m + 8 d in bfloat16; its packing is built on first use), both fast only with bfloat16 activations

Per-phase compute: the few-row kernels are bandwidth kernels. With many rows (prefill) float32 GEMM is several
times faster on AVX2 than either kind, so above `kernel_row_limit` rows (16 for PyTorch's kernels, 80 for the
native ones) a layer dequantizes its weight to float32
and runs `F.linear` in float32, whatever the activation dtype (a transient copy of one matrix, amortized over the
rows; bfloat16 GEMM with many rows is the slowest option on AVX2), over activations rounded as the native kernel
rounds them when that is the decode kernel. So `--dtype bfloat16 --quantization int8` decodes with bfloat16
activations and KV cache (half the KV bytes) and prefills in float32.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn

from model.kernels import ops
from model.transformer import FUSED_PARTS

Quantization = Literal["none", "int8", "int4"]
QUANTIZATIONS: tuple[str, ...] = ("none", "int8", "int4")
GROUP_SIZE = 32  # int4 group along the input dim; GGUF Q4_0/Q4_1 blocks hold 32 weights
KERNEL_DTYPE = torch.bfloat16  # activations, scales and zeros as PyTorch's packed CPU kernels take them fastest
MAX_KERNEL_ROWS = 16  # rows at or below which PyTorch's packed kernel runs; above, dequantize + float GEMM
# The native kernels' cost grows with the rows (about 4 ms a row for a whole int4 forward on 2 threads here), the
# many-row path's is mostly fixed (about 160 ms: the native dequantization of every matrix, then float32 GEMM):
# `python -m benchmarks.kernel_rows` gave int4 38 vs 168 ms at 8 rows, 261 vs 288 at 64, 521 vs 417 at 128, so the
# kernels serve up to 80 rows (prompts up to 80 tokens, batches of up to 80 decode rows).
MAX_NATIVE_KERNEL_ROWS = 80


class QuantLinear(nn.Module):
    """A bias-free linear `y = x W^T` over a quantized W (out_features, in_features); `layer(x)` as nn.Linear."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.max_kernel_rows: int | None = None  # None: the kernel kind's own limit (`kernel_row_limit`)

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        y = ops.quantized_linear(self, x.reshape(-1, self.in_features))  # (M, out): the kernel for the row count
        return y.view(*x.shape[:-1], self.out_features)

    def kernel_row_limit(self, native: bool) -> int:
        """Rows up to which the few-row kernel runs (above: dequantize + float GEMM)."""
        if self.max_kernel_rows is not None:
            return self.max_kernel_rows
        return MAX_NATIVE_KERNEL_ROWS if native else MAX_KERNEL_ROWS

    native_op = ""  # the model/kernels function that multiplies by this weight: (x, *native_buffers()) -> y

    def native_buffers(self) -> list[Tensor] | None:
        """The two buffers the native kernel reads (model/kernels/csrc/decode_layers.cpp's `linear`), or None."""
        return None

    def packed_matmul(self, x: Tensor) -> Tensor:  # (M, in) bfloat16 -> (M, out) bfloat16, PyTorch's packed kernels
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:  # -> (out, in)
        return ops.dequantize(self, dtype)

    def reference_dequantize(self, dtype: torch.dtype) -> Tensor:  # -> (out, in): the PyTorch implementation
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

    native_op = "int8_linear"

    def native_buffers(self) -> list[Tensor] | None:
        return [self.weight, self.scales] if self.in_features % GROUP_SIZE == 0 else None

    def packed_matmul(self, x: Tensor) -> Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)

    def reference_dequantize(self, dtype: torch.dtype) -> Tensor:
        return (self.weight.to(dtype) * self.scales.to(dtype)[:, None]).to(dtype)

    @property
    def decode_bytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes


class Int4Linear(QuantLinear):
    def __init__(self, q: Tensor, d: Tensor, m: Tensor) -> None:
        """q (N, K) integers in [0, 15]; d, m (N, K / 32): w = q * d + m per group of 32 along K."""
        N, K = q.shape
        if K % GROUP_SIZE or N % 16:
            raise ValueError(f"int4 needs in_features % {GROUP_SIZE} == 0 and out_features % 16 == 0, got ({N}, {K})")
        super().__init__(K, N)
        q = q.to(torch.uint8)
        self.register_buffer("nibbles", (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous())  # (N, K/2) uint8
        self.register_buffer("dm", torch.stack([d, m], dim=-1).to(torch.float16).contiguous())  # (N, K/G, 2)
        # PyTorch's packed kernel wants its own packing (it depends on the CPU's vector width) and bfloat16
        # scales and zeros: built on first use, only where the native kernels do not run.
        self._torch_pack: tuple[Tensor, Tensor] | None = None

    @classmethod
    def from_float(cls, w: Tensor) -> "Int4Linear":
        """Asymmetric min/max rounding per group of 32 (gpt-fast's `group_quantize_tensor`, 4 bits; GGUF's Q4_1)."""
        w = w.detach().float()
        N, K = w.shape
        g = w.reshape(N, K // GROUP_SIZE, GROUP_SIZE)
        lo, hi = g.amin(-1), g.amax(-1)  # (N, K/G)
        d = ((hi - lo) / 15).clamp(min=1e-6).half().float()  # rounded as the layer keeps them
        m = lo.half().float()
        q = torch.round((g - m[..., None]) / d[..., None]).clamp(0, 15)
        return cls(q.reshape(N, K), d, m)

    @classmethod
    def from_gguf_blocks(cls, raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> "Int4Linear":
        """GGUF Q4_0 / Q4_1 blocks of a (N, K) weight -> the same weights as int4 groups, no rounding at all.

        ggml `block_q4_0` = {f16 d; u8 qs[16]}, `block_q4_1` = {f16 d; f16 m; u8 qs[16]} (ggml-common.h); weight j of
        a block is qs[j] & 0xF for j < 16 and qs[j - 16] >> 4 for j >= 16.
        """
        q, d, m = gguf_q4_groups(raw, qtype, shape)
        return cls(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))

    @classmethod
    def cat(cls, layers: list["Int4Linear"]) -> "Int4Linear":
        qs, ds, ms = zip(*(m.unpacked() for m in layers))
        return cls(torch.cat(qs), torch.cat(ds), torch.cat(ms))

    def unpacked(self) -> tuple[Tensor, Tensor, Tensor]:
        """-> q (N, K) uint8, d (N, K/G) float32, m (N, K/G) float32."""
        q = torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1).reshape(self.out_features, self.in_features)
        dm = self.dm.float()
        return q, dm[..., 0], dm[..., 1]

    native_op = "int4_linear"

    def native_buffers(self) -> list[Tensor] | None:
        return [self.nibbles, self.dm]

    def packed_matmul(self, x: Tensor) -> Tensor:
        if self._torch_pack is None:
            q, d, m = self.unpacked()
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            sz = torch.stack([d, m + 8 * d], dim=-1).to(KERNEL_DTYPE)  # (N, K/G, 2): w = (q - 8) * s + z
            self._torch_pack = packed, sz.transpose(0, 1).contiguous()  # (K/G, N, 2) as the kernel wants
        packed, scales_and_zeros = self._torch_pack
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP_SIZE, scales_and_zeros)

    def reference_dequantize(self, dtype: torch.dtype) -> Tensor:
        q, d, m = self.unpacked()
        N, K = q.shape
        g = q.reshape(N, K // GROUP_SIZE, GROUP_SIZE).float() * d[..., None] + m[..., None]
        return g.reshape(N, K).to(dtype)

    @property
    def decode_bytes(self) -> int:
        if self._torch_pack is not None:
            return sum(t.nbytes for t in self._torch_pack)
        return self.nibbles.nbytes + self.dm.nbytes


def round_activations(x: Tensor) -> Tensor:
    """x (M, K) float32 -> x rounded as the native kernels round it before their integer dot products: int8 in
    blocks of 32 along K, d = max|x| / 127 per block (ggml's `quantize_row_q8_0`; ties to even)."""
    M, K = x.shape
    b = x.reshape(M, K // GROUP_SIZE, GROUP_SIZE)
    d = b.abs().amax(-1, keepdim=True) / 127  # (M, K/G, 1)
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(b * inv) * d).reshape(M, K)


def gguf_q4_groups(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_0 / Q4_1 bytes of a (N, K) tensor -> q (N, K) uint8 in [0, 15], d and m (N, K/32) float32 with
    w = q * d + m (Q4_1's own d and m; Q4_0's w = d (q - 8) is m = -8 d, exact in float16 too)."""
    N, K = shape
    header = {"Q4_0": 2, "Q4_1": 4}[qtype]  # bytes of f16 d (and f16 m) before the 16 bytes of nibbles
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(N, K // GROUP_SIZE, header + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, K/G)
    qs = blocks[..., header:]  # (N, K/G, 16)
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(N, K)  # block j<16: low nibbles; j>=16: high nibbles
    if qtype == "Q4_0":
        m = -8 * d
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return q, d, m
_QUANT_CLASSES: dict[str, type[QuantLinear]] = {"int8": Int8Linear, "int4": Int4Linear}


def _quantized(name: str, weight: Tensor, cls: type[QuantLinear], prequantized: dict[str, QuantLinear]) -> QuantLinear:
    """The quantized form of our module `name`: mapped from the file when it has it (a fused module from its parts,
    stacked as `transformer.FUSED_PARTS` says), else rounded from the float weight."""
    layer_prefix, suffix = name.rsplit(".", 2)[0], ".".join(name.rsplit(".", 2)[1:])  # "layers.0", "attention.wqkv"
    parts = [f"{layer_prefix}.{p}" for p in FUSED_PARTS.get(suffix, ())]
    if parts and all(p in prequantized for p in parts):
        return cls.cat([prequantized[p] for p in parts])
    return prequantized[name] if name in prequantized else cls.from_float(weight)


def quantize_model(model: nn.Module, mode: Quantization, prequantized: dict[str, QuantLinear] | None = None) -> nn.Module:
    """Swap the model's linear layers for weight-only quantized ones, in place (module by module: whatever
    `nn.Linear` the blocks hold); returns the model.

    Every block's projections take `mode`; the LM head takes int8 in both modes, as llama.cpp keeps the default
    model's tied head in Q8_0: it is the largest matrix, the most sensitive to rounding, and the int4 CPU kernel is
    slowest on it. The embedding table stays in the model's dtype (it is gathered, not multiplied). `prequantized`
    (our names of the file's matrices, e.g. "layers.0.attention.wq") supplies layers mapped straight from a file.
    """
    if mode == "none":
        return model
    if mode not in _QUANT_CLASSES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if model.device.type != "cpu":
        raise ValueError(f"quantization {mode!r} runs CPU kernels; the model is on {model.device}")
    cls, pre = _QUANT_CLASSES[mode], prequantized or {}
    linears = [(name, m) for name, m in model.layers.named_modules(prefix="layers") if type(m) is nn.Linear]
    for name, module in linears:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, _quantized(name, module.weight, cls, pre))
    model.output = Int8Linear.from_float(model.output.weight)
    model.quantization = mode
    return model


def linear_weights(model: nn.Module) -> list[nn.Module]:
    """Every matrix a decode token multiplies by, as the model holds it (a float `nn.Linear` or a quantized module)."""
    return [m for m in model.layers.modules() if isinstance(m, (nn.Linear, QuantLinear))] + [model.output]


def decode_bytes(layer: nn.Module) -> int:
    """Bytes one decode token streams through this layer: what its kernel reads."""
    return layer.decode_bytes if isinstance(layer, QuantLinear) else layer.weight.nbytes
