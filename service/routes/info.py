"""GET /health, GET /v1/models, GET /metrics, POST /tokenize, POST /detokenize."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.errors import APIError, error_response
from service.prepare import check_token_ids, render_chat
from service.schemas import DetokenizeRequest, TokenizeRequest
from service.serving import Serving, get_serving
from service.state import ServerState

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    state: ServerState = request.app.state.server  # the lifecycle itself: answers while loading and after a failure
    if state.ready:
        return {"status": "ok", "model": state.model_name}
    reason = "draining" if state.draining else ("failed" if state.load_error or state.fatal_error else "loading")
    detail = state.load_error or state.fatal_error
    return error_response(503, f"not ready: {reason}" + (f" ({detail})" if detail else ""),
                          code="not_ready", headers={"Retry-After": "5"})


@router.get("/v1/models")
async def models(serving: Serving = Depends(get_serving)):
    base = {"id": serving.model_name, "object": "model", "created": 0, "owned_by": "llamascope",
            "max_model_len": serving.max_model_len, **serving.precision, "speculative_config": serving.speculative,
            "execution": serving.execution}
    # each LoRA adapter as vLLM lists one: its own id, its folder as root, the base as parent
    loras = [{"id": name, "object": "model", "created": 0, "owned_by": "llamascope", "root": a.path,
              "parent": serving.model_name, "max_model_len": serving.max_model_len} for name, a in serving.adapters.items()]
    return {"object": "list", "data": [base, *loras]}


@router.get("/metrics")
async def metrics(request: Request):
    state: ServerState = request.app.state.server  # scraped whatever the state, as Prometheus expects
    if state.stats is not None:  # the engine thread's last snapshot, never a walk over its live state
        state.metrics.set_gauges(state.stats)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, serving: Serving = Depends(get_serving)):
    serving.check_model(req.model, adapters=True)  # an adapter shares the base's tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt", code="invalid_value")
    if req.messages is not None:
        ids = render_chat(serving, req.messages, template_kwargs=req.chat_template_kwargs)
    else:
        ids = serving.tokenizer.encode(req.prompt, add_bos=None if req.add_special_tokens else False)
    return {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, serving: Serving = Depends(get_serving)):
    serving.check_model(req.model, adapters=True)
    check_token_ids(req.tokens, serving, "tokens")
    return JSONResponse({"prompt": serving.tokenizer.decode(req.tokens)})
