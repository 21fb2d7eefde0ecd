"""GET /v1/saes, POST /v1/saes, DELETE /v1/saes/{name}: the dictionaries (sparse autoencoders, transcoders) the
server serves by name (model/features/sae/store.py), which the `features` field of a generation request names.

Run-time loading reads only under --sae-allowed-dirs (symlinks resolved; as vLLM's --allowed-local-media-path), off
when none is given; a refusal (a path outside them, a malformed file, a dictionary that does not fit the model,
the memory bound) is a 400 naming the field, with nothing loaded. An unload never changes a running request: it
keeps the dictionary object it was admitted with."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from model.features.sae import ENCODERS, FORMATS, Dictionary, DictionaryError
from service.common.errors import APIError
from service.common.serving import Serving, get_serving

router = APIRouter()

SAEName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]


class SAELoadRequest(BaseModel):
    """POST /v1/saes: a dictionary folder to serve as `name` (`format` and `hook_name` override what its files
    say, as load_dictionary takes them)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: SAEName
    path: Annotated[str, Field(min_length=1, max_length=4096)]
    format: Literal[FORMATS] | None = None  # type: ignore[valid-type]
    hook_name: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    encoder: Literal[ENCODERS] | None = None  # type: ignore[valid-type]  # default: the server's --sae-encoder


def _hook_name(hook) -> str:
    """A place as TransformerLens names it, or as its HF module where TransformerLens has no name for it."""
    try:
        return hook.transformer_lens_name()
    except ValueError:
        path, side = hook.hf_module()
        return f"{path}.{side}" if side == "input" else path


def describe(name: str, d: Dictionary) -> dict:
    return {"name": name, "object": "sae", "format": d.source, "hook_in": _hook_name(d.hook_in),
            "hook_out": _hook_name(d.hook_out), "d_in": d.d_in, "d_sae": d.d_sae, "d_out": d.d_out,
            "activation": d.activation, "k": d.k if d.activation in ("topk", "groupmax") else None,
            "bytes": d.nbytes, "dtype": str(d.dtype).removeprefix("torch."), "encoder": d.encoder,
            "transcoder": d.transcoder}


def _store(serving: Serving):
    if serving.saes is None:  # (the store is made when the model loads, before the server says ready)
        raise APIError(503, "the model is not loaded yet", code="not_ready")
    return serving.saes


@router.get("/v1/saes")
async def list_saes(serving: Serving = Depends(get_serving)):
    return {"object": "list", "data": [describe(n, d) for n, d in _store(serving).items()]}


@router.post("/v1/saes")
async def load_sae(req: SAELoadRequest, serving: Serving = Depends(get_serving)):
    store = _store(serving)
    if not store.limits.allowed:
        raise APIError(403, "loading dictionaries at run time is off: the server was started without "
                            "--sae-allowed-dirs", param="path", code="sae_loading_off")
    options = {k: v for k, v in (("format", req.format), ("hook_name", req.hook_name), ("encoder", req.encoder))
               if v is not None}
    try:  # files are read on a worker thread: the event loop and the engine keep serving meanwhile
        d = await asyncio.to_thread(store.load, req.name, req.path, **options)
    except DictionaryError as e:
        raise APIError(400, str(e), param=e.field, code="invalid_value") from None
    return describe(req.name, d)


@router.delete("/v1/saes/{name}")
async def unload_sae(name: str, serving: Serving = Depends(get_serving)):
    try:
        _store(serving).unload(name)
    except DictionaryError:
        raise APIError(404, f"no dictionary named {name!r}", param="name", code="sae_not_found") from None
    return {"name": name, "object": "sae", "deleted": True}
