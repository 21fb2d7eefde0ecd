"""Request fields -> the engine's SamplingParams, with the deployment's limits (what else the request carries:
service/api/openai/option_fields.py)."""

from __future__ import annotations

from model.engine import SamplingParams
from service.config import Settings
from service.common.errors import APIError
from service.api.openai.schemas import SamplingFields


def to_sampling_params(req: SamplingFields, settings: Settings, max_tokens: int | None, logprobs: int | None,
                       prompt_logprobs: int | None, default_max_tokens: int) -> SamplingParams:
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
        output_kind="delta" if req.stream else "final",  # a non-streamed reply: one output when it ends
    )
    return params
