"""The models a router serves: each `--model` given, and every GGUF file and HF folder (a folder with a config.json)
in `--models-dir`, named as a single server names its checkpoint (`checkpoint_name`: a GGUF file's stem, a folder's
name), with what it will take in memory once its process has loaded it: the weights as served (the loaders' own
sizing from the files' headers, `served_weight_bytes`) plus the KV pool (`--kv-cache-bytes`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from model.dtypes import DTYPES
from model.loaders import CheckpointError, default_model_path, served_weight_bytes
from model.loaders.hub import checkpoint_name, resolve_checkpoint
from service.config import Settings

log = logging.getLogger("llamascope.router")


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    path: Path
    weight_bytes: int  # served weights, estimated from the files' headers (0 when it cannot be read)
    kv_bytes: int  # the KV pool every child allocates (--kv-cache-bytes)

    @property
    def memory_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


def find_models(models_dir: Path) -> list[Path]:
    """GGUF files and HF folders directly in `models_dir`, by name. A multi-part GGUF (`-00001-of-00003.gguf`) is
    left out: the loaders read one file."""
    if not models_dir.is_dir():
        raise ValueError(f"--models-dir {str(models_dir)!r} is not a directory")
    found = []
    for p in sorted(models_dir.iterdir()):
        if p.is_file() and p.suffix == ".gguf" and "-of-" not in p.stem:
            found.append(p)
        elif p.is_dir() and (p / "config.json").is_file():
            found.append(p)
    return found


def weight_bytes(path: Path, settings: Settings) -> int:
    """The served weights' bytes on CPU under the child's --quantization and --dtype, as the child's own check before
    loading computes them (model/loaders/checkpoint.py); on a GPU the weights leave host memory, so 0."""
    device = settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type != "cpu":
        return 0
    dtype = DTYPES["float32" if settings.dtype == "auto" else settings.dtype]
    try:
        return served_weight_bytes(path, settings.quantization, dtype)
    except (CheckpointError, OSError, ValueError, KeyError) as e:  # the child's load will say what is wrong
        log.warning("cannot size %s from its headers (%s); counting its files' size", path, e)
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        return sum(f.stat().st_size for f in files)


def build_catalog(models: list[str], models_dir: str | None, settings: Settings) -> dict[str, CatalogEntry]:
    """Name -> entry, in the order given (`--model`s first, then the directory's); two models of one name are an
    error naming both paths (a request names a model by it)."""
    paths = [resolve_checkpoint(m) if m else default_model_path() for m in models]
    if models_dir:
        paths += [p for p in find_models(Path(models_dir)) if p.resolve() not in {q.resolve() for q in paths}]
    if not paths:
        raise ValueError(f"no GGUF file or HF folder (with config.json) in --models-dir {models_dir!r}")
    catalog: dict[str, CatalogEntry] = {}
    for p in paths:
        name = checkpoint_name(p)
        if name in catalog:
            raise ValueError(f"two models are named {name!r}: {catalog[name].path} and {p}; rename one")
        catalog[name] = CatalogEntry(name, p, weight_bytes(p, settings), settings.kv_cache_bytes)
    return catalog
