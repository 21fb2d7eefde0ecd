"""Checks before any route runs: API key (constant-time compare) and request body size, as pure ASGI middleware
so an oversized or unauthenticated body is refused before it is parsed."""

from __future__ import annotations

import hmac
import json

from service.common.errors import envelope

# the viewer and its docs page hold no data (the viewer asks for the key itself)
OPEN_PATHS = {"/health", "/inspect/ui", "/inspect/ui/inspect.js", "/inspect/ui/patch.js", "/inspect/ui/attribute.js",
              "/inspect/ui/lora.js", "/inspect/ui/features.js",
              "/inspect/ui/docs"}
# Requests to these are counted in llamascope_requests_total{endpoint,status} here, at the edge, so that refusals
# before any route code runs (401, 413, validation 400, 404) are counted like everything else.
COUNTED = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/responses": "responses",
           "/v1/messages": "messages", "/inspect": "inspect"}


class GuardMiddleware:
    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics_require_key: bool, requests_counter=None) -> None:
        self.app = app
        self.counter = requests_counter
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body_bytes
        self.open_paths = OPEN_PATHS | (set() if metrics_require_key else {"/metrics"})

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        """The key as a bearer token (OpenAI's clients) or in `x-api-key` (Anthropic's; llama.cpp's server takes
        both too)."""
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return bearer or hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.api_key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = COUNTED.get(scope["path"])
        if endpoint is not None and self.counter is not None:
            inner_send = send

            async def send(message):
                if message["type"] == "http.response.start":
                    self.counter.labels(endpoint, str(message["status"])).inc()
                await inner_send(message)

        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope["path"] not in self.open_paths and not self._authorized(headers):
            return await _reply(send, 401, "missing or invalid API key (send Authorization: Bearer <key>, or "
                                "x-api-key: <key>)", code="invalid_api_key", extra=[(b"www-authenticate", b"Bearer")])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_body
            except ValueError:
                return await _reply(send, 400, "invalid Content-Length header")
            if too_big:
                return await _reply(send, 413, f"request body of {int(length)} bytes exceeds the limit of {self.max_body} bytes",
                                    code="body_too_large")
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            body, more, size = [], True, 0
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body:
                    return await _reply(send, 413, f"request body exceeds the limit of {self.max_body} bytes", code="body_too_large")
                body.append(chunk)
                more = message.get("more_body", False)
            data = b"".join(body)
            sent = False

            async def replay():
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": data, "more_body": False}
                return await receive()

            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)


async def _reply(send, status: int, message: str, code: str | None = None, extra: list | None = None) -> None:
    body = json.dumps(envelope(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())] + (extra or [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
