"""POST /v1/vectors (a steering vector from contrastive prompt pairs), GET /v1/vectors, GET and DELETE
/v1/vectors/{name}: the stored vectors interventions name (service/microscope/vectors.py).

The block outputs are read by inspections (`include: ["hidden_states"]`) stepped on the engine thread between
serving steps, one prompt at a time, over the serving weights.
"""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Depends, Request

from model.probes import ProbeOptions
from service.common.errors import APIError
from service.microscope.probing import check_inspect_length, run_probe
from service.microscope.schemas import VectorRequest
from service.common.serving import Serving, get_serving
from service.microscope.vectors import StoredVector, contrastive_mean

router = APIRouter()


def _with_data(v: StoredVector) -> dict:
    """The summary and each block's direction as little-endian float32 in base64."""
    data = {str(l): base64.b64encode(np.ascontiguousarray(t.numpy().astype("<f4")).tobytes()).decode("ascii")
            for l, t in sorted(v.layers.items())}
    return {**v.summary(), "dtype": "float32", "encoding": "base64", "data": data}


def _found(serving: Serving, name: str) -> StoredVector:
    v = serving.vectors.get(name)
    if v is None:
        raise APIError(404, f"no stored vector named {name!r}", param="name", code="vector_not_found")
    return v


@router.post("/v1/vectors")
async def create_vector(req: VectorRequest, request: Request, serving: Serving = Depends(get_serving)):
    adapter = serving.check_model(req.model, adapters=True)  # the prompts read under a LoRA adapter, or the base
    c = serving.config
    if serving.vectors.get(req.name) is not None:
        raise APIError(409, f"a vector named {req.name!r} exists: DELETE /v1/vectors/{req.name} first", param="name",
                       code="vector_exists")
    if len(req.positive) != len(req.negative):
        raise APIError(400, f"negative: give one negative prompt per positive one ({len(req.positive)}), got "
                            f"{len(req.negative)}", param="negative", code="invalid_value")
    bad = [l for l in req.layers if l >= c.n_layers]
    if bad:
        raise APIError(400, f"layers: {bad[0]} is out of range [0, {c.n_layers})", param="layers", code="invalid_value")
    tok = serving.tokenizer
    sides = []
    for side, texts in (("positive", req.positive), ("negative", req.negative)):
        reps = []
        for text in texts:
            ids = tok.encode(text)
            if not ids:
                raise APIError(400, f"{side}: a prompt encodes to no tokens", param=side, code="empty_prompt")
            check_inspect_length(serving, len(ids), side)
            T = len(ids)
            opts = ProbeOptions(layers=list(req.layers), include=frozenset({"hidden_states"}),
                                hidden_positions=[T - 1] if req.position == "last" else None)
            result = (await run_probe(serving, request, ids, opts, adapter=adapter)).result()
            reps.append({p.layer: p.hidden.mean(0) for p in result.layers})  # (P, D) -> (D,)
        sides.append(reps)
    vector = StoredVector(req.name, contrastive_mean(sides[0], sides[1], req.normalize), "contrastive",
                          details={"pairs": len(req.positive), "position": req.position, "normalize": req.normalize,
                                   **({"adapter": adapter} if adapter is not None else {})})
    try:
        serving.vectors.add(vector)
    except KeyError:
        raise APIError(409, f"a vector named {req.name!r} exists: DELETE /v1/vectors/{req.name} first", param="name",
                       code="vector_exists") from None
    except OverflowError as e:
        raise APIError(400, str(e), param="name", code="vector_store_full") from None
    return _with_data(vector)


@router.get("/v1/vectors")
async def list_vectors(serving: Serving = Depends(get_serving)):
    return {"object": "list", "data": [v.summary() for v in serving.vectors.list()]}


@router.get("/v1/vectors/{name}")
async def get_vector(name: str, serving: Serving = Depends(get_serving)):
    return _with_data(_found(serving, name))


@router.delete("/v1/vectors/{name}")
async def delete_vector(name: str, serving: Serving = Depends(get_serving)):
    _found(serving, name)
    serving.vectors.delete(name)
    return {"object": "vector.deleted", "name": name, "deleted": True}
