"""POST /v1/messages (Anthropic's Messages API), run as a chat completion (service/api/anthropic/conversion.py), its
reply spoken as content blocks and stream events (reply.py, stream.py); POST /v1/messages/count_tokens, the prompt
the same request would run, counted. Errors in Anthropic's envelope (errors.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from service.api.anthropic.conversion import chat_request, in_anthropic_terms, thinking_off
from service.api.anthropic.reply import MessageReply, usage
from service.api.anthropic.schemas import CountTokensRequest, MessagesRequest
from service.api.anthropic.stream import stream_message
from service.common.errors import APIError
from service.api.openai.prepare import prepare_chat, reasoning_splits
from service.common.runner import RunStats, collect, start
from service.common.serving import Serving, get_serving

router = APIRouter()


@router.post("/v1/messages")
async def create_message(req: MessagesRequest, request: Request, serving: Serving = Depends(get_serving)):
    adapter = serving.check_model(req.model, adapters=True)
    model = adapter or serving.model_name  # the adapter's name, or the base's
    stats = RunStats("messages")
    try:
        chat = chat_request(req)
        run = await prepare_chat(serving, chat, adapter)
        thinking = req.thinking
        reply = MessageReply(run.plan, f"msg_{stats.request_id}", model, list(req.stop_sequences or []),
                             reasoning_splits(serving, chat, run.text, run.options.structured is not None),
                             show_thinking=not thinking_off(req),
                             omit_thinking=thinking is not None and thinking.display == "omitted")
        outputs = await start(serving, [run.prompt], run.params, stats, run.options)  # refusals raise here
    except APIError as e:
        raise in_anthropic_terms(e) from None
    if req.stream:
        return stream_message(serving, stats, outputs, reply)
    await collect(request, serving, stats, outputs, lambda _, o: reply.add(o))
    return JSONResponse(reply.message(usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens)))


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, serving: Serving = Depends(get_serving)):
    adapter = serving.check_model(req.model, adapters=True)
    try:
        run = await prepare_chat(serving, chat_request(req), adapter)  # the very prompt /v1/messages would run
    except APIError as e:
        raise in_anthropic_terms(e) from None
    return {"input_tokens": len(run.prompt)}
