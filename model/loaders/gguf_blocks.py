"""A GGUF file's quantized matrices -> the served int4 / int8 layers, one tensor at a time, no float copy of the model.

Block layouts: ggml `ggml-common.h` (`block_q4_0`, `block_q4_1`, `block_q8_0`, `block_q4_K`); the reference
dequantization is the `gguf` package's `gguf.quants` (ggml `ggml-quants.c` in numpy). Which served format a file type
takes (`own_format`), per tensor, under `--quantization auto`:

    Q4_0, Q4_1   -> int4, exact: their d (and m) are float16, as the int4 format keeps them (Q4_0: m = -8 d)
    Q4_K         -> int4: each 32-weight sub-block's scale d*sc and min -dmin*m (`get_scale_min_k4`) as that group's
                    d and m. The 4-bit q are exact; the int4 format keeps d and m in float16, so d*sc (an 11-bit
                    float16 times a 6-bit integer) is rounded to 11 bits: a relative error <= 2^-11 of the group's scale
    Q8_0         -> int8, exact
    Q5_0, Q5_1, Q5_K, Q6_K -> int8, requantized from the file's values (per block of 32, d = max|w| / 127)
    anything else (Q2_K, Q3_K, IQ*, TQ*, float matrices) -> none of its own: dequantized and requantized per tensor

`matrix_layer` converts one tensor in row chunks (a transient of at most `CHUNK_ELEMENTS` floats), so the peak is the
served layer plus one chunk, never a float copy of the tensor, let alone of the model.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from model.loaders.errors import CheckpointError
from model.quantize import GROUP_SIZE, Int4Linear, Int8Linear, QuantLinear, int4_groups, int8_blocks

CHUNK_ELEMENTS = 1 << 22  # weights converted at a time: 16 MB of float32 staging

# The served format a file type maps to without going through float (exact, or within the stated rounding).
OWN_FORMAT = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4",
              "Q8_0": "int8", "Q5_0": "int8", "Q5_1": "int8", "Q5_K": "int8", "Q6_K": "int8"}
EXACT = {("Q4_0", "int4"), ("Q4_1", "int4"), ("Q8_0", "int8")}


def own_format(qtype: str) -> str | None:
    """"int4" / "int8": the served format that keeps this GGUF type's precision; None: float or a type with none."""
    return OWN_FORMAT.get(qtype)


def conversion(qtype: str, kind: str) -> str:
    """How a `qtype` matrix becomes `kind`, for the start-up log and /v1/models: e.g. "Q4_K -> int4"."""
    how = "" if (qtype, kind) in EXACT else " (float16 scales)" if (qtype, kind) == ("Q4_K", "int4") else " (requantized)"
    return f"{qtype} -> {kind}{how}"


def q4_groups(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_0 / Q4_1 / Q4_K bytes of a (N, K) tensor -> q (N, K) uint8 in [0, 15], d and m (N, K/32) float32 with
    w = q * d + m per group of 32 along K.

    Q4_0 {f16 d; u8 qs[16]}, Q4_1 {f16 d; f16 m; u8 qs[16]}: weight j of a block is qs[j] & 0xF for j < 16 and
    qs[j - 16] >> 4 for j >= 16; Q4_0's w = d (q - 8) is m = -8 d. Q4_K {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}
    per 256 weights: sub-block 2i is the low nibbles of qs[32i : 32i + 32], 2i + 1 their high nibbles, with scale
    d * sc and min dmin * m (6-bit sc, m packed as `get_scale_min_k4`), w = d sc q - dmin m.
    """
    N, K = shape
    if qtype == "Q4_K":
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, 144)  # (N K / 256, 144)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # (nb, 1)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        s = blocks[:, 4:16].reshape(-1, 3, 4)  # gguf.quants.Q4_K.get_scale_min
        sc = np.concatenate([s[:, 0] & 0x3F, (s[:, 2] & 0x0F) | ((s[:, 0] >> 2) & 0x30)], axis=-1)  # (nb, 8)
        mn = np.concatenate([s[:, 1] & 0x3F, (s[:, 2] >> 4) | ((s[:, 1] >> 2) & 0x30)], axis=-1)
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
        q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(N, K)  # (nb, 4, 2, 32): sub-blocks 2i, 2i + 1
        return q, (d * sc).reshape(N, K // GROUP_SIZE), (-(dmin * mn)).reshape(N, K // GROUP_SIZE)
    header = {"Q4_0": 2, "Q4_1": 4}[qtype]  # bytes of f16 d (and f16 m) before the 16 bytes of nibbles
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(N, K // GROUP_SIZE, header + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, K/G)
    qs = blocks[..., header:]  # (N, K/G, 16)
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(N, K)
    m = -8 * d if qtype == "Q4_0" else blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return q, d, m


def q8_0_blocks(raw: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Raw Q8_0 bytes {f16 d; i8 qs[32]} of a (N, K) tensor -> q (N, K) int8, d (N, K/32) float32, w = q d."""
    N, K = shape
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(N, K // GROUP_SIZE, 2 + GROUP_SIZE)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    return blocks[..., 2:].copy().view(np.int8).reshape(N, K), d


def _rows(data: np.ndarray, N: int) -> np.ndarray:
    """A tensor's data as (N, bytes or values per row): ggml blocks run along the innermost dim, so a row is whole."""
    return data.reshape(N, -1)


def _decode(raw: np.ndarray, qtype: GGMLQuantizationType, kind: str, rows: int, K: int) -> tuple[np.ndarray, ...]:
    """One chunk of rows -> the served format's arrays: its own blocks where `kind` keeps them, else requantized
    from the file's values (`gguf.quants.dequantize`)."""
    name = qtype.name
    if kind == "int4" and name in ("Q4_0", "Q4_1", "Q4_K"):
        return q4_groups(raw, name, (rows, K))
    if kind == "int8" and name == "Q8_0":
        return q8_0_blocks(raw, (rows, K))
    try:
        w = torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(rows, K))
    except NotImplementedError:
        raise CheckpointError(f"unsupported GGUF tensor type {name}") from None
    return tuple(a.numpy() for a in (int4_groups(w) if kind == "int4" else int8_blocks(w)))


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the row permutation llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`) applies to
    wq/wk so ggml's interleaved RoPE (pairs 2i, 2i+1) matches HF's rotate-half (pairs i, i+E/2).
    w (n_head * E, ...) -> (n_head * E, ...), any trailing dims (a weight, or its blocks' q, d, m).
    transformers' `reverse_permute_weights` is the same map."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def matrix_layer(data: np.ndarray, qtype: GGMLQuantizationType, kind: str, shape: tuple[int, int],
                 n_head: int | None, pad_rows: bool = False) -> QuantLinear:
    """A (N, K) GGUF matrix -> an `Int4Linear` / `Int8Linear` (`kind`), converted `CHUNK_ELEMENTS` at a time;
    `n_head`: undo llama.cpp's q/k row permutation (`unpermute_qk`) on the integer arrays. `pad_rows`: an int4
    matrix whose rows are not whole groups of 16 gets zero rows up to them (an embedding table, which is only
    gathered from, keeps its own format whatever the vocabulary's size)."""
    N, K = shape
    rows = _rows(data, N)
    step = max(1, CHUNK_ELEMENTS // K)
    parts = [_decode(rows[a : a + step], qtype, kind, min(step, N - a), K) for a in range(0, N, step)]
    arrays = [np.concatenate(p) if len(p) > 1 else p[0] for p in zip(*parts)]
    del parts
    if n_head is not None:
        arrays = [unpermute_qk(a, n_head) for a in arrays]
    if pad_rows and kind == "int4" and N % 16:
        arrays = [np.concatenate([a, np.zeros((-N % 16, *a.shape[1:]), dtype=a.dtype)]) for a in arrays]
    tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    if kind == "int4":
        return Int4Linear(*tensors)
    return Int8Linear(*tensors)
