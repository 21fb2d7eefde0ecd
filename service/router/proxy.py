"""A request passed to its model's process and the answer passed back as it arrives: status, headers and body bytes
unchanged, a stream chunk by chunk with nothing buffered (llama-server's router proxies the same way:
tools/server/server-http.cpp `server_http_proxy`), over kept-alive connections (upstream.py). The client's
disconnect closes the connection to the child, which aborts the request there as it would for a direct client.

When the child's process dies under a request, the request fails alone: before its answer began, a 502 envelope
naming the model; mid-stream, an SSE error event and `[DONE]` (what a single server sends when its engine ends under
a stream), so a client's parser ends cleanly.
"""

from __future__ import annotations

import asyncio
import json
import logging
from urllib.parse import parse_qsl

from fastapi import Request
from fastapi.responses import Response

from service.common.errors import APIError, envelope, error_response
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
    return await relay(pool, child, request.method, request.url.path, request.url.query,
                       [(k, v) for k, v in request.headers.items()], body)


async def relay(pool: ModelPool, child: Child, method: str, path: str, query: str, headers: list[tuple[str, str]],
                body: bytes) -> Response:
    """The child's answer as an ASGI response (`Relayed`), or a 502 envelope when it never began."""
    headers = [(k, v) for k, v in headers if k.lower() not in _DROPPED_REQUEST]
    target = path + (f"?{query}" if query else "")
    try:
        upstream = await pool.upstream.request(child.port, method, target, headers, body)
    except UpstreamError as e:
        child.release()
        log.warning("model %s: request failed before its answer: %s", child.name, e)
        return error_response(502, f"model {child.name} did not answer (its process ended); it is being started "
                                   "again, retry shortly", code="model_unavailable", headers={"Retry-After": "2"})
    except BaseException:
        child.release()
        raise
    return Relayed(child, upstream)


class Relayed(Response):
    """The child's status, headers and body, each body chunk sent on as it is read. Starlette's StreamingResponse
    does the same with an iterator; this sends each chunk with one `send` and no iterator between, since for a
    stream every chunk is a token's event and what the front spends per chunk is added to every token's latency.
    A client's disconnect (watched beside the relay, as StreamingResponse watches) closes the connection to the
    child, which ends the request there."""

    def __init__(self, child: Child, upstream) -> None:
        self.child, self.upstream = child, upstream
        self.status_code = upstream.status
        self.is_stream = upstream.header("content-type").startswith("text/event-stream")
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in upstream.headers
                            if k.lower() not in _DROPPED_RESPONSE]
        self.background = None

    async def _send_body(self, send) -> None:
        try:
            async for chunk in self.upstream.body():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as e:
            log.warning("model %s: its answer broke off: %s", self.child.name, e)
            if self.is_stream:
                error = envelope(502, f"model {self.child.name} stopped answering (its process ended)",
                                 code="model_unavailable")
                await send({"type": "http.response.body", "more_body": True,
                            "body": f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            body = asyncio.ensure_future(self._send_body(send))
            gone = asyncio.ensure_future(_disconnected(receive))
            await asyncio.wait((body, gone), return_when=asyncio.FIRST_COMPLETED)
            for task in (body, gone):
                if not task.done():
                    task.cancel()
            if body.done() and not body.cancelled() and body.exception() is not None:
                raise body.exception()
        finally:
            self.upstream.close()
            self.child.release()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Front:
    """The front's fast path: a request for a model (every path but the front's own, `own`) goes to its process
    from here, before the web framework's routing and exception layers, whose wrapping of each `send` a stream
    would pay per token. What the framework did for these requests is done here: the body read (the guard outside
    has bounded it), the model picked, a refusal in the API's envelope. Everything else goes to `app`."""

    def __init__(self, app, pool: ModelPool, own: set[str]) -> None:
        self.app, self.pool, self.own = app, pool, own

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.own:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        query = scope.get("query_string", b"").decode("latin-1")
        if scope["method"] == "POST":
            name = request_model(body)
        else:
            name = next((v for k, v in parse_qsl(query) if k == "model"), None)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        try:
            child = await self.pool.acquire(name)
            response = await relay(self.pool, child, scope["method"], scope["path"], query, headers, body)
        except APIError as e:  # an unknown model, one that failed to load, the memory budget
            response = error_response(e.status, e.message, e.param, e.code, e.headers)
        except Exception:  # never a bare 500 from the server underneath: the API's envelope, as the framework gives
            log.exception("proxying %s %s failed", scope["method"], scope["path"])
            response = error_response(500, "internal error while passing the request to its model", code="internal_error")
        await response(scope, receive, send)
