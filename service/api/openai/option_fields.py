"""A generation request's fields beside prompt and sampling -> the engine's `RequestOptions` (one typed record from
here to the runner): interventions and hidden-state reads (service/microscope/edit_fields.py), per-token telemetry,
the sink + window cache, the grammar, speculation. Each refusal is a 400 naming the field: the fields' own checks here,
what the engine can serve when the request is submitted (`Serving.add_requests` asks `Engine.check`)."""

from __future__ import annotations

from model.engine import RequestOptions, SamplingParams
from model.features import InvalidOption, KVWindow, StructuredOutputSpec, TelemetryOptions
from model.features.sae import DictionaryError, FeatureReadOptions
from service.common.errors import APIError
from service.microscope.edit_fields import to_edits
from service.api.openai.schemas import FeaturesOptions, SamplingFields
from service.common.serving import Serving


def kv_window(req: SamplingFields, serving: Serving, max_tokens: int) -> KVWindow | None:
    """The request's sink + window cache, else the server's default (--kv-window); 400 when max_tokens is past
    --max-window-tokens (whether the engine's context holds the window is `Engine.check`'s, asked at submission)."""
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


def feature_read(o: FeaturesOptions | None, serving: Serving) -> FeatureReadOptions | None:
    """The request's `features`, its dictionary resolved by name now (the request keeps that object, whatever is
    unloaded later); 400 naming the field for an unknown name or a value the dictionary cannot serve."""
    if o is None:
        return None
    try:
        if serving.saes is None:
            raise DictionaryError("sae", "no dictionary is loaded")
        d = serving.saes.get(o.sae)
        positions = o.positions if isinstance(o.positions, str) else tuple(o.positions)
        read = FeatureReadOptions(o.sae, d, o.top_k, positions, tuple(o.ids or ()), o.error_norm)
        read.validate()
    except DictionaryError as e:
        raise APIError(400, f"features.{e}", param="features.sae", code="invalid_value") from None
    except InvalidOption as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None
    return read


def to_options(req: SamplingFields, serving: Serving, params: SamplingParams, adapter: str | None,
               telemetry: TelemetryOptions | None = None,
               structured: StructuredOutputSpec | None = None) -> RequestOptions:
    """Everything the request carries beside prompt and sampling, checked against the model and the deployment;
    `adapter`: the LoRA adapter the request's `model` names (`Serving.check_model`), or None."""
    c = serving.config
    window = kv_window(req, serving, params.max_tokens)
    interventions, read = to_edits(req.interventions, req.return_hidden_states, serving.vectors, c.n_layers, c.dim,
                                   serving.saes, c)
    return RequestOptions(
        interventions=interventions, hidden_states=read, telemetry=telemetry, features=feature_read(req.features, serving),
        kv_window=window, structured=structured,
        num_speculative_tokens=req.num_speculative_tokens, lora=adapter)


def hidden_dtype(req: SamplingFields) -> str | None:
    """The dtype the request's hidden states go back in (None: it reads none)."""
    return req.return_hidden_states.dtype if req.return_hidden_states is not None else None
