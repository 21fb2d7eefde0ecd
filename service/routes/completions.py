"""POST /v1/completions: OpenAI's legacy completions API (plus vLLM's sampling extensions)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from model.engine import RequestOptions, SamplingParams
from model.features import TelemetryOptions
from service.completion_choices import CompletionChoices
from service.errors import APIError
from service.prepare import check_inspect_length, tokenize_prompts
from service.probing import completion_summaries
from service.option_fields import hidden_dtype, to_options
from service.openai_format import usage
from service.runner import RunStats, collect, start, until_disconnect
from service.sampling_fields import to_sampling_params
from service.schemas import CompletionRequest, InspectSummaryOptions
from service.serving import Serving, get_serving
from service.sse_response import stream_response
from service.structured_outputs import requested_spec

router = APIRouter()


def stream_telemetry(req: CompletionRequest) -> TelemetryOptions | None:
    """`inspect: {"stream": true}`: per-token attention telemetry, which only a streamed completion can carry."""
    o = req.inspect
    if not isinstance(o, InspectSummaryOptions) or not o.stream:
        return None
    if not req.stream:
        raise APIError(400, "inspect.stream needs stream: true (the telemetry travels in each token's chunk)",
                       param="inspect", code="invalid_value")
    return TelemetryOptions(top_k=o.top_k, massive_threshold=o.massive_threshold, massive_ratio=o.massive_ratio)


async def prepare(serving: Serving, req: CompletionRequest,
                  prompts: list[list[int]]) -> tuple[SamplingParams, RequestOptions]:
    """The request's sampling and options, every refusal raised before anything is submitted."""
    telemetry = stream_telemetry(req)
    structured = requested_spec(req)
    prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
    params = to_sampling_params(req, serving.settings, req.max_tokens, req.logprobs, prompt_lp,
                                default_max_tokens=max(1, serving.max_model_len - max(len(p) for p in prompts)))
    if req.inspect and telemetry is None:  # the summary inspects each prompt: the inspection limit applies
        for p in prompts:
            check_inspect_length(serving, len(p))
    return params, await to_options(req, serving, params, telemetry, structured)


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, serving: Serving = Depends(get_serving)):
    model = serving.check_model(req.model, adapters=True) or serving.model_name  # the base's name, or the adapter's
    prompts = tokenize_prompts(serving, req.prompt)
    params, options = await prepare(serving, req, prompts)
    stats = RunStats("completions")
    choices = CompletionChoices(serving.tokenizer, prompts, params.n, req, f"cmpl-{stats.request_id}",
                                model, hidden_dtype(req))
    outputs = await start(serving, prompts, params, stats, options)  # refusals raise here, before any response
    # the `inspect` extension: probes step on the engine thread between generation steps (under the same edits);
    # with inspect.stream, per-token telemetry instead
    if req.inspect and options.telemetry is None:
        choices.inspection = asyncio.ensure_future(completion_summaries(serving, prompts, req.inspect,
                                                                        options.interventions, options.lora))
    if req.stream:
        return stream_response(serving, stats, outputs, choices,
                               include_usage=bool(req.stream_options and req.stream_options.include_usage))
    try:
        reasons = await collect(request, serving, stats, outputs, choices.add)
        extra = {} if choices.inspection is None else {"inspect": await until_disconnect(request, choices.inspection)}
    finally:
        choices.close()
    return JSONResponse(choices.envelope(choices.collected(reasons),
                                         usage=usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens),
                                         **extra))
