"""Hugging Face checkpoint directories: config.json + model.safetensors, or shards listed in
model.safetensors.index.json. Tensors are read one at a time (model/loaders/safetensors_file.py), cast on the way,
and with `quantization` rounded into their served format at once: a bfloat16 8B checkpoint never exists in float32.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from model.config import ModelConfig
from model.loaders.assemble import ModelAssembler, NameMap, fused_parts, layer_names, quantized_kind
from model.loaders.memory import served_bytes
from model.loaders.config_keys import config_from_hf
from model.loaders.errors import CheckpointError
from model.loaders.families import FAMILIES, Family
from model.loaders.safetensors_file import SafetensorsFile
from model.loaders.shard import ShardFor, WeightShard
from model.quantize import Quantization
from model.transformer import Transformer

def hf_names(family: Family) -> NameMap:
    """transformers' <Family>ForCausalLM names -> ours (Meta's llama names)."""
    return NameMap(
        top={"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "output.weight"},
        layer_re=r"model\.layers\.(\d+)\.(.+)",
        layer={hf: ours for ours, hf, _ in layer_names(family) if hf is not None},
    )


hf_to_ours = hf_names(FAMILIES["llama"])  # LlamaForCausalLM's
# Buffers some older exports saved; recomputed here from the config.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def read_hf_config(directory: Path) -> ModelConfig:
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError("no config.json: not a Hugging Face model directory", path=str(directory))
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"invalid JSON: {e}", path=str(cfg_path)) from None
    return config_from_hf(cfg, source=str(cfg_path))


def _weight_files(directory: Path) -> dict[str, list[str] | None]:
    """safetensors file -> tensor names it should hold (None: whatever it holds)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"invalid index ({e})", path=str(index)) from None
        files: dict[str, list[str] | None] = {}
        for tensor, file in weight_map.items():
            files.setdefault(file, []).append(tensor)  # type: ignore[union-attr]
        return files
    if (directory / "model.safetensors").is_file():
        return {"model.safetensors": None}
    found = sorted(p.name for p in directory.iterdir())
    raise CheckpointError(
        f"no model.safetensors or model.safetensors.index.json (found: {', '.join(found) or 'nothing'}); "
        "PyTorch .bin checkpoints are not loaded (convert them to safetensors)",
        path=str(directory),
    )


def _read(f: SafetensorsFile, name: str, ours: str, plan: WeightShard | None) -> torch.Tensor:
    s = plan.slice_of(ours) if plan is not None else None
    if s is None:
        return f.read(name)
    dim, start, stop = s
    if dim == 0:
        return f.read(name, (start, stop))
    return f.read(name)[:, start:stop].contiguous()  # a column slice: the whole tensor, one at a time


def load_hf(
    directory: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", shard: ShardFor | None = None,
    quantization: Quantization = "none",
) -> Transformer:
    """`shard`: load only that tensor-parallel rank's slices (row slices read alone, column slices cut from the one
    tensor). `quantization` "int8" / "int4": each matrix quantized as it is read (`ModelAssembler.add`)."""
    directory = Path(directory)
    config = read_hf_config(directory)
    to_ours = hf_names(FAMILIES[config.architecture])
    plan = shard(config) if shard is not None else None
    asm = ModelAssembler(config, str(directory), dtype, device, f"load {directory.name}", plan,
                         quantization if plan is None else "none")
    for file, names in _weight_files(directory).items():
        path = directory / file
        if not path.is_file():
            raise CheckpointError("shard listed in model.safetensors.index.json is missing", path=str(path))
        with SafetensorsFile(path) as f:
            present = set(f.keys())
            for name in names if names is not None else sorted(present):
                if name not in present:
                    raise CheckpointError("tensor listed in the index is not in this shard", path=str(path), tensor=name)
                ours = to_ours(name)
                if ours is None:
                    if _IGNORED.fullmatch(name):
                        continue
                    raise CheckpointError(f"unknown tensor name for a {config.architecture} checkpoint", path=str(path),
                                          tensor=name)
                if ours == "output.weight" and config.tie_embeddings:
                    continue  # tied: the embedding serves as the head
                parts = fused_parts(ours) if plan is not None else None
                if parts is not None:  # a fused matrix (Phi-3) under tensor parallelism: each part's own slice
                    H, K, E = config.n_heads, config.n_kv_heads, config.head_dim
                    whole = f.read(name)
                    sizes = [H * E, K * E, K * E] if "wqkv" in ours else [config.hidden_dim] * 2
                    for part, piece in zip(parts, whole.split(sizes)):
                        cut = plan.slice_of(part)
                        piece = piece if cut is None else piece.narrow(cut[0], cut[1], cut[2] - cut[1])
                        asm.add(part, piece.contiguous(), name, str(path))
                    continue
                asm.add(ours, _read(f, name, ours, plan), name, str(path))
    return asm.finish()


def served_bytes_hf(directory: Path, quantization: str, dtype: torch.dtype) -> int:
    """What the checkpoint's weights will take once served, from the files' headers alone (`memory.served_bytes`)."""
    config = read_hf_config(directory)
    to_ours = hf_names(FAMILIES[config.architecture])
    fb, total = torch.empty((), dtype=dtype).element_size(), 0
    for file in _weight_files(directory):
        if not (directory / file).is_file():
            continue
        with SafetensorsFile(directory / file) as f:
            for name in f.keys():
                ours, shape = to_ours(name), f.shape(name)
                if ours is None or (ours == "output.weight" and config.tie_embeddings):
                    continue
                rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0] if shape else 1)
                total += served_bytes(quantized_kind(quantization, ours, rows, cols) or "float", rows, cols, fb)
    return total
