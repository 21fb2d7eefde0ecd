"""The /v1/messages stream: server-sent events each named by its type (`event: content_block_delta` over `data:
{"type": "content_block_delta", ...}`; the `anthropic` package reads the name and skips unnamed events), in
Anthropic's order: message_start, ping, each content block's start, deltas and stop, message_delta, message_stop
(service/api/anthropic/reply.py builds them). A generation that fails, before or after the first block, ends the
stream with an `error` event and no message_stop, as Anthropic's does; the client leaving aborts the request at
once (as service/sse_response.py does for the chat stream)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from model.engine import RequestOutput
from service.api.anthropic.errors import sse_event
from service.api.anthropic.reply import MessageReply, usage
from service.api.openai.responses.output import event_text
from service.common.runner import RunStats, finish
from service.common.serving import Serving


def stream_message(serving: Serving, stats: RunStats, outputs: AsyncIterator[tuple[int, RequestOutput]],
                   reply: MessageReply) -> StreamingResponse:
    return StreamingResponse(_events(serving, stats, outputs, reply), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _events(serving: Serving, stats: RunStats, outputs: AsyncIterator[tuple[int, RequestOutput]],
                  reply: MessageReply) -> AsyncIterator[str]:
    status = 200
    started = False
    try:
        async for _, out in outputs:
            if not started:  # the first output knows how much of the prompt the prefix cache held
                started = True
                for event in reply.head(usage(stats.prompt_tokens, 0, out.num_cached_tokens)):
                    yield event_text(event)
            if out.error:
                status = 500
                yield sse_event(500, out.error)
                return
            for event in reply.add(out):
                yield event_text(event)
        for event in reply.tail(usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens)):
            yield event_text(event)
    except Exception:  # the engine failed mid-stream
        status = 500
        yield sse_event(500, "generation failed")
    finally:
        finish(serving, stats, status if stats.finish_reasons or status != 200 else 499)
        await outputs.aclose()  # at once, not at GC time: a client that left is aborted now
