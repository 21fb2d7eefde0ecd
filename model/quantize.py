"""Weight-only int8 / int6 / int4 linear layers for CPU, and the swap that installs them after a model is loaded
(int8 and int4 for any checkpoint; int6 only for a GGUF's Q6_K matrices, kept as the file holds them).

Decode reads every weight once per token, so its speed is weight bytes / memory bandwidth: about 1 byte per weight
(int8), 0.82 (int6) or 0.56-0.63 (int4) instead of 4 (float32) moves that ceiling about 4x / 5x / 6-7x. Activations
stay in the model's dtype; only the matmul kernels see quantized weights.

Formats (ggml's blocks of 32 along the input dim, so a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks map without rounding):
    int8  w[n, k] = q[n, k] * d[n, b]               q int8 in [-127, 127], d float16, b = k // 32   (GGUF Q8_0)
    int4  w[n, k] = q[n, k] * d[n, b] + m[n, b]     q in [0, 15], two per byte, d and m
          float16 (GGUF Q4_1; Q4_0's w = d (q - 8) is m = -8 d, so a GGUF file's Q4_0 and Q4_1 blocks map exactly:
          model/loaders/gguf_blocks.py); or Q4_K's own scales, d = D sc and m = -(Dmin mn) with D, Dmin float16 per
          256 weights and sc, mn a byte per 32 (`int4_k_scales`: exact, 4.625 bits a weight)
    int6  w[n, k] = (d[n, B] sc[n, k / 16]) (q[n, k] - 32)    q in [0, 63], sc int8, d float16, B = k // 256
          (GGUF Q6_K as the file holds it, 6.5625 bits a weight: served only from such files, `Int6Linear`)
All are stored 8 output rows interleaved, as the native kernels read them (model/kernels/csrc/qgemm.h): int4 by
`int4_layout`, int8 in chunks of 4 weights per output (its rows padded with zeros to a multiple of 8), int6 by
`int6_layout`; each block's scales (and int4's offsets) for the 8 outputs side by side.

Kernels, by what the machine has:
    native  model/kernels (C++, AVX2) `int4_linear` / `int6_linear` / `int8_linear`: the formats above against
            activations rounded to int8 blocks (llama.cpp's scheme), exact integer block sums; one kernel for any
            number of rows (decode and prefill), so a row's result never depends on its step (batch invariance)
    torch   without the native kernels: PyTorch's packed int4 kernel (`_weight_int4pack_mm_for_cpu`, bfloat16
            activations) up to 16 rows, else the weight dequantized to float32 and one float32 GEMM
"""

from __future__ import annotations

import itertools
import math
from typing import Literal

import torch
from torch import Tensor, nn

from model.kernels import ops
from model.transformer import FUSED_PARTS

Quantization = Literal["none", "int8", "int4"]
QUANTIZATIONS: tuple[str, ...] = ("none", "int8", "int4")
GROUP_SIZE = 32  # weights per block along the input dim; GGUF Q4_0 / Q4_1 / Q8_0 blocks hold 32
KERNEL_DTYPE = ops.KERNEL_DTYPE  # activations, scales and zeros as PyTorch's packed CPU kernel takes them
MAX_KERNEL_ROWS = 16  # rows at or below which PyTorch's packed int4 kernel runs; above, dequantize + float GEMM


class _DequantizedBackward(torch.autograd.Function):
    """A quantized layer differentiable in its input (attribution, model/probes/): the forward is the served kernel
    (activations rounded as it rounds them), the backward dy W with W this layer's weight dequantized to float32 for
    the call and dropped after it, so no float copy of the model is ever held. The rounding of the activations is
    taken as the identity in the backward (a straight-through estimate)."""

    @staticmethod
    def forward(ctx, x: Tensor, layer: "QuantLinear") -> Tensor:  # x (M, in) -> (M, out)
        ctx.layer = layer
        return ops.quantized_linear(layer, x)  # (autograd is off in here: the native kernel runs)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None]:  # dy (M, out) -> dx (M, in)
        return (dy.float() @ ctx.layer.dequantize(torch.float32)).to(dy.dtype), None


class QuantLinear(nn.Module):
    """A bias-free linear `y = x W^T` over a quantized W (out_features, in_features); `layer(x)` as nn.Linear."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        x2 = x.reshape(-1, self.in_features)  # (M, in)
        if x.requires_grad and torch.is_grad_enabled():
            y = _DequantizedBackward.apply(x2, self)
        else:
            y = ops.quantized_linear(self, x2)  # (M, out): the kernel for the row count
        return y.view(*x.shape[:-1], self.out_features)

    def kernel_row_limit(self, native: bool) -> float:
        """Rows up to which the quantized kernel runs (above: dequantize + float GEMM): any number for the native
        kernels, `MAX_KERNEL_ROWS` for PyTorch's packed one (`packed_matmul`), none where there is no such kernel."""
        if native:
            return math.inf
        return MAX_KERNEL_ROWS if self.has_packed_matmul else 0

    has_packed_matmul = False

    native_op = ""  # the model/kernels function that multiplies by this weight: (x, *native_buffers()) -> y

    def native_buffers(self) -> list[Tensor] | None:
        """The two buffers the native kernel reads (model/kernels/csrc/step_layers.cpp's `linear`), or None."""
        return None

    def packed_matmul(self, x: Tensor) -> Tensor:  # (M, in) bfloat16 -> (M, out) bfloat16, PyTorch's packed kernel
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
        return f"in_features={self.in_features}, out_features={self.out_features}"


class RowPaddedLinear(QuantLinear):
    """A layer of two buffers, `weight` and `scales`, whose rows are padded with zeros to whole groups of 8 outputs
    (int8, int6): `out_features` is kept beside them."""

    @classmethod
    def packed(cls, weight: Tensor, scales: Tensor, out_features: int):
        """A layer over buffers already in the kernel's layout (e.g. written there from a file's blocks);
        `out_features`: the rows before padding to whole groups of 8."""
        self = cls.__new__(cls)
        QuantLinear.__init__(self, weight.shape[1] * GROUP_SIZE, out_features)
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        return self

    @classmethod
    def cat(cls, layers: list):
        """Stack layers with the same input along the output dim (fused q/k/v, gate/up): the buffers themselves
        where every part fills whole groups of 8 rows (no padding between them), else through their values."""
        if all(m.out_features % 8 == 0 for m in layers):
            return cls.packed(joined([m.weight for m in layers]), joined([m.scales for m in layers]),
                              sum(m.out_features for m in layers))
        return cls.from_values([torch.cat(t) for t in zip(*(m.unpacked() for m in layers))])

    def native_buffers(self) -> list[Tensor] | None:
        return [self.weight, self.scales]

    @property
    def decode_bytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes


class Int8Linear(RowPaddedLinear):
    def __init__(self, qweight: Tensor, d: Tensor) -> None:
        """qweight (N, K) int8, d (N, K/32): w = qweight * d per block of 32 along K (GGUF Q8_0)."""
        N, K = qweight.shape
        if K % GROUP_SIZE:
            raise ValueError(f"int8 needs in_features % {GROUP_SIZE} == 0, got ({N}, {K})")
        super().__init__(K, N)
        weight, scales = int8_layout(qweight.to(torch.int8), d)
        self.register_buffer("weight", weight.reshape(-1, K // GROUP_SIZE, 64).view(torch.int8))  # (N/8, K/32, 256)
        self.register_buffer("scales", scales.contiguous())  # (N/8, K/32, 8) float16

    @classmethod
    def from_float(cls, w: Tensor) -> "Int8Linear":
        return cls(*by_rows(int8_blocks, w))

    @classmethod
    def from_values(cls, values: list[Tensor]) -> "Int8Linear":
        return cls(*values)  # (`unpacked`'s q, d)

    def unpacked(self) -> tuple[Tensor, Tensor]:
        """-> q (N, K) int8, d (N, K/G) float32."""
        N, K = self.out_features, self.in_features
        q = self.weight.view(-1, K // GROUP_SIZE, 8, 8, 4).permute(0, 3, 1, 2, 4).reshape(-1, K)[:N]  # (g, j, b, c, t)
        return q, self.scales.permute(0, 2, 1).reshape(-1, K // GROUP_SIZE)[:N].float()

    native_op = "int8_linear"

    def reference_dequantize(self, dtype: torch.dtype) -> Tensor:
        q, d = self.unpacked()
        N, K = q.shape
        return (q.float().reshape(N, K // GROUP_SIZE, GROUP_SIZE) * d[..., None]).reshape(N, K).to(dtype)


class Int4Linear(QuantLinear):
    def __init__(self, q: Tensor, d: Tensor, m: Tensor) -> None:
        """q (N, K) integers in [0, 15]; d, m (N, K / 32): w = q * d + m per group of 32 along K."""
        N, K = q.shape
        if K % GROUP_SIZE or N % 16:
            raise ValueError(f"int4 needs in_features % {GROUP_SIZE} == 0 and out_features % 16 == 0, got ({N}, {K})")
        super().__init__(K, N)
        q = q.to(torch.uint8).view(N, K // GROUP_SIZE, 2, 16)
        nibbles, scales = int4_layout(q[:, :, 0] | (q[:, :, 1] << 4), d, m)
        self.register_buffer("nibbles", nibbles.reshape(N // 8, K // GROUP_SIZE, 32).view(torch.uint8))  # (N/8, K/32, 128)
        self.register_buffer("scales", scales.contiguous())  # (N/8, K/32, 2, 8) float16; symmetric: (N/8, K/32, 1, 8)
        # (Q4_K's scales, `int4_k_scales`: (N/8, K/256, 80))
        # PyTorch's packed kernel wants its own packing (it depends on the CPU's vector width) and bfloat16
        # scales and zeros: built on first use, only where the native kernels do not run.
        self._torch_pack: tuple[Tensor, Tensor] | None = None

    @classmethod
    def packed(cls, nibbles: Tensor, scales: Tensor) -> "Int4Linear":
        """A layer over buffers already in the kernel's layout (`int4_layout`), e.g. written there from a file's
        blocks."""
        self = cls.__new__(cls)
        QuantLinear.__init__(self, nibbles.shape[1] * GROUP_SIZE, nibbles.shape[0] * 8)
        self.register_buffer("nibbles", nibbles)
        self.register_buffer("scales", scales)
        self._torch_pack = None
        return self

    @classmethod
    def from_float(cls, w: Tensor) -> "Int4Linear":
        return cls(*by_rows(int4_groups, w))

    @classmethod
    def cat(cls, layers: list["Int4Linear"]) -> "Int4Linear":
        """Stack layers with the same input along the output dim: their buffers (whole groups of 8 rows each); layers
        of differing scale layouts get d and m written out per block in float16 (a symmetric layer's m = -8 d exact;
        Q4_K's d = D sc and m rounded to float16)."""
        if len({(m.symmetric, m.k_scales) for m in layers}) > 1:
            return cls.packed(torch.cat([m.nibbles for m in layers]), torch.cat([m.asymmetric_scales() for m in layers]))
        return cls.packed(joined([m.nibbles for m in layers]), joined([m.scales for m in layers]))

    @property
    def symmetric(self) -> bool:
        """Scales of d alone, m = -8 d (GGUF Q4_0 as the file holds it: `int4_layout` with m None)."""
        return self.scales.dim() == 4 and self.scales.shape[2] == 1

    @property
    def k_scales(self) -> bool:
        """Q4_K's own scales (`int4_k_scales`)."""
        return self.scales.dim() == 3

    def asymmetric_scales(self) -> Tensor:
        """(N/8, K/32, 2, 8) float16: d then m, whichever layout the layer has."""
        if self.k_scales:
            G, nb = self.nibbles.shape[:2]
            d, m = self.group_scales(torch.arange(G).repeat_interleave(8), torch.arange(8).repeat(G))  # (N, nb)
            return torch.stack([d, m], dim=1).to(torch.float16).view(G, 8, 2, nb).permute(0, 3, 2, 1).contiguous()
        if not self.symmetric:
            return self.scales
        return torch.cat([self.scales, (self.scales.float() * -8).to(torch.float16)], dim=2)

    def group_scales(self, g: Tensor, j: Tensor) -> tuple[Tensor, Tensor]:
        """Output rows 8 g + j (T,) -> d, m (T, K/32) float32, as the kernels compute them."""
        if self.k_scales:
            nbk = self.scales.shape[1]
            raw = self.scales.view(torch.uint8)[g]  # (T, K/256, 160)
            lane, lane8 = j[:, None, None].expand(-1, nbk, 1), j[:, None, None, None].expand(-1, nbk, 8, 1)
            D, Dmin = (raw[..., a : a + 16].contiguous().view(torch.float16).gather(2, lane)[..., 0].float() for a in (0, 16))
            sc, mn = (raw[..., a : a + 64].reshape(-1, nbk, 8, 8).gather(3, lane8)[..., 0].float() for a in (32, 96))
            return (D[..., None] * sc).reshape(len(g), -1), (-(Dmin[..., None] * mn)).reshape(len(g), -1)  # (T, K/32)
        dm = self.scales[g, :, :, j].float()  # (T, nb, 2), or (T, nb, 1) symmetric: m = -8 d
        return dm[..., 0], dm[..., 1] if dm.shape[-1] == 2 else -8 * dm[..., 0]

    def unpacked(self) -> tuple[Tensor, Tensor, Tensor]:
        """-> q (N, K) uint8, d (N, K/G) float32, m (N, K/G) float32."""
        N, K = self.out_features, self.in_features
        nib = self.nibbles.view(N // 8, K // GROUP_SIZE, 4, 8, 4)  # (g, b, p, j, t)
        q = torch.stack([nib & 15, nib >> 4], dim=2)  # (g, b, half, p, j, t): k = 32 b + 16 half + 4 p + t
        q = q.permute(0, 4, 1, 2, 3, 5).reshape(N, K)
        d, m = self.group_scales(torch.arange(N // 8).repeat_interleave(8), torch.arange(8).repeat(N // 8))
        return q, d, m

    native_op = "int4_linear"

    def native_buffers(self) -> list[Tensor] | None:
        return [self.nibbles, self.scales]

    has_packed_matmul = True

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
        return self.nibbles.nbytes + self.scales.nbytes


class Int6Linear(RowPaddedLinear):
    """GGUF Q6_K served as the file holds it (qgemm.h's Int6 layout, `int6_layout`): 6-bit q, an int8 scale per 16
    weights and a float16 d per 256, 6.5625 bits a weight (int8 takes 8.5 and rounds the file's values again).
    Buffers: weight (N'/8, K/32, 208) uint8, scales (N'/8, K/256, 8) float16."""

    @classmethod
    def from_float(cls, w: Tensor) -> "Int6Linear":
        """w (N, K), K a multiple of 256 -> Q6_K's form rounded plainly (not ggml's `make_qx_quants` search): per 16
        weights a scale s = max|w| / 31, d = max s / 127 per 256 (float16), sc = round(s / d), q = round(w / (d sc))
        + 32. (Files bring their own Q6_K; this serves the kernels' tests.)"""
        w = w.detach().float()
        N, K = w.shape
        if K % 256:
            raise ValueError(f"int6 needs in_features % 256 == 0, got ({N}, {K})")
        g = w.reshape(N, K // 256, 16, 16)
        s = g.abs().amax(-1) / 31  # (N, K/256, 16)
        d = (s.amax(-1) / 127).half()  # (N, K/256)
        sc = torch.where(d[..., None] > 0, torch.round(s / d.float()[..., None].clamp(min=1e-30)), 0).clamp(0, 127)
        step = (d.float()[..., None] * sc)[..., None]  # (N, K/256, 16, 1)
        q = torch.where(step > 0, torch.round(g / step.clamp(min=1e-30)), 0).clamp(-32, 31) + 32
        return cls.from_values([q.reshape(N, K).to(torch.uint8), sc.reshape(N, K // 16).to(torch.int8), d])

    @classmethod
    def from_values(cls, values: list[Tensor]) -> "Int6Linear":
        """`unpacked`'s q, sc, d -> the layer (rows padded with zeros to whole groups of 8)."""
        N, pad = values[0].shape[0], -values[0].shape[0] % 8
        data, scales = int6_layout(*(torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in values))
        return cls.packed(data.contiguous(), scales.contiguous(), N)

    def unpacked(self) -> tuple[Tensor, Tensor, Tensor]:
        """-> q (N, K) uint8 in [0, 63], sc (N, K/16) int8, d (N, K/256) float16."""
        G = self.weight.shape[0]
        g, j = torch.arange(G).repeat_interleave(8), torch.arange(8).repeat(G)
        q, sc, d = int6_rows(self.weight, self.scales, g, j)
        N = self.out_features
        return q[:N], sc[:N], d[:N]

    native_op = "int6_linear"

    def reference_dequantize(self, dtype: torch.dtype) -> Tensor:
        return int6_values(*self.unpacked()).to(dtype)


class StackedLinear(QuantLinear):
    """A fused module (q/k/v, gate/up: `transformer.FUSED_PARTS`) whose parts are served in different formats, each
    in its own: Q4_K_M files hold attn_q and attn_k in Q4_K beside a Q6_K attn_v in some blocks, so wqkv is int4 rows
    then int6 rows, `parts` stacked along the output dim. Each part runs its own kernel on the same rounded
    activations and the outputs are concatenated, so no part's weights are rounded again (int8 for all of them read
    8.5 bits a weight where the file holds 4.625 and 6.5625). The fused native step takes the parts as one
    projection (step_layers.cpp's `Projection`)."""

    def __init__(self, parts: list[QuantLinear]) -> None:
        if len({p.in_features for p in parts}) != 1 or any(isinstance(p, StackedLinear) for p in parts):
            raise ValueError("stacked parts share their input and are not stacks themselves")
        super().__init__(parts[0].in_features, sum(p.out_features for p in parts))
        self.parts = nn.ModuleList(parts)

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out): each part's columns in order
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def kernel_row_limit(self, native: bool) -> float:
        return min(p.kernel_row_limit(native) for p in self.parts)

    def native_parts(self) -> list[list[Tensor]] | None:
        """Each part's two native buffers, in order; None where a part has none."""
        buffers = [p.native_buffers() for p in self.parts]
        return None if any(b is None for b in buffers) else buffers

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:  # -> (out, in)
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def reference_dequantize(self, dtype: torch.dtype) -> Tensor:
        return torch.cat([p.reference_dequantize(dtype) for p in self.parts])

    @property
    def decode_bytes(self) -> int:
        return sum(p.decode_bytes for p in self.parts)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, parts {[p.out_features for p in self.parts]}"


def stack(layers: list[QuantLinear]) -> QuantLinear:
    """Layers with the same input stacked along the output dim as one module: runs of the same class joined
    (`cat`), a `StackedLinear` of the runs where the classes differ."""
    runs = [list(run) for _, run in itertools.groupby(layers, key=type)]
    joined_runs = [type(r[0]).cat(r) if len(r) > 1 else r[0] for r in runs]
    return joined_runs[0] if len(joined_runs) == 1 else StackedLinear(joined_runs)


def int6_layout(q: Tensor, sc: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """q (N, K) uint8 in [0, 63], sc (N, K/16) int8, d (N, K/256) float16, N whole groups of 8 -> the int6 kernel's
    buffers (qgemm.h): data (N/8, K/32, 208) uint8 (per block: Int4's nibble layout of q's low 4 bits, then their top
    2 bits, then the 16 sub-scales) and scales (N/8, K/256, 8) float16."""
    N, K = q.shape
    nb = K // GROUP_SIZE
    qb = q.reshape(N, nb, 2, 4, 4)  # (n, b, half, p, t): k = 32 b + 16 half + 4 p + t
    nib = (qb[:, :, 0] & 15) | ((qb[:, :, 1] & 15) << 4)  # (n, b, p, t)
    top = (qb >> 4).reshape(N, nb, 2, 2, 2, 4)  # (n, b, half, h, pp, t): chunk p = 2 h + pp
    top = top[:, :, 0, :, 0] | (top[:, :, 1, :, 0] << 2) | (top[:, :, 0, :, 1] << 4) | (top[:, :, 1, :, 1] << 6)
    subs = sc.contiguous().view(torch.uint8).reshape(N, nb, 2)  # (n, b, half)
    G = N // 8
    data = torch.cat([nib.reshape(G, 8, nb, 4, 4).permute(0, 2, 3, 1, 4).reshape(G, nb, 128),
                      top.reshape(G, 8, nb, 2, 4).permute(0, 2, 3, 1, 4).reshape(G, nb, 64),
                      subs.reshape(G, 8, nb, 2).permute(0, 2, 3, 1).reshape(G, nb, 16)], dim=2)
    return data, d.to(torch.float16).reshape(G, 8, nb // 8).permute(0, 2, 1)


def int6_rows(data: Tensor, scales: Tensor, g: Tensor, j: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Output rows 8 g + j (T,) of an int6 layer's buffers -> q (T, K) uint8, sc (T, K/16) int8, d (T, K/256)
    float16 (`int6_layout` undone)."""
    G, nb = data.shape[:2]
    nib = data[..., :128].reshape(G, nb, 4, 8, 4)[g, :, :, j, :]  # (T, nb, p, t)
    top = data[..., 128:192].reshape(G, nb, 2, 8, 4)[g, :, :, j, :]  # (T, nb, h, t)
    subs = data[..., 192:].reshape(G, nb, 2, 8)[g, :, :, j]  # (T, nb, half)
    lo = torch.stack([nib & 15, nib >> 4], dim=2)  # (T, nb, half, p, t)
    shift = (2 * torch.arange(2)[:, None] + 4 * (torch.arange(4) % 2)[None, :]).to(torch.uint8)  # (half, p)
    hi = (top[:, :, torch.tensor([0, 0, 1, 1])].unsqueeze(2) >> shift[None, None, :, :, None]) & 3
    q = (lo | (hi << 4)).reshape(len(g), -1)
    return q, subs.contiguous().view(torch.int8).reshape(len(g), -1), scales[g, :, j]


def int6_values(q: Tensor, sc: Tensor, d: Tensor) -> Tensor:
    """-> w (T, K) float32 = (d sc) (q - 32), each product rounded, as gguf.quants dequantizes Q6_K."""
    T, K = q.shape
    dl = d.float().repeat_interleave(16, dim=1) * sc.float()  # (T, K/16)
    return (dl[..., None] * (q.reshape(T, K // 16, 16).float() - 32)).reshape(T, K)


def joined(parts: list[Tensor]) -> Tensor:
    """torch.cat(parts) along dim 0, without a copy where the parts already lie back to back, in order, in one
    storage (a loader wrote a fused module's parts so: model/loaders/gguf_file.py)."""
    first = parts[0]
    end = first.data_ptr()
    for p in parts:
        if not (p.is_contiguous() and p.data_ptr() == end and p.dtype == first.dtype and p.shape[1:] == first.shape[1:]
                and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()):
            return torch.cat(parts)
        end += p.nbytes
    rows = sum(p.shape[0] for p in parts)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))


def int4_layout(qs: Tensor, d: Tensor, m: Tensor | None) -> tuple[Tensor, Tensor]:
    """The int4 kernel's layout (model/kernels/csrc/qgemm.h), as views to copy from. qs (N, K/32, 16) uint8: byte i
    of a group holds its weight i in the low nibble and weight i + 16 in the high one (GGUF's Q4_0 / Q4_1 `qs`);
    d, m (N, K/32) -> nibbles (N/8, K/32, 4, 8) int32, the buffer (N/8, K/32, 128) uint8 with byte (g, b, p, j, t) =
    qs[8g + j, b, 4p + t], so that one 32-byte vector holds 4 weights of each of 8 outputs (ggml-cpu's repack.cpp
    interleaves its Q4_0 8x8 GEMM weights alike), and scales (N/8, K/32, 2, 8) float16: each group's d then m for the
    8 outputs side by side; m None (GGUF Q4_0, w = d (q - 8)): the symmetric layout, scales (N/8, K/32, 1, 8) of d
    alone, the kernels taking m = -8 d (0.5 bits a weight less to read). Views, so a loader copies each chunk once,
    straight into the buffer; the 4 bytes t move together as one int32 (4x fewer elements for the strided copy than
    bytes)."""
    N, nb = qs.shape[:2]
    nibbles = int4_nibbles(qs)
    parts = [d] if m is None else [d, m]
    dm = torch.stack([t.to(torch.float16) for t in parts], dim=1)  # (N, S, K/32), S = 1 or 2
    return nibbles, dm.view(N // 8, 8, len(parts), nb).permute(0, 3, 2, 1)


def int4_nibbles(qs: Tensor) -> Tensor:
    """`int4_layout`'s nibbles alone: qs (N, K/32, 16) uint8 -> (N/8, K/32, 4, 8) int32 view (g, b, p, j)."""
    N, nb = qs.shape[:2]
    words = qs.contiguous().view(torch.int32)  # (N, K/32, 4): word p holds bytes 4p..4p+3 of a group
    return words.view(N // 8, 8, nb, 4).permute(0, 2, 3, 1)  # (g, j, b, p) -> (g, b, p, j)


def int4_k_scales(D: Tensor, Dmin: Tensor, sc: Tensor, mn: Tensor) -> Tensor:
    """GGUF Q4_K's scales as the int4 kernels take them (qgemm.h): D, Dmin (N, K/256) float16, sc, mn (N, K/32)
    6-bit integers, N whole groups of 8 -> (N/8, K/256, 80) float16-sized: per 8 outputs and 256 weights, 160 bytes,
    the outputs' D, their Dmin, then sc as bytes (sub-block s, output j), then mn alike. Each block's d = D sc and
    m = -(Dmin mn) are exact float32 products (an 11-bit float times a 6-bit integer)."""
    N, nbk = D.shape
    G = N // 8

    def halves(t: Tensor) -> Tensor:  # (N, K/256) float16 -> (G, K/256, 16) bytes: output j's value at 2j
        return t.to(torch.float16).reshape(G, 8, nbk).permute(0, 2, 1).contiguous().view(torch.uint8)

    def per_block(t: Tensor) -> Tensor:  # (N, K/32) -> (G, K/256, 64) bytes (s, j)
        return t.to(torch.uint8).reshape(G, 8, nbk, 8).permute(0, 2, 3, 1).reshape(G, nbk, 64)

    return torch.cat([halves(D), halves(Dmin), per_block(sc), per_block(mn)], dim=2).view(torch.float16)


def int8_layout(q: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """The int8 kernel's layout, as views to copy from: q (N, K) int8, d (N, K/32) -> weight (N'/8, K/32, 8, 8)
    int32, the buffer (N'/8, K/32, 256) int8 with byte (g, b, c, j, t) = q[8g + j, 32b + 4c + t] (4 bytes t as one
    word), scales (N'/8, K/32, 8) float16; N' = N padded with zero rows to whole groups of 8 (outputs dropped)."""
    N, K = q.shape
    pad, nb = -N % 8, K // GROUP_SIZE
    q = (torch.nn.functional.pad(q, (0, 0, 0, pad)) if pad else q).contiguous().view(torch.int32)
    q = q.view(-1, 8, nb, 8)  # (g, j, b, c)
    dp = d.to(torch.float16)
    dp = (torch.nn.functional.pad(dp, (0, 0, 0, pad)) if pad else dp).view(-1, 8, nb)
    return q.permute(0, 2, 3, 1), dp.permute(0, 2, 1)


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


class QuantEmbedding(nn.Module):
    """The token embedding table kept in a quantized layer's format (an `Int8Linear` / `Int4Linear` / `Int6Linear`
    of shape (vocab, dim)): a row is dequantized when it is gathered, so the table costs its quantized bytes. With tied
    embeddings it is the LM head itself (llama.cpp keeps `token_embd` quantized and dequantizes the rows it gets,
    `ggml_get_rows`). A gathered row equals the layer's `reference_dequantize` row bit for bit."""

    def __init__(self, table: QuantLinear, dtype: torch.dtype, num_embeddings: int | None = None) -> None:
        """`num_embeddings`: the vocabulary, where the table has padding rows past it."""
        super().__init__()
        self.table, self.dtype = table, dtype
        self.num_embeddings, self.embedding_dim = num_embeddings or table.out_features, table.in_features

    def forward(self, tokens: Tensor) -> Tensor:  # (...) int64 -> (..., D)
        idx = tokens.reshape(-1)
        g, j = idx // 8, idx % 8  # 8 rows interleaved per group (qgemm.h)
        K, nb = self.embedding_dim, self.embedding_dim // GROUP_SIZE
        if isinstance(self.table, Int6Linear):
            w = int6_values(*int6_rows(self.table.weight, self.table.scales, g, j))
        elif isinstance(self.table, Int8Linear):
            q = self.table.weight.view(-1, nb, 8, 8, 4)[g, :, :, j, :]  # (T, nb, c, t) -> k = 32 b + 4 c + t
            d = self.table.scales[g, :, j].float()  # (T, nb)
            w = q.reshape(-1, nb, GROUP_SIZE).float() * d[..., None]
        else:
            nib = self.table.nibbles.view(-1, nb, 4, 8, 4)[g, :, :, j, :]  # (T, nb, p, t)
            q = torch.stack([nib & 15, nib >> 4], dim=2)  # (T, nb, half, p, t): k = 32 b + 16 half + 4 p + t
            d, m = self.table.group_scales(g, j)  # (T, nb)
            w = q.reshape(-1, nb, GROUP_SIZE).float() * d[..., None] + m[..., None]
        return w.reshape(*tokens.shape, K).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {type(self.table).__name__}"


_QUANT_CLASSES: dict[str, type[QuantLinear]] = {"int8": Int8Linear, "int4": Int4Linear}


def _quantized(name: str, weight: Tensor, cls: type[QuantLinear], prequantized: dict[str, QuantLinear]) -> QuantLinear:
    """The quantized form of our module `name`: mapped from the file when it has it (a fused module from its parts,
    stacked as `transformer.FUSED_PARTS` says, the parts released as they are stacked), else rounded from the float
    weight."""
    layer_prefix, suffix = name.rsplit(".", 2)[0], ".".join(name.rsplit(".", 2)[1:])  # "layers.0", "attention.wqkv"
    parts = [f"{layer_prefix}.{p}" for p in FUSED_PARTS.get(suffix, ())]
    if parts and all(p in prequantized for p in parts):
        return stack([prequantized.pop(p) for p in parts])  # (parts of differing formats: a StackedLinear)
    if name in prequantized:
        return prequantized.pop(name)
    if weight.is_meta:
        raise ValueError(f"{name}: no weight to quantize")
    return cls.from_float(weight)


def quantize_model(model: nn.Module, mode: Quantization, prequantized: dict[str, QuantLinear] | None = None) -> nn.Module:
    """Swap the model's linear layers for weight-only quantized ones, in place (module by module: whatever
    `nn.Linear` the blocks hold); returns the model.

    Every block's projections take `mode`; the LM head takes int8 in both modes, as llama.cpp keeps the default
    model's tied head in Q8_0: it is the largest matrix and the most sensitive to rounding. The embedding table is
    kept quantized too (`QuantEmbedding`): the head itself when the embeddings are tied, else int8 rows. `prequantized`
    (our names of the file's matrices, e.g. "layers.0.attention.wq", "output" for the head, "tok_embeddings" for the
    table) supplies layers mapped straight from a file's blocks; it is emptied as they are installed.
    """
    if mode == "none":
        return model
    if mode not in _QUANT_CLASSES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if model.device.type != "cpu":
        raise ValueError(f"quantization {mode!r} runs CPU kernels; the model is on {model.device}")
    cls, pre, dtype = _QUANT_CLASSES[mode], prequantized if prequantized is not None else {}, model.dtype
    # (a matrix whose input is not whole blocks of 32 stays in float)
    linears = [(name, m) for name, m in model.layers.named_modules(prefix="layers")
               if isinstance(m, nn.Linear) and m.in_features % GROUP_SIZE == 0]
    for name, module in linears:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, _quantized(name, module.weight, cls, pre))
    head = pre.pop("output", None) or _quantized("output", model.output.weight, Int8Linear, {})
    table = pre.pop("tok_embeddings", None)
    if table is None:
        tied = model.config.tie_embeddings and head.out_features == model.config.vocab_size
        table = head if tied else _quantized("tok_embeddings", model.tok_embeddings.weight, Int8Linear, {})
    model.output, model.tok_embeddings = head, QuantEmbedding(table, dtype, model.config.vocab_size)
    model.quantization = mode
    return model


def linear_weights(model: nn.Module) -> list[nn.Module]:
    """Every matrix a decode token multiplies by, as the model holds it (a float `nn.Linear` or a quantized module)."""
    parts = {id(p) for m in model.layers.modules() if isinstance(m, StackedLinear) for p in m.parts}
    return [m for m in model.layers.modules()
            if isinstance(m, (nn.Linear, QuantLinear)) and id(m) not in parts] + [model.output]


def decode_bytes(layer: nn.Module) -> int:
    """Bytes one decode token streams through this layer: what its kernel reads."""
    return layer.decode_bytes if isinstance(layer, QuantLinear) else layer.weight.nbytes
