"""POST /v1/completions: OpenAI's legacy completions API (plus vLLM's sampling extensions)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from service.errors import APIError
from service.routes.common import DONE, LegacyLogprobs, now, sse, sse_error, usage
from service.routes.inspect import check_length, completion_summaries
from service.runner import RunStats, collect_all, finish, start, until_disconnect
from service.sampling_params import to_sampling_params
from service.schemas import CompletionRequest
from service.state import ServingState, check_model, serving
from service.structured_outputs import compile_spec, requested_spec

router = APIRouter()


def tokenize_prompts(state: ServingState, prompt) -> list[list[int]]:
    tok = state.loaded.tokenizer
    if isinstance(prompt, str):
        prompts = [tok.encode(prompt)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = [tok.encode(p) for p in prompt]
    else:
        prompts = [list(p) for p in prompt]
    if not prompts or any(not p for p in prompts):
        raise APIError(400, "prompt must not be empty", param="prompt", code="empty_prompt")
    if len(prompts) > state.settings.max_prompts:
        raise APIError(400, f"at most {state.settings.max_prompts} prompts per request, got {len(prompts)}", param="prompt")
    V = state.loaded.model.config.vocab_size
    if any(t >= V for p in prompts for t in p):
        raise APIError(400, f"prompt token ids must be below the vocabulary size {V}", param="prompt", code="invalid_token")
    return prompts


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, state: ServingState = Depends(serving)):
    check_model(state, req.model)
    prompts = tokenize_prompts(state, req.prompt)
    max_len = state.max_model_len
    structured = requested_spec(req)
    await compile_spec(state, structured)
    params = to_sampling_params(req, state.settings, req.max_tokens, req.logprobs,
                                req.logprobs if req.echo and req.logprobs is not None else None,
                                default_max_tokens=max(1, max_len - max(len(p) for p in prompts)),
                                structured=structured)
    stats = RunStats("completions")
    tok = state.loaded.tokenizer
    n_choices = len(prompts) * params.n
    created, rid, model = now(), f"cmpl-{stats.request_id}", state.model_name
    if req.inspect:
        for p in prompts:
            check_length(state, len(p))
    outputs = await start(state, prompts, params, stats)  # refusals raise here, before any response
    # the `inspect` extension: probes step on the engine thread between generation steps
    inspection = asyncio.ensure_future(completion_summaries(state, prompts, req.inspect)) if req.inspect else None

    def echo_text(choice: int) -> str:
        return tok.decode(prompts[choice // params.n]) if req.echo else ""

    def echo_logprobs(choice: int, out) -> LegacyLogprobs | None:
        if req.logprobs is None:
            return None
        lp = LegacyLogprobs(tok)
        if req.echo:
            prompt = prompts[choice // params.n]
            pls = out.prompt_logprobs or [None] * len(prompt)
            for t, pl in zip(prompt, pls):
                lp.add(t, pl)
        return lp

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            status = 200
            started: set[int] = set()
            try:
                async for choice, out in outputs:
                    text, lp = out.text, None
                    if choice not in started:
                        started.add(choice)
                        text = echo_text(choice) + text
                        lp = echo_logprobs(choice, out)
                    if req.logprobs is not None:
                        lp = lp or LegacyLogprobs(tok)
                        for t, l in zip(out.token_ids, out.logprobs or [None] * len(out.token_ids)):
                            lp.add(t, l)
                    if out.error:
                        status = 500
                        yield sse_error(500, out.error)
                        continue
                    if not text and not out.finished and lp is None:
                        continue
                    yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                               "choices": [{"index": choice, "text": text, "logprobs": lp.as_dict() if lp else None,
                                            "finish_reason": out.finish_reason}]})
                if inspection is not None:
                    yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                               "choices": [], "inspect": await inspection})
                if include_usage:
                    yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                               "choices": [], "usage": usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens)})
                yield DONE
            except Exception:  # the engine failed mid-stream: an error event, then the end of the stream
                status = 500
                yield sse_error(500, "generation failed")
                yield DONE
            finally:
                finish(state, stats, status if len(stats.finish_reasons) == n_choices or status != 200 else 499)
                if inspection is not None:
                    inspection.cancel()
                await outputs.aclose()  # at once, not at GC time: a client that left is aborted now

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def collect():
        try:
            texts = {c: echo_text(c) for c in range(n_choices)}
            lps: dict[int, LegacyLogprobs | None] = {}
            reasons: dict[int, str | None] = {}
            error = None
            async for choice, out in outputs:
                if choice not in lps:
                    lps[choice] = echo_logprobs(choice, out)
                texts[choice] += out.text
                if lps[choice] is not None:
                    for t, l in zip(out.token_ids, out.logprobs or [None] * len(out.token_ids)):
                        lps[choice].add(t, l)
                if out.error:
                    error = out.error
                if out.finished:
                    reasons[choice] = out.finish_reason
            return texts, lps, reasons, error
        finally:
            await outputs.aclose()

    try:
        texts, lps, reasons, _ = await collect_all(request, state, stats, collect())
        extra = {"inspect": await until_disconnect(request, inspection)} if inspection is not None else {}
    finally:
        if inspection is not None:
            inspection.cancel()
    return JSONResponse({
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": c, "text": texts[c], "logprobs": lps[c].as_dict() if lps.get(c) else None,
                     "finish_reason": reasons.get(c)} for c in range(n_choices)],
        "usage": usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens),
        **extra,
    })
