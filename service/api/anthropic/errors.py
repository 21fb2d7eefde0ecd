"""Anthropic's error envelope for everything under /v1/messages: `{"type": "error", "error": {"type", "message"}}`
with the HTTP status of the failure and Anthropic's error type for it (its API reference, "Errors": 400
invalid_request_error, 401 authentication_error, 403 permission_error, 404 not_found_error, 413 request_too_large,
429 rate_limit_error, 500 api_error, 529 overloaded_error; other 4xx are invalid_request_error).

Every failure path of the server already answers one way, in OpenAI's envelope (service/errors.py: validation
400s, bad JSON, the routes' refusals, 404 / 405, the last-resort 500; service/middleware.py: the API key's 401 and the
body limit's 413). `AnthropicErrors` wraps the app and, for a request under /v1/messages, rewrites such an answer
into this envelope, so that no failure path of those routes can answer in the other API's shape. A failure after a
stream began is an `error` event (`sse_event`), as Anthropic's stream sends it.
"""

from __future__ import annotations

import json

from service.api.openai.responses.output import event_text

PATH = "/v1/messages"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}
# The documented error responses' schema (service/openapi.py declares it for these routes)
ERROR_SCHEMA = {
    "type": "object", "required": ["type", "error"], "additionalProperties": False,
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"], "additionalProperties": False,
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def envelope(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def sse_event(status: int, message: str) -> str:
    """The `error` event that ends a stream which failed after it began."""
    return event_text(envelope(status, message))


def covers(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def _rewritten(status: int, body: bytes) -> bytes:
    try:
        error = json.loads(body)["error"]
        message = error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace") or f"HTTP {status}"
    return json.dumps(envelope(status, message), ensure_ascii=False).encode()


class AnthropicErrors:
    """ASGI middleware: error answers (status >= 400) to requests under /v1/messages in Anthropic's envelope. It
    wraps the key and body-size guard, so those refusals are rewritten too; streams (200) pass untouched."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not covers(scope["path"]):
            return await self.app(scope, receive, send)
        held: dict | None = None
        chunks: list[bytes] = []

        async def rewrite(message):
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held = message  # sent with the rewritten body, whose length differs
                return
            if held is None or message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = _rewritten(held["status"], b"".join(chunks))
            headers = [(k, v) for k, v in held.get("headers", []) if k.lower() not in (b"content-length", b"content-type")]
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({**held, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewrite)
