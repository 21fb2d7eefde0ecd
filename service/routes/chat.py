"""POST /v1/chat/completions: messages rendered with the checkpoint's chat template, then the engine."""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from model.text.reasoning import ReasoningParser
from service.chat_choices import ChatChoices
from service.prepare import prepare_chat
from service.request_options import hidden_dtype
from service.runner import RunStats, collect, start, stream_response
from service.schemas import ChatCompletionRequest
from service.serving import Serving, serving

router = APIRouter()


def reasoning_splits(state: Serving, req: ChatCompletionRequest, prompt_text: str, constrained: bool):
    """A new reasoning split per choice under --reasoning-parser (None without one). A grammar-constrained reply
    has no room for a reasoning block, and Qwen3's `enable_thinking: false` turns it off: both are all content."""
    name = state.settings.reasoning_parser
    if name is None:
        return None
    switched_off = name == "qwen3" and (req.chat_template_kwargs or {}).get("enable_thinking", True) is False
    thinking = not constrained and not switched_off
    return partial(ReasoningParser(name).split, prompt_text, thinking)


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request, state: Serving = Depends(serving)):
    state.check_model(req.model)
    run = await prepare_chat(state, req)
    params = run.params
    stats = RunStats("chat")
    choices = ChatChoices(state.tokenizer, params.n, run.plan, bool(req.logprobs), f"chatcmpl-{stats.request_id}",
                          state.model_name, hidden_dtype(req),
                          reasoning_splits(state, req, run.text, run.options.structured is not None),
                          req.include_reasoning)
    outputs = await start(state, [run.prompt], params, stats, run.options)  # refusals raise here, before any response
    if req.stream:
        return stream_response(state, stats, outputs, params.n, choices.envelope, choices.chunk, head=choices.head(),
                               include_usage=bool(req.stream_options and req.stream_options.include_usage))
    reasons = await collect(request, state, stats, outputs, choices.add)
    return JSONResponse(choices.response(reasons, stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens))
