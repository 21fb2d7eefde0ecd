"""The weight-only quantized modules: linear layers over each format's packed buffers (`Int8Linear`, `Int4Linear`,
`Int6Linear`, `StackedLinear` for a fused module of mixed formats) and the embedding table kept in such a layer
(`QuantEmbedding`). Their kernels: model/kernels/ops.py `quantized_linear` (native, else PyTorch)."""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor, nn

from model.kernels import ops
from model.quantize.layouts import (GROUP_SIZE, int4_layout, int6_layout, int6_rows, int6_values, int8_layout,
                                    joined)
from model.quantize.rounding import by_rows, int4_groups, int8_blocks

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
