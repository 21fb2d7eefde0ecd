"""Stored vectors: named per-block directions of the residual stream that interventions refer to by name
(`"vector": {"name": ...}`), built from contrastive prompt pairs (POST /v1/vectors) or loaded from llama.cpp
control-vector files (`--control-vector FILE[:SCALE]`).

Contrastive mean difference (llama.cpp's `cvector-generator --method mean`, tools/cvector-generator/mean.hpp;
contrastive activation addition, Rimsky et al. 2024, "Steering Llama 2 via Contrastive Activation Addition"): for
each chosen block l, the mean over pairs of h_l(positive) - h_l(negative), h_l the block's output at the prompt's
last token ("last", CAA's choice) or averaged over its tokens ("mean"); optionally scaled to unit norm, as
llama.cpp's mean method does.

A control-vector GGUF holds 1-D float32 tensors `direction.N`, N >= 1: llama.cpp's loader
(common/common.cpp, `common_control_vector_load_one`) stores direction.N for layer N, never layer 0, and
`llama_adapter_cvec::apply` (src/llama-adapter.cpp) hands it to `build_cvec(cur, il)` with il = N, which the
LLaMA graph (src/models/llama.cpp) calls after block il's feed-forward residual add: direction.N is added to the
output of block N (0-indexed), our `block_output` site of layer N. (cvector-generator itself writes the difference
it measured at block N-1's output as direction.N: a file it made applies one block later than it measured.)
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass
class StoredVector:
    name: str
    layers: dict[int, Tensor]  # block -> (D,) float32
    source: str  # "contrastive" or "gguf"
    created: int = field(default_factory=lambda: int(time.time()))
    details: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {"object": "vector", "name": self.name, "site": "block_output", "layers": sorted(self.layers),
                "dim": next(iter(self.layers.values())).shape[0], "source": self.source, "created": self.created,
                "norms": {str(l): round(float(v.norm()), 6) for l, v in sorted(self.layers.items())}, **self.details}


class VectorStore:
    """Named vectors, shared by every request; a lock because routes (event loop) and start-up (loader thread) both
    write it."""

    def __init__(self, max_vectors: int) -> None:
        self.max_vectors = max_vectors
        self._vectors: dict[str, StoredVector] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> StoredVector | None:
        with self._lock:
            return self._vectors.get(name)

    def list(self) -> list[StoredVector]:
        with self._lock:
            return sorted(self._vectors.values(), key=lambda v: v.name)

    def add(self, vector: StoredVector) -> None:
        """KeyError when the name is taken, OverflowError when the store is full."""
        with self._lock:
            if vector.name in self._vectors:
                raise KeyError(vector.name)
            if len(self._vectors) >= self.max_vectors:
                raise OverflowError(f"the store holds its limit of {self.max_vectors} vectors (--max-vectors)")
            self._vectors[vector.name] = vector

    def delete(self, name: str) -> bool:
        with self._lock:
            return self._vectors.pop(name, None) is not None


def contrastive_mean(positive: list[dict[int, Tensor]], negative: list[dict[int, Tensor]], normalize: bool) -> dict[int, Tensor]:
    """Per pair, per block: the prompts' representations (D,) -> per block the mean difference (D,) float32."""
    out = {}
    for layer in positive[0]:
        diff = torch.stack([p[layer].double() - n[layer].double() for p, n in zip(positive, negative)]).mean(0)
        if normalize:
            norm = diff.norm()
            diff = diff / norm if norm > 0 else diff
        out[layer] = diff.float()
    return out


def control_vector_specs(setting: str | None) -> list[str]:
    """`--control-vector`'s value: one or more FILE[:SCALE], comma-separated."""
    return [p.strip() for p in (setting or "").split(",") if p.strip()]


def load_control_vector(spec: str, n_layers: int, dim: int) -> StoredVector:
    """`FILE[:SCALE]` -> the stored vector named after the file (its stem), each direction.N times SCALE at block N.
    ValueError naming the file for anything llama.cpp would refuse too (and for blocks this model lacks)."""
    path, scale = spec, 1.0
    head, sep, tail = spec.rpartition(":")
    if sep and head:
        try:
            path, scale = head, float(tail)
        except ValueError:
            path, scale = spec, 1.0
    from gguf import GGMLQuantizationType, GGUFReader

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"control vector {path}: no such file")
    reader = GGUFReader(str(file))
    layers: dict[int, Tensor] = {}
    for t in reader.tensors:
        m = re.fullmatch(r"direction\.(\d+)", t.name)
        if m is None or int(m.group(1)) == 0:
            raise ValueError(f"control vector {path}: tensor {t.name!r} is not direction.N with N >= 1")
        if t.tensor_type != GGMLQuantizationType.F32 or len(t.shape) != 1:
            raise ValueError(f"control vector {path}: {t.name} must be a 1-D float32 tensor")
        if int(t.n_elements) != dim:
            raise ValueError(f"control vector {path}: {t.name} has {int(t.n_elements)} values; the model's width is {dim}")
        layer = int(m.group(1))
        if layer >= n_layers:
            raise ValueError(f"control vector {path}: {t.name} is beyond the model's {n_layers} blocks")
        v = torch.from_numpy(t.data.copy()).float().reshape(dim) * scale
        layers[layer] = layers[layer] + v if layer in layers else v  # repeated directions add up (llama.cpp)
    if not layers:
        raise ValueError(f"control vector {path}: no direction tensors")
    name = file.stem
    if not NAME.match(name):
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64] or "control_vector"
    return StoredVector(name, layers, "gguf", details={"file": str(file), "scale": scale})
