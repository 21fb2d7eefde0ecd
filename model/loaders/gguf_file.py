"""GGUF files (ggml's single-file format): metadata -> ModelConfig, tensors dequantized to the requested dtype.

Spec: ggml `docs/gguf.md`. Read with the `gguf` package (memory-mapped); dequantization of F32, F16, BF16,
Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants and the IQ types is the package's numpy reference code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from model.config import ModelConfig
from model.loaders.assemble import LAYER_NAMES, ModelAssembler, NameMap
from model.loaders.config_keys import config_from_gguf
from model.loaders.errors import CheckpointError
from model.quantize import Int4Linear, Int8Linear, Quantization, QuantLinear, gguf_q4_groups, quantize_model
from model.loaders.shard import ShardFor, WeightShard
from model.transformer import Transformer

gguf_to_ours = NameMap(
    top={"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight", "output.weight": "output.weight"},
    layer_re=r"blk\.(\d+)\.(\w+)\.weight",
    layer={gguf: ours for ours, _, gguf in LAYER_NAMES},
)


class _CheckedReader(GGUFReader):
    """GGUFReader that, before viewing tensor data, checks each tensor's extent against the file's size, so a
    truncated file is reported by tensor name and byte counts rather than as a numpy reshape error."""

    def __init__(self, path: Path) -> None:
        self._path = str(path)
        super().__init__(path)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset = field.parts
            try:
                qtype = GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise CheckpointError(f"unknown ggml tensor type id {int(raw_dtype[0])}", path=self._path, tensor=bytes(name_data).decode(errors="replace")) from None
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(dims)) * type_size // block_size
            end = int(start_offs + offset[0]) + n_bytes
            if end > size:
                raise CheckpointError(
                    f"file is truncated: tensor data ends at byte {end} ({qtype.name}, shape {dims.tolist()}, "
                    f"{n_bytes} bytes) but the file has {size} bytes",
                    path=self._path,
                    tensor=bytes(name_data).decode(errors="replace"),
                )
        super()._build_tensors(start_offs, fields)


def open_gguf(path: str | Path) -> GGUFReader:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError("no such file", path=str(path))
    try:
        return _CheckedReader(path)
    except CheckpointError:
        raise
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on short or foreign files
        raise CheckpointError(f"cannot read GGUF (truncated or not a GGUF file?): {type(e).__name__}: {e}", path=str(path)) from None


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    return {key: field.contents() for key, field in reader.fields.items()}


# The file's own block formats that the native kernels multiply as they are (model/quantize.py's int4 and int8).
NATIVE_FORMATS = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}


def native_quantization(reader: GGUFReader) -> str:
    """The quantization that serves this file's block matrices in their own format: "int4" for Q4_0 / Q4_1, "int8"
    for Q8_0 (by the parameters of the blocks' 2-D weights, so a file of mixed types goes by its main one), else
    "none" (float, K-quants and other types: dequantized, as before)."""
    params: dict[str, int] = {}
    for t in reader.tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            kind = NATIVE_FORMATS.get(t.tensor_type.name, "none")
            params[kind] = params.get(kind, 0) + int(np.prod(t.shape))
    return max(params, key=params.get) if params else "none"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the row permutation llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`) applies to
    wq/wk so ggml's interleaved RoPE (pairs 2i, 2i+1) matches HF's rotate-half (pairs i, i+E/2).
    w (n_head * E, D) -> (n_head * E, D). transformers' `reverse_permute_weights` is the same map."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(reader_tensor: Any, path: str, rows: slice = slice(None)) -> np.ndarray:
    """`rows`: only those rows (the outermost dim: ggml blocks run along the innermost one, so whole rows of a
    quantized tensor are read and dequantized without the rest)."""
    qtype = reader_tensor.tensor_type
    try:
        data = dequantize(reader_tensor.data[rows], qtype)
    except NotImplementedError:
        raise CheckpointError(
            f"unsupported GGUF tensor type {qtype.name}; supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
            "Q2_K..Q6_K, IQ*, TQ*",
            path=path,
            tensor=reader_tensor.name,
        ) from None
    shape = tuple(int(d) for d in reversed(reader_tensor.shape.tolist()))  # ggml lists ne0 (innermost) first
    shape = (len(range(*rows.indices(shape[0]))), *shape[1:])
    try:
        return np.asarray(data, dtype=np.float32).reshape(shape)
    except ValueError:
        raise CheckpointError(f"data of {data.size} values does not fill shape {list(shape)}", path=path, tensor=reader_tensor.name) from None


def load_gguf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    reader: GGUFReader | None = None,
    meta: dict[str, Any] | None = None,
    quantization: Quantization = "none",
    shard: ShardFor | None = None,
) -> Transformer:
    """`reader`/`meta`: an already opened file and its metadata, so the caller's tokenizer shares one read.
    `quantization`: weight-only int8/int4 (model/quantize.py); Q4_0/Q4_1 matrices keep their own blocks with int4,
    Q8_0 ones with int8, and a Q8_0 LM head (or tied embedding) with either.
    `shard`: load only that tensor-parallel rank's slices (not with quantization). Row slices (wq/wk/wv/w1/w3) are cut
    from the quantized data before dequantizing; column slices (wo/w2) cut across ggml blocks, so those tensors are
    dequantized whole, one at a time, and sliced at once (a transient float32 copy of one tensor, never of the
    model)."""
    path = str(path)
    reader = reader or open_gguf(path)
    meta = meta if meta is not None else read_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = config_from_gguf(meta, source=path).replace(tie_embeddings="output.weight" not in names)
    plan = shard(config) if shard is not None else None
    asm = ModelAssembler(config, path, dtype, device, f"load {Path(path).name}", plan)
    rope_freq_factors = None
    prequantized: dict[str, QuantLinear] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            # Llama 3.1 scaling as per-frequency divisors of inv_freq (llama.cpp `generate_extra_tensors`).
            rope_freq_factors = torch.from_numpy(_dequantize(t, path).copy())
            continue
        ours = gguf_to_ours(t.name)
        if ours is None:
            raise CheckpointError("unknown tensor name for a llama GGUF", path=path, tensor=t.name)
        cut = plan.slice_of(ours) if plan is not None else None
        w = _dequantize(t, path, slice(cut[1], cut[2]) if cut and cut[0] == 0 else slice(None))
        # llama.cpp's q/k permutation moves rows within a head only, so un-permuting a slice of whole heads with
        # the slice's head count is the same as un-permuting the whole tensor and then slicing it
        # (asm.config: this rank's head counts when sharded)
        n_head = (asm.config.n_heads if t.name.endswith("attn_q.weight")
                  else asm.config.n_kv_heads if t.name.endswith("attn_k.weight") else None)
        if n_head is not None:
            w = unpermute_qk(w, n_head)
        if cut and cut[0] == 1:
            w = np.ascontiguousarray(w[:, cut[1] : cut[2]])  # a copy: the whole dequantized tensor is freed
        layer = _native_blocks(t, ours, quantization, w.shape, n_head, config.tie_embeddings) if plan is None else None
        if layer is not None:
            prequantized[layer[0]] = layer[1]
        if not w.flags.writeable or not w.flags.c_contiguous:  # F32 data is a read-only view of the memory map
            w = np.ascontiguousarray(w).copy()
        asm.add(ours, torch.from_numpy(w), t.name)
    if rope_freq_factors is not None and rope_freq_factors.shape != (config.head_dim // 2,):
        raise CheckpointError(f"expected shape [{config.head_dim // 2}], found {list(rope_freq_factors.shape)}", path=path, tensor="rope_freqs.weight")
    return quantize_model(asm.finish(rope_freq_factors), quantization, prequantized)


def _native_blocks(t: Any, ours: str, quantization: str, shape: tuple[int, ...], n_head: int | None,
                   tied: bool) -> tuple[str, QuantLinear] | None:
    """A matrix whose blocks the quantized model keeps as they are: (our module name, layer), or None. The blocks'
    Q4_0 / Q4_1 matrices with int4, Q8_0 ones with int8; and the LM head (`output`, or the tied embedding) in either
    mode when it is Q8_0 (`quantize_model` keeps the head in int8 blocks), rows un-permuted like the float weight."""
    kind = NATIVE_FORMATS.get(t.tensor_type.name)
    if quantization == "none" or kind is None or len(shape) != 2:
        return None
    head = ours == "output.weight" or (tied and ours == "tok_embeddings.weight")
    if ours.startswith("layers.") and kind == quantization:
        name = ours.removesuffix(".weight")
    elif head and kind == "int8":
        name = "output"
    else:
        return None
    if kind == "int8":
        return name, Int8Linear.from_gguf_blocks(t.data, shape, n_head)
    q, d, m = gguf_q4_groups(t.data, t.tensor_type.name, shape)
    if n_head is not None:
        q, d, m = (unpermute_qk(a, n_head) for a in (q, d, m))
    return name, Int4Linear(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (q, d, m)))


__all__ = ["load_gguf", "open_gguf", "read_metadata", "native_quantization", "unpermute_qk", "GGMLQuantizationType"]
