"""POST /v1/chat/completions: messages rendered with the checkpoint's chat template, then the engine."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from service.errors import APIError
from service.interventions import encode_hidden, merge_hidden, request_edits
from service.routes.common import chat_logprob, now, usage
from service.runner import RunStats, collect, start, stream_response
from service.sampling_params import to_sampling_params
from service.schemas import ChatCompletionRequest, ChatMessage
from service.serving import Serving, serving
from service.structured_outputs import compile_spec, requested_spec
from service.tool_calls import ChoiceMessage, ToolPlan, plan_tools, template_messages, template_renders_tools, template_tools

router = APIRouter()


def render_chat(state: Serving, messages: list[ChatMessage], add_generation_prompt: bool = True,
                plan: ToolPlan | None = None) -> list[int]:
    tok = state.tokenizer
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
async def chat_completions(req: ChatCompletionRequest, request: Request, state: Serving = Depends(serving)):
    state.check_model(req.model)
    tok = state.tokenizer
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
                                default_max_tokens=max(1, max_len - len(prompt)), max_model_len=max_len,
                                structured=plan.spec or structured)
    interventions, read, hidden_dtype = request_edits(req, state.vectors, state.config)
    stats = RunStats("chat")
    messages = {c: ChoiceMessage(plan) for c in range(params.n)}  # each choice's content or tool calls, parsed
    created, rid, model = now(), f"chatcmpl-{stats.request_id}", state.model_name
    outputs = await start(state, [prompt], params, stats, interventions, read)  # refusals raise here, before any response

    def envelope(choices: list[dict], **extra) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices,
                **extra}

    if req.stream:
        def chunk(choice: int, out) -> dict | None:
            lp = {"content": [chat_logprob(tok, l) for l in out.logprobs]} if out.logprobs else None
            delta = messages[choice].delta(out.text, out.finished)  # content, or tool-call deltas once parsed
            if delta is None and not out.finished and lp is None and out.hidden_states is None:
                return None
            c = {"index": choice, "delta": delta or {}, "logprobs": lp,
                 "finish_reason": messages[choice].finish_reason(out.finish_reason)}
            if read is not None:
                c["hidden_states"] = encode_hidden(out.hidden_states, hidden_dtype)
            return c

        head = [envelope([{"index": c, "delta": {"role": "assistant", "content": "" if plan.mode == "none" else None},
                           "logprobs": None, "finish_reason": None}]) for c in range(params.n)]  # the role first, as OpenAI
        return stream_response(state, stats, outputs, params.n, envelope, chunk, head=head,
                               include_usage=bool(req.stream_options and req.stream_options.include_usage))

    lps: dict[int, list] = {c: [] for c in range(params.n)}
    hidden: dict[int, list] = {c: [] for c in range(params.n)}

    def add(choice: int, out) -> None:
        messages[choice].delta(out.text, out.finished)
        lps[choice] += [chat_logprob(tok, l) for l in out.logprobs or []]
        if out.hidden_states is not None:
            hidden[choice].append(out.hidden_states)

    reasons = await collect(request, state, stats, outputs, add)
    choices = [{"index": c, "message": messages[c].message(), "logprobs": {"content": lps[c]} if req.logprobs else None,
                "finish_reason": messages[c].finish_reason(reasons.get(c))} for c in range(params.n)]
    if read is not None:
        for c in choices:
            c["hidden_states"] = encode_hidden(merge_hidden(hidden[c["index"]]), hidden_dtype)
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
        "usage": usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens),
    })
