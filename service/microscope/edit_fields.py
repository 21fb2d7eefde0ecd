"""The `interventions` and `return_hidden_states` request fields -> the engine's `Intervention`s and
`HiddenStateRead`, with named vectors resolved from the store and dictionaries' features from the server's
dictionaries (`state.saes`).

Every client mistake is a 400 envelope naming the field (`interventions[2].vector`): a width that is not the
model's, a layer outside it, an unknown vector name or a layer the named vector lacks, NaN (refused by the schema),
a hook the engine does not edit or read (`interventions[0].hook`), an unknown dictionary or feature
(`interventions[1].feature.sae`, `.feature.id`).

Places are `layer` + `site`, or `hook`: model/hook_names.py's `parse_hook` (TransformerLens names, HF module
paths). A `feature` item's place is its dictionary's: `add` puts scale x W_dec[F] at its `hook_out` (an ordinary
`add` with that vector), `clamp` holds the feature's activation at `value` at the site it reads
(model/features/sae/steer.py).
"""

from __future__ import annotations

import torch

from model.features.sae import DictionaryError, DictionaryStore, FeatureClamp
from model.hook_names import parse_hook
from model.interventions import EDIT_SITES, SITES, HiddenStateRead, Intervention, validate_all
from service.common.errors import APIError
from service.microscope.schemas import HiddenStatesOptions, InterventionItem
from service.microscope.vectors import VectorStore


def _error(message: str) -> APIError:
    """A ValueError's message ("interventions[1].dims: ...") as a 400 naming that field."""
    param = message.split(":", 1)[0] if ":" in message else "interventions"
    return APIError(400, message, param=param, code="invalid_intervention")


def _bad(param: str, why: str, code: str = "invalid_intervention") -> APIError:
    return APIError(400, f"{param}: {why}", param=param, code=code)


def to_interventions(items: list[InterventionItem] | None, store: VectorStore, n_layers: int,
                     dim: int, saes: DictionaryStore | None = None, config=None) -> list[Intervention] | None:
    """Expand each item over its layers (a named vector without `layer`: every layer it has), resolve names, and
    validate against the model; None when there are none. `saes`: the dictionaries `feature` items name; `config`
    (the ModelConfig): checks `hook` names against the model."""
    return to_edits(items, None, store, n_layers, dim, saes, config)[0]


def to_edits(items: list[InterventionItem] | None, hidden: HiddenStatesOptions | None, store: VectorStore,
             n_layers: int, dim: int, saes: DictionaryStore | None = None,
             config=None) -> tuple[list[Intervention] | None, HiddenStateRead | None]:
    """A request's `interventions` (as `to_interventions`) and `return_hidden_states`: both read, then both
    validated against the model, the interventions first."""
    out, names = _expand(items, store, saes, config)
    read = None
    if hidden is not None:
        layers, site = _read_place(hidden, config)
        read = HiddenStateRead(layers, hidden.positions if isinstance(hidden.positions, str) else tuple(hidden.positions),
                               (site,))
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


def _read_place(hidden: HiddenStatesOptions, config) -> tuple[list[int], str]:
    """`layers` + `site` (default block_output), or the blocks and the one site that `hooks` name."""
    if (hidden.layers is None) == (hidden.hooks is None):
        raise _bad("return_hidden_states.layers", "give the blocks as `layers` or as `hooks`, one of the two",
                   "invalid_value")
    if hidden.layers is not None:
        return list(hidden.layers), hidden.site or "block_output"
    if hidden.site is not None:
        raise _bad("return_hidden_states.site", "`hooks` name their site: leave out `site`", "invalid_value")
    layers, site = [], None
    for i, name in enumerate(hidden.hooks):
        where = f"return_hidden_states.hooks[{i}]"
        try:
            hook = parse_hook(name, config=config, where=where)
        except ValueError as e:
            raise APIError(400, str(e), param=where, code="invalid_value") from None
        if hook.site not in SITES:
            raise _bad(where, f"{name!r} is {hook.site} of block {hook.layer}, which this field does not return "
                              f"(it returns {list(SITES)})", "invalid_value")
        if site not in (None, hook.site):
            raise _bad(where, f"{name!r} is {hook.site} of block {hook.layer}; the hooks before it name {site}: "
                              "one request returns one site", "invalid_value")
        site = hook.site
        layers.append(hook.layer)
    return layers, site


def _place(it: InterventionItem, where: str, config) -> tuple[list[int] | None, str]:
    """The item's layers (None: not given) and site, from `layer` + `site` or from `hook`."""
    if it.hook is None:
        layers = it.layer if isinstance(it.layer, list) else ([it.layer] if it.layer is not None else None)
        return layers, it.site or "block_output"
    for name in ("layer", "site"):
        if getattr(it, name) is not None:
            raise _bad(f"{where}.{name}", "give the place as `hook` or as `layer` + `site`, not both")
    try:
        hook = parse_hook(it.hook, config=config, where=f"{where}.hook")
    except ValueError as e:
        raise _error(str(e)) from None
    if hook.site not in EDIT_SITES:
        raise _bad(f"{where}.hook", f"{it.hook!r} is {hook.site} of block {hook.layer}, which interventions do not "
                                    f"edit; they edit {list(EDIT_SITES)} (blocks.L.hook_resid_post, hook_attn_out, "
                                    "hook_resid_mid, hook_mlp_out, model.layers.L[.self_attn | .mlp], "
                                    "model.layers.L.mlp.input)")
    return [hook.layer], hook.site


def _feature(it: InterventionItem, where: str, saes: DictionaryStore | None) -> Intervention:
    """A `feature` item -> its Intervention at the dictionary's hook (add: a vector; clamp: a FeatureClamp)."""
    for name in ("layer", "site", "hook", "vector"):
        if getattr(it, name) is not None:
            raise _bad(f"{where}.{name}", "a feature item acts where its dictionary does: leave out layer, site, "
                                          "hook and vector")
    if it.op not in ("add", "clamp"):
        raise _bad(f"{where}.op", f"a feature is steered by 'add' or 'clamp', not {it.op!r}")
    if saes is None:
        raise _bad(f"{where}.feature.sae", "this server serves no dictionaries (--sae)", "sae_not_found")
    try:
        d = saes.get(it.feature.sae)
    except DictionaryError as e:
        raise _bad(f"{where}.feature.sae", str(e).removeprefix("sae: "), "sae_not_found") from None
    F = it.feature.id
    if F >= d.d_sae:
        raise _bad(f"{where}.feature.id", f"{F} is out of range [0, {d.d_sae}) for {it.feature.sae!r}")
    if it.op == "clamp" and d.transcoder:
        raise _bad(f"{where}.feature", f"{it.feature.sae!r} is a transcoder: it writes {d.hook_out.site} of block "
                                       f"{d.hook_out.layer}, not the site it reads, so its features are not clamped "
                                       "(steer them with op 'add')")
    hook = d.hook_out if it.op == "add" else d.hook_in
    if hook.site not in EDIT_SITES:
        raise _bad(f"{where}.feature.sae", f"{it.feature.sae!r} {'writes' if it.op == 'add' else 'reads'} "
                                           f"{hook.site} of block {hook.layer}, which interventions do not edit "
                                           f"(they edit {list(EDIT_SITES)})")
    positions = it.positions if isinstance(it.positions, str) else tuple(it.positions)
    if it.op == "add":
        if it.value is not None:
            raise _bad(f"{where}.value", "only clamp takes a value (add takes `scale`)")
        vector = d.decoder_direction(F).detach().to(torch.float32).clone()  # (D,) its own storage, not the dictionary's
        return Intervention(layer=hook.layer, site=hook.site, op="add", positions=positions, vector=vector,
                            scale=it.scale)
    if it.value is None:
        raise _bad(f"{where}.value", "clamp needs the activation to hold the feature at")
    return Intervention(layer=hook.layer, site=hook.site, op="clamp", positions=positions,
                        clamp=FeatureClamp(d, F, it.value))


def _expand(items: list[InterventionItem] | None, store: VectorStore, saes: DictionaryStore | None = None,
            config=None, field: str = "interventions") -> tuple[list[Intervention] | None, list[str]]:
    """The engine's items before validation, and the request item each came from (`interventions[2]`)."""
    if not items:
        return None, []
    out: list[Intervention] = []
    names: list[str] = []  # the request item each engine item came from, for errors
    for i, it in enumerate(items):
        where = f"{field}[{i}]"
        if it.feature is not None:
            out.append(_feature(it, where, saes))
            names.append(where)
            continue
        if it.op == "clamp":
            raise _bad(f"{where}.feature", "clamp needs a dictionary's feature: {\"sae\": NAME, \"id\": F}")
        if it.value is not None:
            raise _bad(f"{where}.value", "only clamp takes a value")
        named = it.vector.name if it.vector is not None and not isinstance(it.vector, list) else None
        stored = None
        if named is not None:
            stored = store.get(named)
            if stored is None:
                raise APIError(400, f"{where}.vector: no stored vector named {named!r} (GET /v1/vectors lists them)",
                               param=f"{where}.vector", code="vector_not_found")
        layers, site = _place(it, where, config)
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
                layer=layer, site=site, op=it.op, positions=positions, vector=vector, scale=it.scale,
                dims=tuple(it.dims or ()), values=tuple(it.values or ()), factor=it.factor))
            names.append(where)
    return out, names
