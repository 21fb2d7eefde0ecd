"""A request passed to its model's process and the answer passed back as it arrives: status, headers and body bytes
unchanged, a stream chunk by chunk with nothing buffered (llama-server's router proxies the same way:
tools/server/server-http.cpp `server_http_proxy`), over kept-alive connections (upstream.py). The client's
disconnect closes the connection to the child, which aborts the request there as it would for a direct client.

When the child's process dies under a request, the request fails alone: before its answer began, a 502 envelope
naming the model; mid-stream, an SSE error event and `[DONE]` (what a single server sends when its engine ends under
a stream), so a client's parser ends cleanly.
"""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from service.common.errors import envelope, error_response
from service.router.child import Child
from service.router.pool import ModelPool
from service.router.upstream import UpstreamError

log = logging.getLogger("llamascope.router")

# hop-by-hop headers (RFC 9110 7.6.1) and the ones the new connection sets itself
_DROPPED_REQUEST = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade", "te"}
_DROPPED_RESPONSE = {"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"}


def request_model(body: bytes) -> str | None:
    """The `model` field of a JSON body (None for no body, no field, or not JSON: the default model answers, and
    refuses a malformed body itself in its own words)."""
    if not body:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


async def forward(pool: ModelPool, child: Child, request: Request, body: bytes) -> Response:
    """Send the request to `child` (already acquired: released here when the answer has been passed on)."""
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROPPED_REQUEST]
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    try:
        upstream = await pool.upstream.request(child.port, request.method, target, headers, body)
    except UpstreamError as e:
        child.release()
        log.warning("model %s: request failed before its answer: %s", child.name, e)
        return error_response(502, f"model {child.name} did not answer (its process ended); it is being started "
                                   "again, retry shortly", code="model_unavailable", headers={"Retry-After": "2"})
    is_stream = upstream.header("content-type").startswith("text/event-stream")

    async def relay():
        try:
            async for chunk in upstream.body():
                yield chunk
        except UpstreamError as e:
            log.warning("model %s: its answer broke off: %s", child.name, e)
            if is_stream:
                error = envelope(502, f"model {child.name} stopped answering (its process ended)",
                                 code="model_unavailable")
                yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            upstream.close()
            child.release()

    out_headers = {k: v for k, v in upstream.headers if k.lower() not in _DROPPED_RESPONSE}
    return StreamingResponse(relay(), status_code=upstream.status, headers=out_headers)
