"""POST /v1/completions: OpenAI's legacy completions API (plus vLLM's sampling extensions)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from service.api.openai.completion_choices import CompletionChoices
from service.api.openai.format import usage
from service.api.openai.option_fields import hidden_dtype
from service.api.openai.prepare import prepare_completion
from service.api.openai.schemas import CompletionRequest
from service.common.runner import RunStats, collect, start, until_disconnect
from service.common.serving import Serving, get_serving
from service.api.openai.sse_response import stream_response
from service.microscope.probing import completion_summaries

router = APIRouter()


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, serving: Serving = Depends(get_serving)):
    adapter = serving.check_model(req.model, adapters=True)
    run = prepare_completion(serving, req, adapter)
    prompts, params, options = run.prompts, run.params, run.options
    stats = RunStats("completions")
    outputs = await start(serving, prompts, params, stats, options)  # refusals raise here, before any response
    # the `inspect` extension: probes step on the engine thread between generation steps (under the same edits);
    # with inspect.stream, per-token telemetry instead
    inspection = None
    if req.inspect and options.telemetry is None:
        inspection = asyncio.ensure_future(completion_summaries(serving, prompts, req.inspect, options.interventions,
                                                                options.lora))
    choices = CompletionChoices(serving.tokenizer, prompts, params.n, req, f"cmpl-{stats.request_id}",
                                adapter or serving.model_name, hidden_dtype(req), inspection)
    if not req.stream:
        try:
            reasons = await collect(request, serving, stats, outputs, choices.add)
            extra = {} if inspection is None else {"inspect": await until_disconnect(request, inspection)}
        finally:
            choices.close()
        return JSONResponse(choices.envelope(choices.collected(reasons),
                                             usage=usage(stats.prompt_tokens, stats.completion_tokens,
                                                         stats.cached_tokens), **extra))
    return stream_response(serving, stats, outputs, choices,
                           include_usage=bool(req.stream_options and req.stream_options.include_usage))
