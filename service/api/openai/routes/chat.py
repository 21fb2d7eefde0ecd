"""POST /v1/chat/completions: messages rendered with the checkpoint's chat template, then the engine."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from service.api.openai.chat_choices import ChatChoices
from service.api.openai.option_fields import hidden_dtype
from service.api.openai.prepare import prepare_chat, reasoning_splits
from service.common.runner import RunStats, collect, start
from service.api.openai.schemas import ChatCompletionRequest
from service.common.serving import Serving, get_serving
from service.api.openai.sse_response import stream_response

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request, serving: Serving = Depends(get_serving)):
    adapter = serving.check_model(req.model, adapters=True)
    model = adapter or serving.model_name  # the base's name, or the adapter's
    run = await prepare_chat(serving, req, adapter)
    params = run.params
    stats = RunStats("chat")
    choices = ChatChoices(serving.tokenizer, params.n, run.plan, bool(req.logprobs), f"chatcmpl-{stats.request_id}",
                          model, hidden_dtype(req),
                          reasoning_splits(serving, req, run.text, run.options.structured is not None),
                          req.include_reasoning, req.features.sae if req.features is not None else None)
    outputs = await start(serving, [run.prompt], params, stats, run.options)  # refusals raise here, before any response
    if req.stream:
        return stream_response(serving, stats, outputs, choices,
                               include_usage=bool(req.stream_options and req.stream_options.include_usage))
    reasons = await collect(request, serving, stats, outputs, choices.add)
    return JSONResponse(choices.response(reasons, stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens))
