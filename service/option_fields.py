"""A generation request's fields beside prompt and sampling -> the engine's `RequestOptions` (one typed record from
here to the runner): interventions and hidden-state reads (service/edit_fields.py), per-token telemetry, the sink +
window cache, the grammar, speculation. Each refusal is a 400 naming the field: the fields' own checks here, what the
engine can serve in `Serving.check` (one call, `Engine.check`)."""

from __future__ import annotations

from model.engine import RequestOptions, SamplingParams
from model.features import KVWindow, TelemetryOptions
from model.engine.structured import StructuredOutputSpec
from service.errors import APIError
from service.edit_fields import to_interventions, to_read
from service.schemas import SamplingFields
from service.serving import Serving


def kv_window(req: SamplingFields, serving: Serving, max_tokens: int) -> KVWindow | None:
    """The request's sink + window cache, else the server's default (--kv-window); 400 when max_tokens is past
    --max-window-tokens (whether the engine's context holds the window is `Serving.check`'s)."""
    settings = serving.settings
    if req.kv_window is not None:
        window = KVWindow(req.kv_window.sink_tokens, req.kv_window.window)
    elif settings.kv_window is not None:
        window = KVWindow(settings.sink_tokens, settings.kv_window)
    else:
        return None
    if max_tokens > settings.max_window_tokens:
        raise APIError(400, f"max_tokens must be at most {settings.max_window_tokens} with a kv_window "
                            f"(--max-window-tokens), got {max_tokens}", param="max_tokens", code="invalid_value")
    return window


async def to_options(req: SamplingFields, serving: Serving, params: SamplingParams,
                     telemetry: TelemetryOptions | None = None,
                     structured: StructuredOutputSpec | None = None) -> RequestOptions:
    """Everything the request carries beside prompt and sampling, checked against the model, the deployment and the
    engine (its grammar compiled) before anything is submitted."""
    c = serving.config
    options = RequestOptions(
        interventions=to_interventions(req.interventions, serving.vectors, c.n_layers, c.dim),
        hidden_states=to_read(req.return_hidden_states, c.n_layers),
        telemetry=telemetry, kv_window=kv_window(req, serving, params.max_tokens), structured=structured,
        num_speculative_tokens=req.num_speculative_tokens, lora=serving.check_model(req.model, adapters=True))
    await serving.check(options)
    return options


def hidden_dtype(req: SamplingFields) -> str | None:
    """The dtype the request's hidden states go back in (None: it reads none)."""
    return req.return_hidden_states.dtype if req.return_hidden_states is not None else None
