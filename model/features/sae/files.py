"""What the dictionary loaders read from disk, and the two checks made before anything is read: the directories
a path may be in, and the bytes its weights will take.

Allowed directories: a dictionary is read only from under the directories the server was told it may read, as vLLM
serves local media only from under `--allowed-local-media-path` (vllm/multimodal/utils.py, `MediaConnector.
_load_file_url`: the resolved path must have the allowed directory among its parents). Every file is resolved
(symlinks followed) before it is opened, so a link inside an allowed directory that points outside it is refused too.

Sizes: a safetensors file's header and an .npz member's .npy header give each tensor's shape without reading its
data; `check_bytes` refuses a dictionary whose tensors, at the dtype they will be served in, exceed the bound.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from model.features.sae.dictionary import DictionaryError


def allowed_path(path: str | os.PathLike, allowed: list[str | os.PathLike] | None) -> Path:
    """`path` resolved, if it lies under one of the `allowed` directories (resolved too); else DictionaryError
    ("path"). An empty or None `allowed` means loading from disk is off."""
    if not allowed:
        raise DictionaryError("path", "loading dictionaries from disk is off: no directory is allowed")
    try:
        resolved = Path(path).resolve(strict=True)
    except (OSError, RuntimeError):
        raise DictionaryError("path", f"{os.fspath(path)!r} does not exist") from None
    roots = []
    for a in allowed:
        try:
            roots.append(Path(a).resolve(strict=True))
        except (OSError, RuntimeError):
            continue
    if not any(resolved == r or r in resolved.parents for r in roots):
        raise DictionaryError("path", f"{os.fspath(path)!r} is not under an allowed directory "
                                      f"({', '.join(map(str, roots)) or 'none exists'})")
    return resolved


class Reader:
    """Opens files under `root` (a directory already allowed), each checked against `allowed` again after
    resolving, so no symlink leads out of them."""

    def __init__(self, root: Path, allowed: list | None):
        self.root, self.allowed = root, allowed

    def file(self, *names: str) -> Path | None:
        """The first of `names` (relative to root) that exists, allowed; None if none exists."""
        for name in names:
            p = self.root / name
            if p.exists() or p.is_symlink():
                return allowed_path(p, self.allowed) if self.allowed is not None else p.resolve()
        return None

    def json(self, name: str) -> dict:
        p = self.file(name)
        try:
            data = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DictionaryError(name, f"not readable JSON: {e}") from None
        if not isinstance(data, dict):
            raise DictionaryError(name, "expected a JSON object")
        return data


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in a .safetensors or .npz file, from its headers alone."""
    try:
        if path.suffix == ".npz":
            shapes = {}
            with zipfile.ZipFile(path) as z:
                for info in z.infolist():
                    with z.open(info) as f:
                        version = np.lib.format.read_magic(f)  # the .npy header (numpy's NEP 1 format)
                        header = np.lib.format.read_array_header_1_0 if version == (1, 0) \
                            else np.lib.format.read_array_header_2_0
                        shape, _, _ = header(f)
                    shapes[info.filename.removesuffix(".npy")] = tuple(shape)
            return shapes
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # a truncated or foreign file: safetensors and zipfile raise their own types
        raise DictionaryError(path.name, f"not a readable {path.suffix[1:]} file: {e}") from None


def check_bytes(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, max_bytes: int | None, name: str) -> int:
    """The bytes these tensors take at `dtype`; DictionaryError ("max_bytes") past the bound."""
    total = sum(math.prod(s) for s in shapes.values()) * torch.empty((), dtype=dtype).element_size()
    if max_bytes is not None and total > max_bytes:
        raise DictionaryError("max_bytes", f"{name} needs {total} bytes as {str(dtype).removeprefix('torch.')}, "
                                           f"over the bound of {max_bytes}")
    return total


def read_tensors(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of a .safetensors or .npz file, as `dtype` on the CPU."""
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as data:
                return {k: torch.from_numpy(np.ascontiguousarray(data[k])).to(dtype) for k in data.files}
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k).to(dtype) for k in f.keys()}  # noqa: SIM118
    except DictionaryError:
        raise
    except Exception as e:
        raise DictionaryError(path.name, f"not readable: {e}") from None


def need(tensors: dict[str, torch.Tensor], *names: str, file: str) -> list[torch.Tensor]:
    """The tensors named, DictionaryError naming the first one `file` lacks."""
    for n in names:
        if n not in tensors:
            raise DictionaryError(n, f"missing from {file} (it has {sorted(tensors)})")
    return [tensors[n] for n in names]
