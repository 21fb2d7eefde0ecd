"""The ingress deployment behind Ray's HTTP proxy: reads each request whole, forwards it to a replica through a
deployment handle (whose request router sees the prompt: service/rayserve/call.py says why that needs the body), and
relays the replica's response.

Failures a client can meet here get the OpenAI envelope, as every failure of the server itself does:
- a body over `max_body_bytes`: 413, before anything is forwarded;
- the replica died (or became unreachable) before its response began: the request goes to another replica once,
  as nginx's `proxy_next_upstream ... non_idempotent` does (the dead replica's work is lost either way), then 503;
- the replica died while streaming: an SSE error event and `data: [DONE]`, so the client's stream ends cleanly;
- no response within `read_timeout_s` (first byte, or between two chunks of a stream): 504, or an SSE error event.
Nothing waits without a deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from ray.exceptions import ActorUnavailableError, RayActorError, RayError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from service.common.errors import envelope
from service.rayserve.call import ReplicaCall
from service.api.openai.format import DONE, sse_error

log = logging.getLogger("llamascope.service")

_HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"proxy-connection"}
_REPLICA_GONE = (RayActorError, ActorUnavailableError)


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(envelope(status, message, code=code), status_code=status)


class LlamascopeIngress:
    def __init__(self, replicas, max_body_bytes: int = 1 << 20, read_timeout_s: float = 600.0) -> None:
        self.replicas = replicas.options(stream=True)
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, request: Request) -> Response:
        try:
            body = await self._body(request)
        except ClientDisconnect:
            return Response(status_code=499)
        if body is None:
            return _error(413, f"request body larger than {self.max_body_bytes} bytes", "body_too_large")
        # below the application's route prefix, as the replica's own routes know it (Ray passes the prefix as root_path)
        path, root = request.scope["path"], request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        parts = path.split("/")
        target = parts[2] if len(parts) == 4 and parts[1] == "replicas" and parts[3] == "metrics" else None
        call = ReplicaCall(
            method=request.method, path=path, query_string=request.url.query.encode(),
            headers=[(k, v) for k, v in request.headers.raw if k.lower() not in _HOP_BY_HOP], body=body,
            route_prefix=root, target_replica=target,
        )
        for attempt in range(2):
            stream = self.replicas.remote(call)
            try:
                start = await asyncio.wait_for(stream.__anext__(), self.read_timeout_s)
                break
            except _REPLICA_GONE as e:
                log.warning("replica gone before answering (attempt %d): %s", attempt + 1, type(e).__name__)
                if attempt == 1 or target is not None:
                    return _error(503, "the replica serving this request stopped; retry", "replica_unavailable")
            except asyncio.TimeoutError:
                stream.cancel()
                return _error(504, f"no response from a replica within {self.read_timeout_s:g} s", "timeout")
            except (RayError, StopAsyncIteration) as e:
                log.error("replica failed before answering: %s", e)
                return _error(500, "the replica failed to answer", "replica_error")
        headers = {k: v for k, v in start["headers"] if k.lower() not in ("content-length", "transfer-encoding")}
        if headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(self._relay(stream), status_code=start["status"], headers=headers)
        try:  # a whole response: collected first, so a replica lost halfway is an error status, not a cut body
            chunks = [chunk async for chunk in self._chunks(stream)]
        except _REPLICA_GONE:
            return _error(503, "the replica serving this request stopped; retry", "replica_unavailable")
        except asyncio.TimeoutError:
            stream.cancel()
            return _error(504, f"no response from a replica within {self.read_timeout_s:g} s", "timeout")
        except RayError as e:
            log.error("replica failed while answering: %s", e)
            return _error(500, "the replica failed to answer", "replica_error")
        return Response(b"".join(chunks), status_code=start["status"], headers=headers)

    async def _body(self, request: Request) -> bytes | None:
        """The body, or None once it passes `max_body_bytes` (counted as it arrives, as the server's own guard)."""
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                return None
        return bytes(body)

    async def _chunks(self, stream) -> AsyncIterator[bytes]:
        while True:
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), self.read_timeout_s)
            except StopAsyncIteration:
                return
            yield chunk

    async def _relay(self, stream) -> AsyncIterator[bytes]:
        """An SSE stream, event by event; if the replica is lost or silent, the client gets an error event and
        `[DONE]` instead of a connection that never ends."""
        try:
            async for chunk in self._chunks(stream):
                yield chunk
        except _REPLICA_GONE:
            log.warning("replica lost mid-stream")
            yield ("\n\n" + sse_error(503, "the replica serving this stream stopped") + DONE).encode()
        except asyncio.TimeoutError:
            yield ("\n\n" + sse_error(504, f"no data from the replica for {self.read_timeout_s:g} s") + DONE).encode()
        except RayError as e:
            log.error("replica failed mid-stream: %s", e)
            yield ("\n\n" + sse_error(500, "the replica failed mid-stream") + DONE).encode()
        finally:
            stream.cancel()  # a client that left stops the replica's work too (its disconnect reaches the app)
