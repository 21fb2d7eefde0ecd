"""POST /v1/completions: OpenAI's legacy completions API (plus vLLM's sampling extensions)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from model.engine import RequestOptions, SamplingParams, TelemetryOptions
from service.completion_choices import CompletionChoices
from service.errors import APIError
from service.prepare import check_inspect_length, tokenize_prompts
from service.probing import completion_summaries
from service.request_options import hidden_dtype, to_options
from service.openai_format import usage
from service.runner import RunStats, collect, start, stream_response, until_disconnect
from service.sampling_params import to_sampling_params
from service.schemas import CompletionRequest, InspectSummaryOptions
from service.serving import Serving, serving
from service.structured_outputs import compile_spec, requested_spec

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


async def prepare(state: Serving, req: CompletionRequest, prompts: list[list[int]]) -> tuple[SamplingParams, RequestOptions]:
    """The request's sampling and options, every refusal raised before anything is submitted."""
    telemetry = stream_telemetry(req)
    structured = requested_spec(req)
    await compile_spec(state, structured)
    prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
    params = to_sampling_params(req, state.settings, req.max_tokens, req.logprobs, prompt_lp,
                                default_max_tokens=max(1, state.max_model_len - max(len(p) for p in prompts)))
    if req.inspect and telemetry is None:  # the summary inspects each prompt: the inspection limit applies
        for p in prompts:
            check_inspect_length(state, len(p))
    return params, to_options(req, state, params, telemetry, structured)


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, state: Serving = Depends(serving)):
    state.check_model(req.model)
    prompts = tokenize_prompts(state, req.prompt)
    params, options = await prepare(state, req, prompts)
    stats = RunStats("completions")
    choices = CompletionChoices(state.tokenizer, prompts, params.n, req, f"cmpl-{stats.request_id}", state.model_name,
                                hidden_dtype(req))
    outputs = await start(state, prompts, params, stats, options)  # refusals raise here, before any response
    # the `inspect` extension: probes step on the engine thread between generation steps (under the same edits);
    # with inspect.stream, per-token telemetry instead
    inspection = asyncio.ensure_future(completion_summaries(state, prompts, req.inspect, options.interventions)) \
        if req.inspect and options.telemetry is None else None
    close = inspection.cancel if inspection is not None else None
    if req.stream:
        async def inspect_chunk() -> dict:
            return choices.envelope([], inspect=await inspection)

        return stream_response(state, stats, outputs, choices.count, choices.envelope, choices.chunk,
                               tail=inspect_chunk if inspection is not None else None,
                               include_usage=bool(req.stream_options and req.stream_options.include_usage), on_close=close)
    try:
        reasons = await collect(request, state, stats, outputs, choices.add)
        extra = {"inspect": await until_disconnect(request, inspection)} if inspection is not None else {}
    finally:
        if close is not None:
            close()
    return JSONResponse(choices.envelope(choices.collected(reasons),
                                         usage=usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens),
                                         **extra))
