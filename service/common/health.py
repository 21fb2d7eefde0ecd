"""GET /health and GET /metrics: the server's lifecycle and its Prometheus metrics, whichever face a client uses;
both answer while the model loads and after a failure."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.common.errors import error_response
from service.common.state import ServerState

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


@router.get("/metrics")
async def metrics(request: Request):
    state: ServerState = request.app.state.server  # scraped whatever the state, as Prometheus expects
    if state.stats is not None:  # the engine thread's last snapshot, never a walk over its live state
        state.metrics.set_gauges(state.stats)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
