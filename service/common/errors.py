"""The OpenAI error envelope for every failure path: `{"error": {"message", "type", "param", "code"}}`.

FastAPI's own 422 `{"detail": [...]}` never reaches a client; neither does a traceback or an internal path.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from model.engine import EngineDeadError, QueueFullError

log = logging.getLogger("llamascope.service")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def envelope(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(envelope(status, message, param, code), status_code=status, headers=headers)


def engine_refusal(exc: Exception) -> APIError | None:
    """The one mapping of the engine's refusals to HTTP: its waiting queue (or the inspection queue) is full -> 429
    with Retry-After, its thread is not running -> 503; None for anything else."""
    if isinstance(exc, QueueFullError):
        return APIError(429, f"server busy: {exc}", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not running: {exc}", code="engine_dead")
    return None


def status_of(exc: Exception) -> int:
    """The HTTP status a failure before any response ends the request with (for metrics and the log line)."""
    if isinstance(exc, APIError):
        return exc.status
    refusal = engine_refusal(exc)
    return refusal.status if refusal is not None else 500


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p not in ("body", "str", "constrained-str") and "[" not in str(p)]  # drop union tags
    if e.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = ".".join(loc) or None
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(QueueFullError)
    @app.exception_handler(EngineDeadError)
    async def _engine_refusal(request: Request, exc: Exception) -> JSONResponse:
        e = engine_refusal(exc)
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return error_response(400, "the request body is not valid JSON", None, "invalid_json")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}
        headers = exc.headers
        if exc.status_code == 405:  # Starlette's Allow names the first route of the path; a path may have several
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
        return error_response(exc.status_code, message.get(exc.status_code, str(exc.detail)), headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal server error", code="internal_error")


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route of this path takes (RFC 9110 section 15.5.6: a 405 lists them in Allow)."""
    methods: set[str] = set()
    routes = list(request.app.router.routes)
    while routes:
        route = routes.pop()
        inner = getattr(route, "original_router", None)  # FastAPI keeps an included router whole (no prefixes here)
        if inner is not None:
            routes += inner.routes
            continue
        match, _ = route.matches(request.scope)
        if match is not Match.NONE and getattr(route, "methods", None):
            methods |= route.methods
    return sorted(methods)
