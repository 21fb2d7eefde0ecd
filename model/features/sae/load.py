"""`load_dictionary`: one entry point for every dictionary format on disk, with the checks a server makes before a
client's path is read: the allowed directories, the memory bound, and the model the dictionary must fit.

A folder's files say its format:
    cfg.json + sae_weights.safetensors       SAELens (saelens.py)
    cfg.json + sae.safetensors               EleutherAI sparsify (sparsify.py)
    hyperparams.json + [checkpoints/]final.safetensors   Llama Scope (scope.py)
    params.npz | params.safetensors          Gemma Scope 1 | 2 (scope.py)
A sparsify run's top folder (one sub-folder per module) names its sub-folders in the error.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from model.features.sae.dictionary import Dictionary, DictionaryError
from model.features.sae.files import Reader, allowed_path
from model.features.sae.saelens import is_saelens, read_saelens
from model.features.sae.scope import is_gemma_scope, is_llama_scope, read_gemma_scope, read_llama_scope
from model.features.sae.sparsify import is_sparsify, read_sparsify

FORMATS = ("saelens", "sparsify", "llama_scope", "gemma_scope")


def detect_format(root: Path) -> str:
    if is_saelens(root):
        return "saelens"
    if is_sparsify(root):
        return "sparsify"
    if is_llama_scope(root):
        return "llama_scope"
    if is_gemma_scope(root):
        return "gemma_scope"
    subs = sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "cfg.json").exists()) if root.is_dir() else []
    hint = f"; it holds dictionaries in {', '.join(subs[:8])}: name one" if subs else ""
    raise DictionaryError("path", f"{root} holds no dictionary of a known format (SAELens cfg.json + "
                                  f"sae_weights.safetensors, sparsify cfg.json + sae.safetensors, Llama Scope "
                                  f"hyperparams.json, Gemma Scope params.npz / params.safetensors){hint}")


def load_dictionary(path: str | os.PathLike, *, allowed: list[str | os.PathLike] | None = None,
                    max_bytes: int | None = None, config=None, dtype: torch.dtype = torch.float32,
                    format: str | None = None, hook_name: str | None = None, hook_name_out: str | None = None,
                    norm_scaling_factor: float | None = None) -> Dictionary:
    """A dictionary folder -> Dictionary, its tensors as `dtype` on the CPU.

    `allowed`: the directories it may be read from (None: no check, for the repository's own files and tests; a
    server passes its list, and an empty list turns loading off). `max_bytes`: refused before its tensors are read
    when they would take more at `dtype`. `config` (a ModelConfig): refused unless it fits that model (layers, the
    widths of the sites it reads and writes). `format`: one of FORMATS, else detected. `hook_name` /
    `hook_name_out`: where it reads / writes, over what its files say (a TransformerLens name or an HF module path).
    `norm_scaling_factor`: a SAELens "expected_average_only_in" dictionary's factor, folded into its weights.
    Every refusal is a DictionaryError (a ValueError) naming the field."""
    root = allowed_path(path, allowed) if allowed is not None else Path(path).resolve()
    if root.is_file():
        root = root.parent  # a path to one of its files names its folder
    if not root.is_dir():
        raise DictionaryError("path", f"{os.fspath(path)!r} is not a directory")
    fmt = format or detect_format(root)
    reader = Reader(root, allowed)
    if fmt == "saelens":
        d = read_saelens(reader, dtype, max_bytes, hook_name, hook_name_out, norm_scaling_factor)
    elif fmt == "sparsify":
        d = read_sparsify(reader, dtype, max_bytes, hook_name, hook_name_out)
    elif fmt == "llama_scope":
        d = read_llama_scope(reader, dtype, max_bytes, hook_name, hook_name_out)
    elif fmt == "gemma_scope":
        d = read_gemma_scope(reader, dtype, max_bytes, hook_name, hook_name_out)
    else:
        raise DictionaryError("format", f"unknown {fmt!r}; choose from {list(FORMATS)}")
    if config is not None:
        d.check_model(config)
    return d
