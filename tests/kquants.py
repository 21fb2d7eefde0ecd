"""Q4_K and Q6_K blocks of given float weights, for test files (the `gguf` package dequantizes the K-quants but cannot
write them). A plain round-to-nearest encoder of ggml's layouts (ggml-common.h `block_q4_K`, `block_q6_K`; decoding
in ggml-quants.c `dequantize_row_q4_K` / `_q6_K`): not llama-quantize's search for the best scales, so a little
coarser than its files, with the same bits in the same places. tests/model/test_gguf_families.py checks each against
`gguf.quants.dequantize`."""

from __future__ import annotations

import numpy as np


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def q4_k(w: np.ndarray) -> np.ndarray:
    """w (N, K), K a multiple of 256 -> (N, K / 256 * 144) uint8: per super-block of 256, d and dmin (float16), the 8
    sub-blocks' 6-bit scales and mins packed in 12 bytes, then 4-bit quants (two sub-blocks of 32 per 32 bytes)."""
    N, K = w.shape
    x = w.reshape(N, K // 256, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0.0)  # (N, S, 8): each sub-block's offset, at most 0 (ggml: -min as the "min")
    step = (x.max(-1) - lo) / 15  # (N, S, 8)
    d = _f16(step.max(-1) / 63)  # (N, S)
    dmin = _f16(-lo.min(-1) / 63)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(step, df, out=np.zeros_like(step), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(np.divide(-lo, dminf, out=np.zeros_like(lo), where=dminf > 0)), 0, 63).astype(np.uint8)
    scale = (df * sc)[..., None]  # (N, S, 8, 1)
    q = np.clip(np.round(np.divide(x + (dminf * m)[..., None], scale, out=np.zeros_like(x), where=scale > 0)), 0, 15)
    q = q.astype(np.uint8)
    scales = np.zeros((N, K // 256, 12), np.uint8)
    scales[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    scales[..., 4:8] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    pairs = q.reshape(N, K // 256, 4, 2, 32)  # chunks of 64: sub-blocks 2c (low nibbles) and 2c + 1 (high)
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(N, K // 256, 128)
    head = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8)], axis=-1)  # (N, S, 4)
    return np.concatenate([head, scales, qs], axis=-1).reshape(N, -1)


def q6_k(w: np.ndarray) -> np.ndarray:
    """w (N, K), K a multiple of 256 -> (N, K / 256 * 210) uint8: per super-block of 256, the low 4 bits of 6-bit
    quants (128 bytes), their high 2 bits (64), 16 int8 scales of sub-blocks of 16, d (float16)."""
    N, K = w.shape
    x = w.reshape(N, K // 256, 16, 16).astype(np.float32)
    step = np.abs(x).max(-1) / 31  # (N, S, 16)
    d = _f16(step.max(-1) / 127)  # (N, S)
    df = d.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(step, df, out=np.zeros_like(step), where=df > 0)), -128, 127).astype(np.int8)
    scale = (df * sc)[..., None]
    q = np.clip(np.round(np.divide(x, scale, out=np.zeros_like(x), where=scale != 0)), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(N, K // 256, 2, 4, 32)  # halves of 128: four runs of 32 values
    # (N, S, 2, 64): ql[l] holds values l and l + 64 of a half, ql[l + 32] values l + 32 and l + 96
    lo = np.concatenate([q[:, :, :, 0] & 15, q[:, :, :, 1] & 15], axis=-1)
    ql = (lo | ((np.concatenate([q[:, :, :, 2], q[:, :, :, 3]], axis=-1) & 15) << 4)).astype(np.uint8)
    qh = ((q[:, :, :, 0] >> 4) | ((q[:, :, :, 1] >> 4) << 2) | ((q[:, :, :, 2] >> 4) << 4) | ((q[:, :, :, 3] >> 4) << 6))
    parts = [ql.reshape(N, K // 256, 128), qh.astype(np.uint8).reshape(N, K // 256, 64), sc.view(np.uint8),
             d[..., None].view(np.uint8)]
    return np.concatenate(parts, axis=-1).reshape(N, -1)
