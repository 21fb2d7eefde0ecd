"""GGUF files (ggml's single-file format): metadata -> ModelConfig; tensors into the served format one at a time:
quantized matrices straight from their blocks (model/loaders/gguf_blocks.py), the rest dequantized to the dtype.

Spec: ggml `docs/gguf.md`. Read through a memory map (model/loaders/gguf_reader.py; each tensor's pages are dropped
from the process once it is converted); dequantization of F32, F16, BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants and the IQ
types is the package's numpy reference code.
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from model.loaders.assemble import ModelAssembler, NameMap, fused_parts, layer_names
from model.loaders.config_keys import config_from_gguf, with_longrope
from model.loaders.errors import CheckpointError
from model.loaders.families import BY_GGUF_ARCH, FAMILIES, Family
from model.loaders.ggml_types import GGMLQuantizationType, dequantize
from model.loaders.memory import served_bytes
from model.loaders.gguf_reader import GGUFFile
from model.loaders.gguf_blocks import (CHUNK_ELEMENTS, Alloc, buffer_shapes, conversion, matrix_layer, own_format,
                                      scales_layout, unpermute_qk)
from model.huge_pages import WeightArena
from model.quantize import GROUP_SIZE, Quantization
from model.loaders.shard import ShardFor
from model.transformer import FUSED_PARTS, Transformer

def gguf_names(family: Family) -> NameMap:
    """The GGUF tensor names llama.cpp's converter writes for `family` -> ours."""
    return NameMap(
        top={"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
             "output.weight": "output.weight"},
        layer_re=r"blk\.(\d+)\.(\w+\.(?:weight|bias))",
        layer={gguf: ours for ours, _, gguf in layer_names(family) if gguf is not None},
    )


gguf_to_ours = gguf_names(FAMILIES["llama"])  # a llama file's
# Phi-3's longrope frequency divisors (conversion/phi.py `generate_extra_tensors`): read into the config
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def family_of(reader: GGUFFile) -> Family:
    """The file's family by its general.architecture (an unknown one: llama's names; config_from_gguf refuses it)."""
    return BY_GGUF_ARCH.get(reader.metadata.get("general.architecture"), FAMILIES["llama"])


def open_gguf(path: str | Path) -> GGUFFile:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError("no such file", path=str(path))
    return GGUFFile(path)


def read_metadata(reader: GGUFFile) -> dict[str, Any]:
    return reader.metadata


def native_quantization(reader: GGUFFile) -> str:
    """The quantization that serves this file's block matrices at their own precision (`gguf_blocks.own_format`):
    "int4" where most of the blocks' 2-D weights are Q4_0 / Q4_1 / Q4_K, "int8" where they are Q8_0 / Q5_* / Q6_K (Q6_K
    matrices are then int6, `served_formats`),
    else "none" (float files and other types: the float model). Counted in parameters, so a file of mixed types
    (a Q4_K_M file is mostly Q4_K) goes by its main one; each tensor then keeps its own (`served_formats`)."""
    params: dict[str, int] = {}
    for t in reader.tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            kind = own_format(t.tensor_type.name) or "none"
            kind = "int8" if kind == "int6" else kind  # (a mode names int8 or int4; Q6_K matrices keep int6 per tensor)
            params[kind] = params.get(kind, 0) + int(np.prod(t.shape))
    return max(params, key=params.get) if params else "none"


def served_formats(reader: GGUFFile, mode: str, per_tensor: bool, tied: bool) -> dict[str, str]:
    """GGUF tensor name -> "int4" / "int6" / "int8", the format each matrix is served in under quantization `mode`.

    `per_tensor` (`--quantization auto`): each matrix at its own type's precision (`own_format`; a type with none is
    requantized to int8), else every block matrix in `mode`. The LM head is int8 either way (int6 under `per_tensor`
    where the file's head is Q6_K, as most K-quant files have it), and with tied embeddings the table is the head; an
    untied table keeps its own format. The parts of a fused module (q/k/v, gate/up) keep theirs too: where they
    differ (Q4_K_M's Q6_K attn_v beside Q4_K attn_q) the module is a `quantize.StackedLinear` of them. Int4 needs
    whole groups of 16 rows: else int8. Matrices whose input is not whole blocks of 32 are not listed (float)."""
    kinds: dict[str, str] = {}
    to_ours = gguf_names(family_of(reader))
    for t in reader.tensors:
        ours = to_ours(t.name)
        if ours is None or len(t.shape) != 2 or int(t.shape[0]) % GROUP_SIZE:
            continue
        own, rows = own_format(t.tensor_type.name), int(t.shape[1])
        if ours == "output.weight" or (tied and ours == "tok_embeddings.weight"):
            kind = "int6" if per_tensor and own == "int6" else "int8"
        elif ours == "tok_embeddings.weight":
            kinds[t.name] = own or "int8"  # (only gathered from: int4 rows padded to 16 if need be)
            continue
        elif ours.startswith("layers.") and "_norm" not in ours:
            kind = (own or "int8") if per_tensor else mode
        else:
            continue
        kinds[t.name] = "int8" if kind == "int4" and rows % 16 else kind
    return kinds


def served_bytes_gguf(reader: GGUFFile, quantization: str, per_tensor: bool, dtype: torch.dtype) -> int:
    """What the file's weights will take once served under `quantization` (`served_formats`), before any is read."""
    tied = "output.weight" not in {t.name for t in reader.tensors}
    kinds = served_formats(reader, quantization, per_tensor, tied) if quantization != "none" else {}
    fb, total = torch.empty((), dtype=dtype).element_size(), 0
    for t in reader.tensors:
        dims = [int(d) for d in reversed(t.shape.tolist())]
        rows, cols = (dims[0], dims[1]) if len(dims) == 2 else (1, int(np.prod(dims)))
        kind = kinds.get(t.name, "float")
        total += served_bytes(kind, rows, cols, fb, scales_layout(t.tensor_type.name, kind))
    return total


def _dequantize(reader_tensor: Any, path: str, rows: slice = slice(None)) -> np.ndarray:
    """The tensor (or only `rows`, the outermost dim: ggml blocks run along the innermost one, so whole rows of a
    quantized tensor are read and dequantized without the rest) as float32, dequantized `CHUNK_ELEMENTS` at a time
    into the result (the package's dequantization makes temporaries several times its input)."""
    qtype = reader_tensor.tensor_type
    shape = tuple(int(d) for d in reversed(reader_tensor.shape.tolist()))  # ggml lists ne0 (innermost) first
    data = reader_tensor.data.reshape(shape[0], -1)[rows]
    shape = (data.shape[0], *shape[1:])
    width = int(np.prod(shape[1:], dtype=np.int64)) or 1
    out = np.empty(shape, dtype=np.float32)
    flat = out.reshape(shape[0], -1)
    step = max(1, CHUNK_ELEMENTS // width)
    try:
        for a in range(0, shape[0], step):
            part = dequantize(data[a : a + step], qtype)
            flat[a : a + step] = np.asarray(part, dtype=np.float32).reshape(-1, width)
    except NotImplementedError:
        raise CheckpointError(
            f"unsupported GGUF tensor type {qtype.name}; supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
            "Q2_K..Q6_K, IQ*, TQ*",
            path=path,
            tensor=reader_tensor.name,
        ) from None
    except ValueError:
        raise CheckpointError(f"data does not fill shape {list(shape)}", path=path, tensor=reader_tensor.name) from None
    return out


def dequantized(reader_tensor: Any, path: str) -> np.ndarray:
    """A whole tensor of the file as float32, its dims outermost first (a LoRA GGUF's small matrices, model/features/lora/adapters.py)."""
    return _dequantize(reader_tensor, path)


class _Placement:
    """Where the served matrices' buffers go: one `WeightArena` of `capacity` bytes (on 2 MB pages, written once),
    and a fused module's parts (q/k/v, gate/up: `transformer.FUSED_PARTS`) as row slices of the module's own buffers,
    back to back, so joining them (`quantize.joined`) copies nothing: each run of consecutive parts in one format
    (Q4_K_M's Q4_K q and k before a Q6_K v: `quantize.stack`) shares buffers. A part alone in its format, or int8
    parts whose rows are not whole groups of 8, get buffers of their own (the latter joined by copying)."""

    def __init__(self, capacity: int, kinds: dict[str, str], tensors: dict[str, Any]) -> None:
        self.arena = WeightArena(capacity)
        self.kinds, self.tensors = kinds, tensors  # GGUF name -> served format; our name -> the file's tensor
        self.fused: dict[str, list[Tensor]] = {}  # our fused module -> its buffers
        self.part_of: dict[str, tuple[str, int]] = {}  # our part name -> (fused module, its first row)

        def layout(n: str) -> tuple[str | None, str]:  # our part name -> (served format, scales layout)
            kind = kinds.get(tensors[n].name)
            return kind, scales_layout(tensors[n].tensor_type.name, kind)

        for fused, parts in FUSED_PARTS.items():
            for prefix in {".".join(n.split(".")[:2]) for n in tensors if n.startswith("layers.")}:  # "layers.0"
                names = [f"{prefix}.{p}.weight" for p in parts]
                if not all(n in tensors for n in names):
                    continue
                # runs of consecutive parts of one (format, scales layout): one layout for a run's buffers
                for r, (key, parts_run) in enumerate(itertools.groupby(names, key=layout)):
                    run = list(parts_run)
                    rows = [int(tensors[n].shape[1]) for n in run]
                    if len(run) < 2 or key == (None, "") or any(x % 8 for x in rows):
                        continue
                    first = 0
                    for n, x in zip(run, rows):
                        self.part_of[n] = (f"{prefix}.{fused}/{r}", first)
                        first += x

    def alloc(self, ours: str) -> Alloc:
        """The `alloc` for `matrix_layer` of our parameter `ours`."""
        if ours not in self.part_of:
            return self._take
        module, first = self.part_of[ours]
        if module not in self.fused:
            parts = [n for n, (m, _) in self.part_of.items() if m == module]
            t = self.tensors[parts[0]]
            rows, K = sum(int(self.tensors[n].shape[1]) for n in parts), int(t.shape[0])
            kind = self.kinds[t.name]
            self.fused[module] = [self._take(shape, dtype)
                                  for shape, dtype in buffer_shapes(kind, rows, K, scales_layout(t.tensor_type.name, kind))]
        buffers = iter(self.fused[module])
        return lambda shape, dtype: next(buffers)[first // 8 : first // 8 + shape[0]]

    def _take(self, shape: tuple, dtype: torch.dtype) -> Tensor:
        return self.arena.empty(shape, dtype)


def load_gguf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    reader: GGUFFile | None = None,
    meta: dict[str, Any] | None = None,
    quantization: Quantization = "none",
    shard: ShardFor | None = None,
    per_tensor: bool = False,
) -> Transformer:
    """`reader`/`meta`: an already opened file and its metadata, so the caller's tokenizer shares one read.
    `quantization` "int8" / "int4": every matrix goes straight from the file's blocks into its served format, one
    tensor at a time (`served_formats`, `gguf_blocks.matrix_layer`): no float copy of the model; `per_tensor`
    (`--quantization auto`): each at its own type's precision. `model.weight_mix` counts the conversions.
    `shard`: load only that tensor-parallel rank's slices (not with quantization). Row slices (wq/wk/wv/w1/w3) are cut
    from the quantized data before dequantizing; column slices (wo/w2) cut across ggml blocks, so those tensors are
    dequantized whole, one at a time, and sliced at once (a transient float32 copy of one tensor, never of the
    model)."""
    path = str(path)
    reader = reader or open_gguf(path)
    meta = meta if meta is not None else read_metadata(reader)
    names = {t.name for t in reader.tensors}
    family = family_of(reader)
    to_ours = gguf_names(family)
    config = config_from_gguf(meta, source=path).replace(tie_embeddings="output.weight" not in names)
    if all(n in names for n in LONGROPE_TENSORS):
        long, short = (_dequantize(reader.tensors[[t.name for t in reader.tensors].index(n)], path).tolist()
                       for n in LONGROPE_TENSORS)
        config = with_longrope(config, meta, long, short, source=path)
    plan = shard(config) if shard is not None else None
    if plan is not None:
        quantization = "none"
    asm = ModelAssembler(config, path, dtype, device, f"load {Path(path).name}", plan, quantization)
    kinds = served_formats(reader, quantization, per_tensor, config.tie_embeddings) if quantization != "none" else {}
    placement = None
    if kinds and torch.device(device).type == "cpu":
        capacity = served_bytes_gguf(reader, quantization, per_tensor, dtype) + 4096 * len(reader.tensors)
        placement = _Placement(capacity, kinds, {to_ours(t.name): t for t in reader.tensors if to_ours(t.name)})
    rope_freq_factors = None
    mix: Counter[str] = Counter()
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            # Llama 3.1 scaling as per-frequency divisors of inv_freq (llama.cpp `generate_extra_tensors`).
            rope_freq_factors = torch.from_numpy(_dequantize(t, path))
            continue
        if t.name in LONGROPE_TENSORS:
            continue  # in the config already
        ours = to_ours(t.name)
        if ours is None:
            raise CheckpointError(f"unknown tensor name for a {meta.get('general.architecture')} GGUF", path=path,
                                  tensor=t.name)
        # q/k rows (and biases) as llama.cpp's converter permuted them, for the architectures it permutes
        # (families.py). (asm.config: this rank's head counts when sharded)
        n_head = None
        if family.permuted_qk:
            n_head = (asm.config.n_heads if t.name.endswith(("attn_q.weight", "attn_q.bias"))
                      else asm.config.n_kv_heads if t.name.endswith(("attn_k.weight", "attn_k.bias")) else None)
        kind = kinds.get(t.name)
        if kind is not None:
            shape = (int(t.shape[1]), int(t.shape[0]))
            asm.check(ours, shape, t.name)
            try:
                layer = matrix_layer(t.data, t.tensor_type, kind, shape, n_head, pad_rows=ours == "tok_embeddings.weight",
                                     alloc=placement.alloc(ours) if placement is not None else None)
            except CheckpointError as e:
                raise CheckpointError(str(e), path=path, tensor=t.name) from None
            asm.add_layer(ours, layer, t.name, rows=shape[0])
            mix[conversion(t.tensor_type.name, kind)] += 1
            reader.release(t)
            continue
        parts = fused_parts(ours) if plan is not None else None
        if parts is not None:  # a fused matrix (Phi-3's attn_qkv, ffn_up) under tensor parallelism: each part's slice
            H, K, E, F = config.n_heads, config.n_kv_heads, config.head_dim, config.hidden_dim
            whole = _dequantize(t, path)
            pieces = np.split(whole, np.cumsum([H * E, K * E] if "wqkv" in ours else [F]), axis=0)
            for part, piece in zip(parts, pieces):
                cut = plan.slice_of(part)
                piece = piece if cut is None else (piece[cut[1] : cut[2]] if cut[0] == 0 else piece[:, cut[1] : cut[2]])
                asm.add(part, torch.from_numpy(np.ascontiguousarray(piece)), t.name)
            mix[f"{t.tensor_type.name} -> {str(dtype).removeprefix('torch.')}"] += 1
            reader.release(t)
            continue
        cut = plan.slice_of(ours) if plan is not None else None
        w = _dequantize(t, path, slice(cut[1], cut[2]) if cut and cut[0] == 0 else slice(None))
        # llama.cpp's q/k permutation moves rows within a head only, so un-permuting a slice of whole heads with
        # the slice's head count is the same as un-permuting the whole tensor and then slicing it
        if n_head is not None:
            w = unpermute_qk(w, n_head)
        if cut and cut[0] == 1:
            w = np.ascontiguousarray(w[:, cut[1] : cut[2]])  # a copy: the whole dequantized tensor is freed
        if w.ndim == 2:
            mix[f"{t.tensor_type.name} -> {str(dtype).removeprefix('torch.')}"] += 1
        asm.add(ours, torch.from_numpy(np.ascontiguousarray(w)), t.name)
        reader.release(t)
    if rope_freq_factors is not None and rope_freq_factors.shape != (config.head_dim // 2,):
        raise CheckpointError(f"expected shape [{config.head_dim // 2}], found {list(rope_freq_factors.shape)}", path=path, tensor="rope_freqs.weight")
    model = asm.finish(rope_freq_factors)
    model.weight_mix = dict(mix)
    return model


__all__ = ["load_gguf", "open_gguf", "read_metadata", "native_quantization", "unpermute_qk", "dequantized",
           "GGMLQuantizationType"]
