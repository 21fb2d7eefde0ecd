"""Request fields -> the engine's SamplingParams, with the deployment's limits (the route's one conversion)."""

from __future__ import annotations

from model.engine import KVWindow, SamplingParams, TelemetryOptions
from model.engine.structured import StructuredOutputSpec
from service.config import Settings
from service.errors import APIError
from service.schemas import SamplingFields


def kv_window(req: SamplingFields, settings: Settings, max_model_len: int | None) -> KVWindow | None:
    """The request's sink + window cache, else the server's default (--kv-window); 400 when it cannot fit."""
    if req.kv_window is not None:
        window = KVWindow(req.kv_window.sink_tokens, req.kv_window.window)
    elif settings.kv_window is not None:
        window = KVWindow(settings.sink_tokens, settings.kv_window)
    else:
        return None
    need = window.max_cache_tokens(settings.block_size)
    if max_model_len is not None and need > max_model_len:
        raise APIError(400, f"kv_window: sink_tokens ({window.sink_tokens}) + window ({window.window}) + block_size "
                            f"({settings.block_size}) = {need} exceeds the context length of {max_model_len}",
                       param="kv_window", code="invalid_value")
    return window


def to_sampling_params(req: SamplingFields, settings: Settings, max_tokens: int | None, logprobs: int | None,
                       prompt_logprobs: int | None, default_max_tokens: int, max_model_len: int | None = None,
                       telemetry: TelemetryOptions | None = None,
                       structured: StructuredOutputSpec | None = None) -> SamplingParams:
    if req.stream_options is not None and not req.stream:
        # OpenAI and vLLM refuse it too: the options describe a stream, and a silently ignored field hides a bug
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options",
                       code="invalid_value")
    if req.n > settings.max_n:
        raise APIError(400, f"n must be at most {settings.max_n}, got {req.n}", param="n", code="invalid_value")
    for name, value in (("logprobs", logprobs), ("prompt logprobs", prompt_logprobs)):
        if value is not None and value > settings.max_logprobs:
            raise APIError(400, f"{name} must be at most {settings.max_logprobs}, got {value}", param="logprobs",
                           code="invalid_value")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        n=req.n, max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        min_tokens=req.min_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        seed=req.seed, stop=stop, stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
        kv_window=kv_window(req, settings, max_model_len), telemetry=telemetry, structured=structured,
    )
    if params.kv_window is not None and params.max_tokens > settings.max_window_tokens:
        raise APIError(400, f"max_tokens must be at most {settings.max_window_tokens} with a kv_window "
                            f"(--max-window-tokens), got {params.max_tokens}", param="max_tokens", code="invalid_value")
    return params
