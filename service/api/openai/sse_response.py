"""The SSE response both generation routes send, from one `StreamedChoices` object: what the route's choices look
like on the wire (OpenAI's completion or chat chunk), what opens and closes the stream, and how many choices must
finish for the request to count as complete."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from fastapi.responses import StreamingResponse

from model.engine import RequestOutput
from service.api.openai.format import DONE, sse, sse_error, usage
from service.common.runner import RunStats, finish
from service.common.serving import Serving


class StreamedChoices(Protocol):
    """A request's choices as a stream (service/api/openai/completion_choices.py, service/api/openai/chat_choices.py)."""

    count: int  # the choices the request asked for: fewer finished means the client left (499)

    def envelope(self, choices: list[dict], **extra) -> dict:
        """Choice dicts wrapped in the route's chunk object."""

    def head(self) -> list[dict]:
        """The chunks sent before any output (chat: each choice's role)."""

    def chunk(self, choice: int, out: RequestOutput) -> dict | None:
        """One output's choice dict, or None to send nothing for it."""

    async def tail(self) -> dict | None:
        """A last chunk after every choice finished (completions: the `inspect` summary), or None."""

    def close(self) -> None:
        """The stream ended, however: release what the choices started (completions: a running inspection)."""


def stream_response(serving: Serving, stats: RunStats, outputs: AsyncIterator[tuple[int, RequestOutput]],
                    choices: StreamedChoices, include_usage: bool) -> StreamingResponse:
    """`choices.head()`, one chunk per output, `choices.tail()`, the usage chunk if asked, and `[DONE]`. A failed
    choice is an error event; a failure mid-stream ends the stream with one."""

    async def events() -> AsyncIterator[str]:
        status = 200
        try:
            for payload in choices.head():
                yield sse(payload)
            async for choice, out in outputs:
                if out.error:
                    status = 500
                    yield sse_error(500, out.error)
                    continue
                c = choices.chunk(choice, out)
                if c is not None:
                    yield sse(choices.envelope([c]))
            last = await choices.tail()
            if last is not None:
                yield sse(last)
            if include_usage:
                yield sse(choices.envelope([], usage=usage(stats.prompt_tokens, stats.completion_tokens,
                                                           stats.cached_tokens)))
            yield DONE
        except Exception:  # the engine failed mid-stream: an error event, then the end of the stream
            status = 500
            yield sse_error(500, "generation failed")
            yield DONE
        finally:
            finish(serving, stats, status if len(stats.finish_reasons) == choices.count or status != 200 else 499)
            choices.close()
            await outputs.aclose()  # at once, not at GC time: a client that left is aborted now

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
