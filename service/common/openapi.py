"""The OpenAPI document says what the server does, so that a schema-driven client or fuzzer (schemathesis, in
tests/service/test_schemathesis.py) can hold it to that:

- every error status a route can answer (400, 401, 404, 409, 413, 429, 500, 503) is declared with the OpenAI envelope
  as its schema (Anthropic's under /v1/messages); FastAPI's default 422 is dropped, since validation failures are
  answered 400 (errors.py);
- /metrics is Prometheus text, and the generation routes also answer `text/event-stream` (`stream: true`);
- the deployment's own limits become bounds: token ids below the served vocabulary, `n` up to `--max-n`,
  `logprobs` / `top_logprobs` up to `--max-logprobs`, prompt lists up to `--max-prompts` entries;
- with an API key configured, bearer auth is declared on every route but the open ones.

What cannot be said in JSON Schema (prompt + max_tokens within the context, min_tokens <= max_tokens, logit_bias
keys inside the vocabulary, a chat template that accepts the roles' order) stays a 400 with a message.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from service.api.anthropic import errors as anthropic_errors
from service.common.middleware import OPEN_PATHS
from service.common.state import ServerState

ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
# One server-sent event (OpenAPI 3.2's `itemSchema` for sequential media): `data` is a JSON chunk, an error
# envelope, or the final `[DONE]`.
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}
_ERRORS = {400: "invalid request", 401: "missing or invalid API key", 404: "unknown model or route",
           413: "request body too large (or, for /inspect and /inspect/attribute, the sequence or the estimated size)",
           409: "a stored vector of that name exists", 429: "queue full (see Retry-After)", 500: "generation failed",
           403: "loading dictionaries at run time is off (--sae-allowed-dirs)",
           503: "loading, or shutting down (see Retry-After)"}
_STREAMING = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}
_QUEUED = _STREAMING | {"/inspect", "/inspect/patch", "/inspect/attribute", "/v1/vectors"}  # routes that can answer 429


def install(app: FastAPI, state: ServerState) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _describe(schema, state)
        if state.loaded is not None:  # the bounds need the model: cache only once they are in
            app.openapi_schema = schema
        return schema

    app.openapi = openapi


def _describe(schema: dict[str, Any], state: ServerState) -> None:
    s = state.settings
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {})["ErrorResponse"] = ERROR_SCHEMA
    components["schemas"].pop("HTTPValidationError", None)
    components["schemas"].pop("ValidationError", None)
    error_ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    # everything under /v1/messages answers in Anthropic's envelope (service/api/anthropic/errors.py)
    components["schemas"]["AnthropicErrorResponse"] = anthropic_errors.ERROR_SCHEMA
    anthropic_ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicErrorResponse"}}}}
    open_paths = OPEN_PATHS | (set() if s.metrics_require_key else {"/metrics"})
    if s.api_key is not None:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            codes = {500} | ({400, 404, 413} if method == "post" else set())
            if path != "/metrics":
                codes.add(503)
            if path in _QUEUED and method == "post":
                codes.add(429)
            if path == "/v1/vectors" and method == "post":
                codes.add(409)
            if path in ("/v1/vectors/{name}", "/v1/responses/{response_id}", "/v1/saes/{name}"):
                codes.add(404)
            if path == "/v1/saes" and method == "post":
                codes.add(403)
            if path in _STREAMING:
                responses["200"].setdefault("content", {})["text/event-stream"] = {"itemSchema": SSE_EVENT}
            if s.api_key is not None:
                op["security"] = [] if path in open_paths else [{"bearer": []}]
                if path not in open_paths:
                    codes.add(401)
            if path == "/metrics":
                responses["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
            for code in sorted(codes):
                responses[str(code)] = {"description": _ERRORS[code],
                                        **(anthropic_ref if anthropic_errors.covers(path) else error_ref)}
    if state.loaded is not None:
        _bound(components["schemas"], state)


def _bound(schemas: dict[str, Any], state: ServerState) -> None:
    s, vocab = state.settings, state.loaded.model.config.vocab_size

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.pop("x-token-id", False):
                node.pop("exclusiveMaximum", None)
                node["maximum"] = vocab - 1
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schemas)
    for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"):
        props = schemas.get(name, {}).get("properties", {})
        if "n" in props:
            props["n"]["maximum"] = s.max_n
        for field in ("logprobs", "top_logprobs"):
            for branch in props.get(field, {}).get("anyOf", []):
                if branch.get("type") == "integer":
                    branch["maximum"] = s.max_logprobs
    c = state.loaded.model.config
    inspect = schemas.get("InspectRequest", {}).get("properties", {})
    for field, n in (("layers", c.n_layers), ("heads", c.n_heads)):  # indices into this model
        for branch in inspect.get(field, {}).get("anyOf", []):
            if branch.get("type") == "array":
                branch["items"].pop("exclusiveMaximum", None)
                branch["items"]["maximum"] = n - 1
    for branch in schemas.get("CompletionRequest", {}).get("properties", {}).get("prompt", {}).get("anyOf", []):
        items = branch.get("items", {})
        if branch.get("type") == "array" and (items.get("type") == "string" or items.get("type") == "array"):
            branch["maxItems"] = s.max_prompts
