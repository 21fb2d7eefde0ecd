"""The `interventions` and `return_hidden_states` request fields -> the engine's `Intervention`s and
`HiddenStateRead`, with named vectors resolved from the store.

Every client mistake is a 400 envelope naming the field (`interventions[2].vector`): a width that is not the
model's, a layer outside it, an unknown vector name or a layer the named vector lacks, NaN (refused by the schema).
"""

from __future__ import annotations

import torch

from model.interventions import HiddenStateRead, Intervention, validate_all
from service.common.errors import APIError
from service.microscope.schemas import HiddenStatesOptions, InterventionItem
from service.microscope.vectors import VectorStore


def _error(message: str) -> APIError:
    """A ValueError's message ("interventions[1].dims: ...") as a 400 naming that field."""
    param = message.split(":", 1)[0] if ":" in message else "interventions"
    return APIError(400, message, param=param, code="invalid_intervention")


def to_interventions(items: list[InterventionItem] | None, store: VectorStore, n_layers: int,
                     dim: int) -> list[Intervention] | None:
    """Expand each item over its layers (a named vector without `layer`: every layer it has), resolve names, and
    validate against the model; None when there are none."""
    return to_edits(items, None, store, n_layers, dim)[0]


def to_edits(items: list[InterventionItem] | None, hidden: HiddenStatesOptions | None, store: VectorStore,
             n_layers: int, dim: int) -> tuple[list[Intervention] | None, HiddenStateRead | None]:
    """A request's `interventions` (as `to_interventions`) and `return_hidden_states`: both read, then both
    validated against the model, the interventions first."""
    out, names = _expand(items, store)
    read = None if hidden is None else HiddenStateRead(
        list(hidden.layers), hidden.positions if isinstance(hidden.positions, str) else tuple(hidden.positions))
    if out is not None:
        try:
            validate_all(out, n_layers, dim, names)
        except ValueError as e:
            raise _error(str(e)) from None
    if read is not None:
        try:
            read.validate(n_layers, "return_hidden_states")
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(":", 1)[0], code="invalid_value") from None
    return out, read


def _expand(items: list[InterventionItem] | None, store: VectorStore,
            field: str = "interventions") -> tuple[list[Intervention] | None, list[str]]:
    """The engine's items before validation, and the request item each came from (`interventions[2]`)."""
    if not items:
        return None, []
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
    return out, names
