"""POST /v1/completions: OpenAI's legacy completions API (plus vLLM's sampling extensions)."""

from __future__ import annotations

import asyncio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from model.engine import TelemetryOptions
from service import inspect_format as fmt
from service.errors import APIError
from service.interventions import encode_hidden, merge_hidden, request_edits
from service.routes.common import LegacyLogprobs, now, usage
from service.routes.inspect import check_length, completion_summaries
from service.runner import RunStats, collect, start, stream_response, until_disconnect
from service.sampling_params import to_sampling_params
from service.schemas import CompletionRequest, InspectSummaryOptions
from service.serving import Serving, serving
from service.structured_outputs import compile_spec, requested_spec

router = APIRouter()


def tokenize_prompts(state: Serving, prompt) -> list[list[int]]:
    tok = state.tokenizer
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
    V = state.config.vocab_size
    if any(t >= V for p in prompts for t in p):
        raise APIError(400, f"prompt token ids must be below the vocabulary size {V}", param="prompt", code="invalid_token")
    return prompts


def stream_telemetry(req: CompletionRequest) -> TelemetryOptions | None:
    """`inspect: {"stream": true}`: per-token attention telemetry, which only a streamed completion can carry."""
    o = req.inspect
    if not isinstance(o, InspectSummaryOptions) or not o.stream:
        return None
    if not req.stream:
        raise APIError(400, "inspect.stream needs stream: true (the telemetry travels in each token's chunk)",
                       param="inspect", code="invalid_value")
    return TelemetryOptions(top_k=o.top_k, massive_threshold=o.massive_threshold, massive_ratio=o.massive_ratio)


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, state: Serving = Depends(serving)):
    state.check_model(req.model)
    prompts = tokenize_prompts(state, req.prompt)
    max_len = state.max_model_len
    telemetry = stream_telemetry(req)
    structured = requested_spec(req)
    await compile_spec(state, structured)
    params = to_sampling_params(req, state.settings, req.max_tokens, req.logprobs,
                                req.logprobs if req.echo and req.logprobs is not None else None,
                                default_max_tokens=max(1, max_len - max(len(p) for p in prompts)),
                                max_model_len=max_len, telemetry=telemetry, structured=structured)
    interventions, read, hidden_dtype = request_edits(req, state.vectors, state.config)
    stats = RunStats("completions")
    tok = state.tokenizer
    n_choices = len(prompts) * params.n
    created, rid, model = now(), f"cmpl-{stats.request_id}", state.model_name
    summarize = bool(req.inspect) and telemetry is None  # with stream: true, per-token telemetry instead
    if summarize:
        for p in prompts:
            check_length(state, len(p))
    outputs = await start(state, prompts, params, stats, interventions, read)  # refusals raise here, before any response
    # the `inspect` extension: probes step on the engine thread between generation steps (under the same edits)
    inspection = asyncio.ensure_future(completion_summaries(state, prompts, req.inspect, interventions)) \
        if summarize else None

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

    def add_logprobs(lp: LegacyLogprobs | None, out) -> LegacyLogprobs | None:
        if lp is not None:
            for t, l in zip(out.token_ids, out.logprobs or [None] * len(out.token_ids)):
                lp.add(t, l)
        return lp

    def envelope(choices: list[dict], **extra) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices, **extra}

    started: set[int] = set()
    close = inspection.cancel if inspection is not None else None
    if req.stream:
        def chunk(choice: int, out) -> dict | None:
            if choice in started:  # a chunk's logprobs are its own tokens' (the prompt's came with the first)
                text, lp = out.text, LegacyLogprobs(tok) if req.logprobs is not None else None
            else:
                text, lp = echo_text(choice) + out.text, echo_logprobs(choice, out)
                started.add(choice)
            lp = add_logprobs(lp, out)
            if not text and not out.finished and lp is None and out.hidden_states is None and out.telemetry is None:
                return None
            c = {"index": choice, "text": text, "logprobs": lp.as_dict() if lp else None, "finish_reason": out.finish_reason}
            if read is not None:
                c["hidden_states"] = encode_hidden(out.hidden_states, hidden_dtype)
            if out.telemetry is not None:  # every token's chunk is sent, with what produced it
                c["token_id"], c["inspect"] = out.token_ids[0], fmt.token_telemetry(out.telemetry)
            return c

        async def inspect_chunk() -> dict:
            return envelope([], inspect=await inspection)

        return stream_response(state, stats, outputs, n_choices, envelope, chunk,
                               tail=inspect_chunk if inspection is not None else None,
                               include_usage=bool(req.stream_options and req.stream_options.include_usage), on_close=close)

    texts = {c: echo_text(c) for c in range(n_choices)}
    lps: dict[int, LegacyLogprobs | None] = {}
    hidden: dict[int, list] = {c: [] for c in range(n_choices)}

    def add(choice: int, out) -> None:
        texts[choice] += out.text
        if choice not in lps:
            lps[choice] = echo_logprobs(choice, out)
        add_logprobs(lps[choice], out)
        if out.hidden_states is not None:
            hidden[choice].append(out.hidden_states)

    try:
        reasons = await collect(request, state, stats, outputs, add)
        extra = {"inspect": await until_disconnect(request, inspection)} if inspection is not None else {}
    finally:
        if close is not None:
            close()
    choices = [{"index": c, "text": texts[c], "logprobs": lps[c].as_dict() if lps.get(c) else None,
                "finish_reason": reasons.get(c)} for c in range(n_choices)]
    if read is not None:
        for c in choices:
            c["hidden_states"] = encode_hidden(merge_hidden(hidden[c["index"]]), hidden_dtype)
    return JSONResponse(envelope(choices, usage=usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens),
                                 **extra))
