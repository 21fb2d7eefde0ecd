"""Run one HTTP request's prompts through the AsyncEngine: submit, merge the streams, watch for disconnects,
record metrics, and turn engine refusals into OpenAI errors. Shared by /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request

from model.engine import PLAIN, RequestOptions, RequestOutput, RequestStream, SamplingParams
from service.common.errors import APIError, status_of
from service.common.serving import Serving

log = logging.getLogger("llamascope.service")


@dataclass
class RunStats:
    """Per HTTP request: for usage, metrics and the log line."""

    endpoint: str
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    start: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    scheduled_at: float | None = None  # the engine's first admission of the first choice that answered
    first_output_at: float | None = None
    last_token_at: dict[int, float] = field(default_factory=dict)
    finish_reasons: list[str] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    adapter: str | None = None  # the LoRA adapter the request ran under
    params: SamplingParams | None = None  # as submitted (a request trace's attributes)


_SUBMITTED = object()  # run()'s first item for a final-only request, once the engine accepted it


async def start(state: Serving, prompts: list[list[int]], params: SamplingParams, stats: RunStats,
                options: RequestOptions = PLAIN) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Submit and wait for the first output, so that refusals (400 / 429 / 503) raise here, before a response
    starts. Returns the stream of (choice index, output), first one included; closing it aborts what is left.
    `options` apply to every prompt of the request. A final-only request's first output is its last, so for it
    this waits for the submission alone: the route's disconnect watch (collect) covers the generation."""
    stream = run(state, prompts, params, stats, options)
    try:
        first = await anext(stream)
    except Exception as e:
        finish(state, stats, status_of(e))
        raise

    async def outputs():
        try:
            if first is not _SUBMITTED:
                yield first
            async for item in stream:
                yield item
        finally:
            await stream.aclose()

    return outputs()


async def run(state: Serving, prompts: list[list[int]], params: SamplingParams, stats: RunStats,
              options: RequestOptions = PLAIN) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (choice index, output) for every prompt x n choice, as outputs arrive; choice index =
    prompt_index * n + choice (OpenAI's order). Engine refusals raise APIError before anything is yielded."""
    stats.prompts, stats.params = prompts, params
    stats.prompt_tokens = sum(len(p) for p in prompts)
    stats.adapter = options.lora
    # every prompt in one submission: admitted together, so they prefill in the same steps
    streams = await state.add_requests([(f"{stats.request_id}-{i}", p) for i, p in enumerate(prompts)], params, options)
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:  # forwarded to the consumer
            await queue.put((i, e))
            raise
        finally:
            stream.close()  # aborts the engine request if it did not finish (client gone, cancelled)
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    remaining = len(tasks)
    finished_before = len(stats.finish_reasons)
    try:
        if params.output_kind == "final":
            yield _SUBMITTED  # for start(): the refusals are behind us
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            choice = i * params.n + item.index
            _observe(state, stats, item, choice)
            yield choice, item
    finally:
        # Count first: under anyio (Starlette) a cancelled scope re-raises at every later await in this block.
        if len(stats.finish_reasons) - finished_before < len(prompts) * params.n:
            state.metrics.aborts.inc()  # the client left (or the route gave up) before every choice finished
        for t in tasks:
            t.cancel()  # each pump closes its stream as it unwinds, which aborts an unfinished engine request
        await asyncio.gather(*tasks, return_exceptions=True)


def _observe(state: Serving, stats: RunStats, out: RequestOutput, choice: int) -> None:
    now = time.perf_counter()
    m = state.metrics
    # a non-streamed request's one output comes at its end: its first token's time is the engine's stamp
    first = out.first_token_time if out.first_token_time is not None else now
    if stats.first_output_at is None:
        stats.first_output_at, stats.scheduled_at = first, out.scheduled_time
        m.queue.observe(first - stats.start)
    if out.token_ids:
        key = choice
        if stats.first_token_at is None:
            stats.first_token_at = first
            m.ttft.observe(first - stats.start)
        if out.token_gaps:  # a final-only output: the engine timed its steps
            for gap in out.token_gaps:
                m.itl.observe(gap)
        elif key in stats.last_token_at:
            m.itl.observe(now - stats.last_token_at[key])
        stats.last_token_at[key] = now
        stats.completion_tokens += len(out.token_ids)
        m.generation_tokens.inc(len(out.token_ids))
    if out.finished:
        stats.finish_reasons.append(out.finish_reason)
        m.finished.labels(out.finish_reason).inc()
        if out.index == 0:
            stats.cached_tokens += out.num_cached_tokens


async def until_disconnect(request: Request, coro):
    """Await `coro` (a non-streamed generation) unless the client leaves first; then cancel it, which aborts
    the engine request and frees its blocks. The body is read by now, so the connection's next message is its
    disconnect: one waiter for it (as Starlette's streamed responses listen), not a poll of every open request."""
    task = asyncio.ensure_future(coro)
    left = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            raise APIError(499, "client disconnected")
        return task.result()
    finally:
        left.cancel()
        if not task.done():
            task.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (or the server answered and the connection is done with this request); never,
    where the transport cannot tell (the generation then runs to its end, as it would without the client)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:
        await asyncio.Future()


async def collect_all(request: Request, state: Serving, stats: RunStats, coro):
    """A non-streamed request: run `coro` (which returns a tuple ending in an error message or None) to its end
    unless the client leaves, record the outcome, and raise the client's error (500 when generation failed)."""
    try:
        result = await until_disconnect(request, coro)
    except Exception as e:  # the client left (499), or the engine thread ended with this request open (503)
        finish(state, stats, status_of(e))
        raise
    if result[-1]:
        status = 503 if state.draining else 500  # ended by the shutdown deadline, not by a fault
        finish(state, stats, status)
        raise APIError(status, result[-1], code="generation_failed")
    finish(state, stats, 200)
    return result


def finish(state: Serving, stats: RunStats, status: int) -> None:
    """Request-level metrics and the one structured log line (no prompt text unless log_prompts)."""
    m = state.metrics
    now = time.perf_counter()
    if status == 200:  # requests_total is counted by the edge middleware, for every status
        m.e2e.observe(now - stats.start)
        m.prompt_len.observe(stats.prompt_tokens)
        m.gen_len.observe(stats.completion_tokens)
        m.prompt_tokens.inc(stats.prompt_tokens)
        m.cached_tokens.inc(stats.cached_tokens)
        if stats.adapter is not None:
            m.lora_requests.labels(stats.adapter).inc()
            m.lora_generation_tokens.labels(stats.adapter).inc(stats.completion_tokens)
    ttft = f"{(stats.first_token_at - stats.start) * 1e3:.0f}" if stats.first_token_at else "-"
    prompt = ""
    if state.settings.log_prompts and stats.prompts:  # opt-in only: prompts are user data
        prompt = " prompt=" + json.dumps([state.tokenizer.decode(p) for p in stats.prompts], ensure_ascii=False)
    log.info("request id=%s endpoint=%s status=%d prompt_tokens=%d completion_tokens=%d cached_tokens=%d "
             "ttft_ms=%s latency_ms=%.0f finish=%s%s", stats.request_id, stats.endpoint, status, stats.prompt_tokens,
             stats.completion_tokens, stats.cached_tokens, ttft, (now - stats.start) * 1e3,
             ",".join(stats.finish_reasons) or "-", prompt)
    if state.tracing is not None:  # --otlp-traces-endpoint (service/common/tracing.py)
        state.tracing.record(stats, status, stats.adapter or state.model_name, now)


async def collect(request: Request, state: Serving, stats: RunStats, outputs: AsyncIterator[tuple[int, RequestOutput]],
                  add: Callable[[int, RequestOutput], None]) -> dict[int, str | None]:
    """A non-streamed response: feed every output to `add` until each choice finished (or the client left), and
    return each choice's finish reason; a failed generation raises the client's error (collect_all)."""

    async def body():
        reasons: dict[int, str | None] = {}
        error = None
        try:
            async for choice, out in outputs:
                add(choice, out)
                error = error or out.error
                if out.finished:
                    reasons[choice] = out.finish_reason
            return reasons, error
        finally:
            await outputs.aclose()

    reasons, _ = await collect_all(request, state, stats, body())
    return reasons
