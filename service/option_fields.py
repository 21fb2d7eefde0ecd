"""A generation request's fields beside prompt and sampling -> the engine's `RequestOptions` (one typed record from
here to the runner): interventions and hidden-state reads (service/edit_fields.py), per-token telemetry, the sink +
window cache, the compiled grammar. Each refusal is a 400 naming the field."""

from __future__ import annotations

from model.engine import KVWindow, RequestOptions, SamplingParams, TelemetryOptions
from model.engine.structured import StructuredOutputSpec
from service.errors import APIError
from service.edit_fields import to_interventions, to_read
from service.schemas import SamplingFields
from service.serving import Serving


def kv_window(req: SamplingFields, serving: Serving, max_tokens: int) -> KVWindow | None:
    """The request's sink + window cache, else the server's default (--kv-window); 400 when it cannot fit."""
    settings = serving.settings
    if req.kv_window is not None:
        window = KVWindow(req.kv_window.sink_tokens, req.kv_window.window)
    elif settings.kv_window is not None:
        window = KVWindow(settings.sink_tokens, settings.kv_window)
    else:
        return None
    serving.check_window(window)
    if max_tokens > settings.max_window_tokens:
        raise APIError(400, f"max_tokens must be at most {settings.max_window_tokens} with a kv_window "
                            f"(--max-window-tokens), got {max_tokens}", param="max_tokens", code="invalid_value")
    return window


def to_options(req: SamplingFields, serving: Serving, params: SamplingParams, telemetry: TelemetryOptions | None = None,
               structured: StructuredOutputSpec | None = None) -> RequestOptions:
    """Everything the request carries beside prompt and sampling, checked against the model and the deployment."""
    c = serving.config
    return RequestOptions(
        interventions=to_interventions(req.interventions, serving.vectors, c.n_layers, c.dim),
        hidden_states=to_read(req.return_hidden_states, c.n_layers),
        telemetry=telemetry, kv_window=kv_window(req, serving, params.max_tokens), structured=structured,
        num_speculative_tokens=speculative_tokens(req, serving))


def speculative_tokens(req: SamplingFields, serving: Serving) -> int | None:
    """The request's cap on speculative drafts: 400 naming the field when the server does not speculate or drafts
    fewer (the engine's check)."""
    serving.check_speculation(req.num_speculative_tokens)
    return req.num_speculative_tokens


def hidden_dtype(req: SamplingFields) -> str | None:
    """The dtype the request's hidden states go back in (None: it reads none)."""
    return req.return_hidden_states.dtype if req.return_hidden_states is not None else None
