"""POST /v1/chat/completions: messages rendered with the checkpoint's chat template, then the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from service.errors import APIError
from service.routes.common import DONE, chat_logprob, now, sse, sse_error, usage
from service.runner import RunStats, collect_all, finish, start
from service.sampling_params import to_sampling_params
from service.schemas import ChatCompletionRequest, ChatMessage
from service.state import ServingState, check_model, serving
from service.structured_outputs import compile_spec, requested_spec
from service.tool_calls import ChoiceMessage, ToolPlan, plan_tools, template_messages, template_renders_tools, template_tools

router = APIRouter()


def render_chat(state: ServingState, messages: list[ChatMessage], add_generation_prompt: bool = True,
                plan: ToolPlan | None = None) -> list[int]:
    tok = state.loaded.tokenizer
    plan = plan or ToolPlan("none")
    try:
        text = tok.apply_chat_template(template_messages(messages, plan), add_generation_prompt=add_generation_prompt,
                                       tools=template_tools(plan))
    except Exception as e:  # no template, or the template's own raise_exception (e.g. roles out of order)
        raise APIError(400, f"cannot render the chat template: {e}", param="messages", code="chat_template") from None
    ids = tok.encode(text, add_bos=False)  # the template writes any BOS itself (transformers: add_special_tokens=False)
    if not ids:
        raise APIError(400, "the rendered conversation is empty", param="messages", code="empty_prompt")
    return ids


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request, state: ServingState = Depends(serving)):
    check_model(state, req.model)
    tok = state.loaded.tokenizer
    tool_turns = any(m.tool_calls or m.role == "tool" for m in req.messages)
    plan = plan_tools(req, native=bool(req.tools or tool_turns) and template_renders_tools(tok))
    prompt = render_chat(state, req.messages, req.add_generation_prompt, plan)
    max_len = state.max_model_len
    top = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs", code="invalid_value")
    structured = requested_spec(req)
    if structured is not None and plan.calls_tools:
        raise APIError(400, f"{structured.source} cannot be combined with tool calls (tool_choice "
                       f"{plan.named or plan.mode.split('_')[0]}): give one output constraint", param=structured.source,
                       code="invalid_value")
    for spec in [*plan.tool_specs, plan.spec or structured]:  # each tool alone first: its error names the tool
        await compile_spec(state, spec)
    params = to_sampling_params(req, state.settings, req.max_completion_tokens or req.max_tokens, top, None,
                                default_max_tokens=max(1, max_len - len(prompt)), structured=plan.spec or structured)
    stats = RunStats("chat")
    messages = {c: ChoiceMessage(plan) for c in range(params.n)}
    created, rid, model = now(), f"chatcmpl-{stats.request_id}", state.model_name
    outputs = await start(state, [prompt], params, stats)  # refusals raise here, before any response

    def chunk(choices: list[dict], **extra) -> str:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": choices, **extra})

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            status = 200
            try:
                for c in range(params.n):  # the role comes first, as OpenAI sends it
                    role = {"role": "assistant", "content": "" if plan.mode == "none" else None}
                    yield chunk([{"index": c, "delta": role, "logprobs": None, "finish_reason": None}])
                async for choice, out in outputs:
                    if out.error:
                        status = 500
                        yield sse_error(500, out.error)
                        continue
                    lp = {"content": [chat_logprob(tok, l) for l in out.logprobs]} if out.logprobs else None
                    delta = messages[choice].delta(out.text, out.finished)
                    if delta is None and not out.finished and lp is None:
                        continue
                    yield chunk([{"index": choice, "delta": delta or {}, "logprobs": lp,
                                  "finish_reason": messages[choice].finish_reason(out.finish_reason)}])
                if include_usage:
                    yield chunk([], usage=usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens))
                yield DONE
            except Exception:
                status = 500
                yield sse_error(500, "generation failed")
                yield DONE
            finally:
                finish(state, stats, status if len(stats.finish_reasons) == params.n or status != 200 else 499)
                await outputs.aclose()  # at once, not at GC time: a client that left is aborted now

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def collect():
        try:
            lps: dict[int, list] = {c: [] for c in range(params.n)}
            reasons: dict[int, str | None] = {}
            error = None
            async for choice, out in outputs:
                messages[choice].delta(out.text, out.finished)
                lps[choice] += [chat_logprob(tok, l) for l in out.logprobs or []]
                error = error or out.error
                if out.finished:
                    reasons[choice] = out.finish_reason
            return lps, reasons, error
        finally:
            await outputs.aclose()

    lps, reasons, _ = await collect_all(request, state, stats, collect())
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": c, "message": messages[c].message(), "logprobs": {"content": lps[c]} if req.logprobs
                     else None, "finish_reason": messages[c].finish_reason(reasons.get(c))} for c in range(params.n)],
        "usage": usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens),
    })
