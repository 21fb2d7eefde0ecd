"""The `interventions` and `return_hidden_states` request fields -> the engine's `Intervention`s and
`HiddenStateRead`, with named vectors resolved from the store, and the hidden states' JSON encoding.

Every client mistake is a 400 envelope naming the field (`interventions[2].vector`): a width that is not the
model's, a layer outside it, an unknown vector name or a layer the named vector lacks, NaN (refused by the schema).
"""

from __future__ import annotations

import base64

import numpy as np
import torch

from model.engine import HiddenStates
from model.interventions import HiddenStateRead, Intervention, validate_all
from service.common.errors import APIError
from service.api.openai.schemas import HiddenStatesOptions, InterventionItem
from service.microscope.vectors import VectorStore


def _error(message: str) -> APIError:
    """A ValueError's message ("interventions[1].dims: ...") as a 400 naming that field."""
    param = message.split(":", 1)[0] if ":" in message else "interventions"
    return APIError(400, message, param=param, code="invalid_intervention")


def to_interventions(items: list[InterventionItem] | None, store: VectorStore, n_layers: int, dim: int,
                     field: str = "interventions") -> list[Intervention] | None:
    """Expand each item over its layers (a named vector without `layer`: every layer it has), resolve names, and
    validate against the model; None when there are none."""
    if not items:
        return None
    out: list[Intervention] = []
    names: list[str] = []  # the request item each engine item came from, for errors
    for i, it in enumerate(items):
        where = f"{field}[{i}]"
        named = it.vector.name if it.vector is not None and not isinstance(it.vector, list) else None
        stored = None
        if named is not None:
            stored = store.get(named)
            if stored is None:
                raise APIError(400, f"{where}.vector: no stored vector named {named!r} (GET /v1/vectors lists them)",
                               param=f"{where}.vector", code="vector_not_found")
        layers = it.layer if isinstance(it.layer, list) else ([it.layer] if it.layer is not None else None)
        if layers is None:
            if stored is None:
                raise APIError(400, f"{where}.layer: give the block index (or indices) to edit", param=f"{where}.layer",
                               code="invalid_intervention")
            layers = sorted(stored.layers)
        if len(set(layers)) != len(layers):
            raise APIError(400, f"{where}.layer: must not repeat a block", param=f"{where}.layer", code="invalid_intervention")
        positions = it.positions if isinstance(it.positions, str) else tuple(it.positions)
        for layer in layers:
            vector = None
            if isinstance(it.vector, list):
                vector = torch.tensor(it.vector, dtype=torch.float32)
            elif stored is not None:
                if layer not in stored.layers:
                    raise APIError(400, f"{where}.vector: {named!r} has no direction for block {layer} (it has "
                                        f"{sorted(stored.layers)})", param=f"{where}.vector", code="invalid_intervention")
                vector = stored.layers[layer]
            out.append(Intervention(
                layer=layer, site=it.site, op=it.op, positions=positions, vector=vector, scale=it.scale,
                dims=tuple(it.dims or ()), values=tuple(it.values or ()), factor=it.factor))
            names.append(where)
    try:
        validate_all(out, n_layers, dim, names)
    except ValueError as e:
        raise _error(str(e)) from None
    return out


def to_read(opts: HiddenStatesOptions | None, n_layers: int, field: str = "return_hidden_states") -> HiddenStateRead | None:
    if opts is None:
        return None
    read = HiddenStateRead(list(opts.layers), opts.positions if isinstance(opts.positions, str) else tuple(opts.positions))
    try:
        read.validate(n_layers, field)
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split(":", 1)[0], code="invalid_value") from None
    return read


def encode_hidden(hs: HiddenStates | None, dtype: str) -> dict | None:
    """Hidden states as JSON: values (n_positions, n_layers, D), little-endian float32 (or float16) in base64."""
    if hs is None:
        return None
    arr = np.ascontiguousarray(hs.values.numpy().astype("<f4" if dtype == "float32" else "<f2"))
    return {"layers": hs.layers, "positions": hs.positions, "shape": list(arr.shape), "dtype": dtype,
            "encoding": "base64", "data": base64.b64encode(arr.tobytes()).decode("ascii")}


def merge_hidden(parts: list[HiddenStates]) -> HiddenStates | None:
    """A choice's hidden-state deltas, in order, as one."""
    if not parts:
        return None
    return HiddenStates(parts[0].layers, [p for h in parts for p in h.positions], torch.cat([h.values for h in parts]))
