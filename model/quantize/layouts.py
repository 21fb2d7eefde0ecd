"""The packed layouts the native kernels read (model/kernels/csrc/qgemm.h): a quantized matrix's integers and
scales, 8 output rows interleaved, written from rounded weights or straight from a GGUF file's blocks, and read back
(a gathered embedding row, a reference dequantization)."""

from __future__ import annotations

import torch
from torch import Tensor

GROUP_SIZE = 32  # weights per block along the input dim; GGUF Q4_0 / Q4_1 / Q8_0 blocks hold 32


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
