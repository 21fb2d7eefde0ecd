"""A GGUF file's quantized matrices -> the served int4 / int8 layers, one tensor at a time, no float copy of the model.

Block layouts: ggml `ggml-common.h` (`block_q4_0`, `block_q4_1`, `block_q8_0`, `block_q4_K`); the reference
dequantization is the `gguf` package's `gguf.quants` (ggml `ggml-quants.c` in numpy). Which served format a file type
takes (`own_format`), per tensor, under `--quantization auto`:

    Q4_0, Q4_1   -> int4, exact: their d (and m) are float16, as the int4 format keeps them; Q4_0 in the symmetric
                    layout (d alone, the kernels take m = -8 d: 4.5 bits a weight, as the file), Q4_1 with its m
    Q4_K         -> int4, exact, in Q4_K's own scales layout (`quantize.int4_k_scales`): the file's float16 d and
                    dmin per 256 weights and each 32-weight sub-block's 6-bit sc and m (`get_scale_min_k4`) as a byte,
                    the kernels taking d*sc and -(dmin*m) (exact float32 products): 4.625 bits a weight. Beside other
                    int4 layouts in one fused module: d*sc and -dmin*m per group in float16 (rounded to 11 bits)
    Q6_K         -> int6, exact: the file's q, sub-scales and d moved into the kernel's layout (6.5625 bits a
                    weight, as the file); int8 (requantized) where int8 is asked for (`--quantization int8`)
    Q8_0         -> int8, exact
    Q4_0         -> int8 where int8 is asked for (the LM head, `--quantization int8`): q - 8 with its d, exact
    Q5_0, Q5_1, Q5_K -> int8, requantized from the file's values (per block of 32, d = max|w| / 127)
    anything else (Q2_K, Q3_K, IQ*, TQ*, float matrices) -> none of its own: dequantized and requantized per tensor

`matrix_layer` converts one tensor straight into the kernel's layout, so the peak is the served layer plus a
transient, never a float copy of the tensor, let alone of the model: with the native kernels in one pass over the
rows on every thread (kernels/csrc/gguf_convert.cpp: a row's float32 weights at most), else in PyTorch a chunk of
rows at a time, the block formats by byte shuffles (torch views copied once), the requantized types through float32.
Both write the same bytes (tests/model/test_gguf_kquants.py).
"""

from __future__ import annotations

import warnings
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from model import kernels
from model.loaders.errors import CheckpointError
from model.loaders.ggml_types import GGMLQuantizationType, dequantize
from model.quantize import (GROUP_SIZE, Int4Linear, Int6Linear, Int8Linear, QuantLinear, int4_groups, int4_k_scales,
                            int4_layout, int4_nibbles, int6_layout, int8_blocks, int8_layout)

CHUNK_ELEMENTS = 1 << 22  # weights converted at a time: 16 MB of float32 staging
# weights requantized at a time (through float32): temporaries of 512 KB, which glibc serves from its heap, reused
# chunk after chunk, where the loader maps each allocation of 1 MB or more on its own (a fresh page fault per 4 KB)
REQUANTIZE_ELEMENTS = 1 << 17

# The served format a file type maps to without going through float (exact, or within the stated rounding).
OWN_FORMAT = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q6_K": "int6",
              "Q8_0": "int8", "Q5_0": "int8", "Q5_1": "int8", "Q5_K": "int8"}
Alloc = Callable[[tuple, torch.dtype], Tensor]  # (shape, dtype) -> an uninitialised tensor, as torch.empty

EXACT = {("Q4_0", "int4"), ("Q4_1", "int4"), ("Q4_K", "int4"), ("Q8_0", "int8"), ("Q4_0", "int8"), ("Q6_K", "int6")}


# What the native converter (kernels/csrc/gguf_convert.cpp) writes: every int4 and int6 type served, int8 from these
NATIVE = {"int4": {"Q4_0", "Q4_1", "Q4_K"}, "int6": {"Q6_K"},
          "int8": {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}}


def scales_layout(qtype: str, kind: str | None) -> str:
    """The int4 scales layout a `qtype` matrix served as `kind` takes: "sym" (Q4_0's w = d (q - 8): d alone per group,
    `quantize.int4_layout` with m None), "k" (Q4_K's own, `quantize.int4_k_scales`), else "" (d and m per group)."""
    if kind != "int4":
        return ""
    return {"Q4_0": "sym", "Q4_K": "k"}.get(qtype, "")


def own_format(qtype: str) -> str | None:
    """"int4" / "int6" / "int8": the served format that keeps this GGUF type's precision; None: float or a type with
    none."""
    return OWN_FORMAT.get(qtype)


def conversion(qtype: str, kind: str) -> str:
    """How a `qtype` matrix becomes `kind`, for the start-up log and /v1/models: e.g. "Q4_K -> int4"."""
    how = "" if (qtype, kind) in EXACT else " (requantized)"
    return f"{qtype} -> {kind}{how}"


def _f16(blocks: Tensor, at: int) -> Tensor:
    """The float16 at byte `at` of each block: blocks (..., block bytes) uint8 -> (...) float32."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16)[..., 0].float()


def q4_groups(blocks: Tensor, qtype: str) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_0 / Q4_1 / Q4_K blocks of n rows, (n, row bytes) uint8 -> qs (n, K/32, 16) uint8, byte i of a group of 32
    weights holding weight i (low nibble) and i + 16 (high), and d, m (n, K/32) float32: w = q d + m per group.

    Q4_0 {f16 d; u8 qs[16]}, Q4_1 {f16 d; f16 m; u8 qs[16]} hold their groups so already (weight j of a block is
    qs[j] & 0xF for j < 16, qs[j - 16] >> 4 for j >= 16); Q4_0's w = d (q - 8) is m = -8 d. Q4_K {f16 d; f16 dmin;
    u8 scales[12]; u8 qs[128]} per 256 weights: sub-block 2i is the low nibbles of qs[32i : 32i + 32], 2i + 1 their
    high nibbles, with scale d * sc and min dmin * m (6-bit sc, m packed as `get_scale_min_k4`), w = d sc q - dmin m
    (`q4_k_blocks`)."""
    n = blocks.shape[0]
    if qtype == "Q4_K":
        qs, d, dmin, sc, mn = q4_k_blocks(blocks)
        d, dmin = (t.float().repeat_interleave(8, dim=1) for t in (d, dmin))  # (n, K/32)
        return qs, d * sc, -(dmin * mn)
    header = {"Q4_0": 2, "Q4_1": 4}[qtype]  # bytes of f16 d (and f16 m) before the 16 bytes of nibbles
    b = blocks.reshape(n, -1, header + 16)
    d = _f16(b, 0)
    return b[..., header:], d, -8 * d if qtype == "Q4_0" else _f16(b, 2)


def q4_k_blocks(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Q4_K blocks {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]} of n rows, (n, row bytes) uint8 -> qs (n, K/32, 16)
    uint8 (as `q4_groups`), d, dmin (n, K/256) float16, sc, mn (n, K/32) int32 (6-bit: `get_scale_min_k4`):
    w = (d sc) q - dmin mn per sub-block of 32. Sub-block 2i is the low nibbles of qs[32i : 32i + 32], 2i + 1 their
    high nibbles."""
    n = blocks.shape[0]
    b = blocks.reshape(-1, 144)  # (n K / 256, 144)
    s = b[:, 4:16].reshape(-1, 3, 4).int()  # gguf.quants.Q4_K.get_scale_min
    sc = torch.cat([s[:, 0] & 0x3F, (s[:, 2] & 0x0F) | ((s[:, 0] >> 2) & 0x30)], dim=-1)  # (nb, 8)
    mn = torch.cat([s[:, 1] & 0x3F, (s[:, 2] >> 4) | ((s[:, 1] >> 2) & 0x30)], dim=-1)
    lo, hi = b[:, 16:].reshape(-1, 4, 2, 16).unbind(2)  # qs[32i + k], qs[32i + 16 + k]: (nb, 4, 16)
    qs = torch.stack([(lo & 15) | ((hi & 15) << 4), (lo >> 4) | (hi & 0xF0)], dim=2)  # sub-blocks 2i, 2i + 1
    f16 = lambda at: b[:, at : at + 2].contiguous().view(torch.float16).reshape(n, -1)  # noqa: E731
    return qs.reshape(n, -1, 16), f16(0), f16(2), sc.reshape(n, -1), mn.reshape(n, -1)


def q6_k_blocks(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q6_K blocks {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d} of n rows, (n, row bytes) uint8 -> q (n, K) uint8 in
    [0, 63], sc (n, K/16) int8, d (n, K/256) float16: w = (d sc) (q - 32). ggml's order (`dequantize_row_q6_K`;
    gguf.quants Q6_K): byte l of half h's ql / qh holds weights 128 h + l, + 32, + 64, + 96."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 210)
    ql, qh = b[..., :128].reshape(n, -1, 2, 2, 32), b[..., 128:192].reshape(n, -1, 2, 1, 32)  # (n, B, h, lo/hi, l)
    lo, hi = ql & 15, ql >> 4  # weights + 0 / + 32 (lo), + 64 / + 96 (hi)
    top = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)) & 3  # (n, B, h, 4, l): + 0, 32, 64, 96
    q = torch.cat([lo, hi], dim=3) | (top << 4)  # (n, B, h, 4, l)
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)
    return q.reshape(n, -1), sc, b[..., 208:210].contiguous().view(torch.float16).reshape(n, -1)


def q8_0_blocks(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Q8_0 blocks {f16 d; i8 qs[32]} of n rows, (n, row bytes) uint8 -> q (n, K) int8, d (n, K/32), w = q d."""
    b = blocks.reshape(blocks.shape[0], -1, 2 + GROUP_SIZE)
    return b[..., 2:].contiguous().view(torch.int8).reshape(blocks.shape[0], -1), _f16(b, 0)


def _requantized(raw: np.ndarray, qtype: GGMLQuantizationType, kind: str, rows: int, K: int) -> tuple[Tensor, ...]:
    """Rows of another type -> `kind`'s arrays (int4: q (n, K), d, m; int8: q, d), rounded again from the file's
    values (`gguf.quants.dequantize`)."""
    try:
        w = torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(rows, K))
    except NotImplementedError:
        raise CheckpointError(f"unsupported GGUF tensor type {qtype.name}") from None
    return int4_groups(w) if kind == "int4" else int8_blocks(w)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the row permutation llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`) applies to
    wq/wk so ggml's interleaved RoPE (pairs 2i, 2i+1) matches HF's rotate-half (pairs i, i+E/2).
    w (n_head * E, ...) -> (n_head * E, ...), any trailing dims (a weight, or its blocks' q, d, m).
    transformers' `reverse_permute_weights` is the same map."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def matrix_layer(data: np.ndarray, qtype: GGMLQuantizationType, kind: str, shape: tuple[int, int],
                 n_head: int | None, pad_rows: bool = False, alloc: Alloc | None = None) -> QuantLinear:
    """A (N, K) GGUF matrix -> an `Int4Linear` / `Int8Linear` (`kind`), written straight into the kernel's layout
    (`int4_layout`, `int8_layout`): by the native converter in one pass on every thread (`NATIVE`: kernels/csrc/
    gguf_convert.cpp), else in PyTorch `CHUNK_ELEMENTS` at a time; a transient of one row or one chunk, never a
    copy of the tensor. `n_head`: undo llama.cpp's q/k row permutation (`unpermute_qk`) by reading the file's rows in
    that order. `pad_rows`: an int4 matrix whose rows are not whole groups of 16 gets zero rows up to them (an
    embedding table, which is only gathered from, keeps its own format whatever the vocabulary's size).
    `alloc(shape, dtype)`: where the layer's two buffers go, weights then scales (e.g. a loader's
    `huge_pages.WeightArena`, or row slices of a fused module's)."""
    N, K = shape
    name = qtype.name
    rows = data.reshape(N, -1)  # ggml blocks run along the innermost dim: a row's blocks are whole
    order = unpermute_qk(np.arange(N), n_head) if n_head is not None else None
    Np = N + (-N % 16 if pad_rows and kind == "int4" else -N % 8)
    if kind == "int4" and Np % 16:
        raise ValueError(f"int4 needs out_features % 16 == 0, got ({N}, {K})")
    layout = scales_layout(name, kind)
    alloc = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
    out = [alloc(shape, dtype) for shape, dtype in buffer_shapes(kind, Np, K, layout)]
    native = kernels.native()
    with warnings.catch_warnings():  # (the map is read-only; every view of it is copied from, never written)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        if native is not None and name in NATIVE[kind]:  # the whole tensor in one pass on every thread
            ordered = torch.from_numpy(order) if order is not None else torch.empty(0, dtype=torch.long)
            native.gguf_convert(torch.from_numpy(rows), int(qtype), ordered, out[0], out[1])
        else:
            _convert_in_chunks(rows, qtype, kind, N, K, order, layout, out)
    for o in out:
        o[-(-N // 8) :].zero_()  # whole groups of padding rows
    if kind == "int4":
        return Int4Linear.packed(*out)
    return (Int6Linear if kind == "int6" else Int8Linear).packed(*out, N)


def _convert_in_chunks(rows: np.ndarray, qtype: GGMLQuantizationType, kind: str, N: int, K: int,
                       order: np.ndarray | None, layout: str, out: list[Tensor]) -> None:
    """`matrix_layer`'s conversion in PyTorch, `CHUNK_ELEMENTS` weights at a time (where the native kernels do not
    run): the same bytes as `gguf_convert`."""
    name, nb = qtype.name, K // GROUP_SIZE
    Np = out[0].shape[0] * 8
    views = (out[0] if kind == "int6" else out[0].view(torch.int32).view(Np // 8, nb, -1, 8), out[1])  # as the layouts return
    moved = (name, kind) in EXACT  # by byte moves, else through float32
    step = max(8, (CHUNK_ELEMENTS if moved else REQUANTIZE_ELEMENTS) // K // 8 * 8)  # whole groups of 8 rows
    for a in range(0, N, step):
        n = min(step, N - a)
        raw = rows[order[a : a + n]] if order is not None else rows[a : a + n]  # (n, row bytes)
        if layout == "k":
            qs, d, dmin, sc, mn = _pad8(q4_k_blocks(torch.from_numpy(raw)))
            parts = (int4_nibbles(qs), int4_k_scales(d, dmin, sc, mn))
        elif kind == "int4" and name in ("Q4_0", "Q4_1", "Q4_K"):
            qs, d, m = _pad8(q4_groups(torch.from_numpy(raw), name))
            parts = int4_layout(qs, d, None if layout == "sym" else m)
        elif kind == "int6":
            parts = int6_layout(*_pad8(q6_k_blocks(torch.from_numpy(raw))))
        elif kind == "int8" and name == "Q8_0":
            parts = int8_layout(*q8_0_blocks(torch.from_numpy(raw)))
        elif kind == "int8" and name == "Q4_0":  # w = d (q - 8): int8 q - 8 with the same d, exact
            qs, d, _ = q4_groups(torch.from_numpy(raw), name)
            q = torch.cat([qs & 15, qs >> 4], dim=-1).view(torch.int8) - 8
            parts = int8_layout(q.reshape(n, K), d)
        elif kind == "int4":
            q, d, m = _requantized(raw, qtype, kind, n, K)
            q = q.view(n, nb, 2, 16)
            parts = int4_layout(*_pad8((q[:, :, 0] | (q[:, :, 1] << 4), d, m)))
        else:
            parts = int8_layout(*_requantized(raw, qtype, kind, n, K))
        for o, piece in zip(views, parts):  # (a tail of fewer than 8 rows: zero rows up to 8)
            o[a // 8 : a // 8 + piece.shape[0]] = piece


def buffer_shapes(kind: str, rows: int, K: int, layout: str = "") -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The two buffers of a `kind` layer of `rows` (whole groups of 8) x K: (shape, dtype) of its weights, scales.
    `layout`: int4's scales layout (`scales_layout`)."""
    if kind == "int4":
        scales = (rows // 8, K // 256, 80) if layout == "k" else (rows // 8, K // GROUP_SIZE, 1 if layout == "sym" else 2, 8)
        return [((rows // 8, K // GROUP_SIZE, 128), torch.uint8), (scales, torch.float16)]
    if kind == "int6":
        return [((rows // 8, K // GROUP_SIZE, 208), torch.uint8), ((rows // 8, K // 256, 8), torch.float16)]
    return [((rows // 8, K // GROUP_SIZE, 256), torch.int8), ((rows // 8, K // GROUP_SIZE, 8), torch.float16)]


def _pad8(arrays: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Arrays of n rows -> zero rows up to whole groups of 8 (the int4 layout's unit; only an embedding table's last
    chunk has a tail)."""
    pad = -arrays[0].shape[0] % 8
    if not pad:
        return arrays
    return tuple(torch.cat([a, a.new_zeros(pad, *a.shape[1:])]) for a in arrays)
