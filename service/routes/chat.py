"""POST /v1/chat/completions: messages rendered with the checkpoint's chat template, then the engine."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from model.engine import RequestOptions, SamplingParams
from service.chat_choices import ChatChoices
from service.errors import APIError
from service.prepare import render_chat
from service.option_fields import hidden_dtype, to_options
from service.runner import RunStats, collect, start
from service.sampling_fields import to_sampling_params
from service.schemas import ChatCompletionRequest
from service.serving import Serving, get_serving
from service.sse_response import stream_response
from service.structured_outputs import compile_spec, requested_spec
from service.tool_calls import ToolPlan, plan_tools, template_renders_tools

router = APIRouter()


async def prepare(serving: Serving, req: ChatCompletionRequest, plan: ToolPlan,
                  prompt: list[int]) -> tuple[SamplingParams, RequestOptions]:
    """The request's sampling and options, every refusal raised before anything is submitted."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs", code="invalid_value")
    structured = requested_spec(req)
    if structured is not None and plan.calls_tools:
        raise APIError(400, f"{structured.source} cannot be combined with tool calls (tool_choice "
                       f"{plan.named or plan.mode.split('_')[0]}): give one output constraint", param=structured.source,
                       code="invalid_value")
    for spec in [*plan.tool_specs, plan.spec or structured]:  # each tool alone first: its error names the tool
        await compile_spec(serving, spec)
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = to_sampling_params(req, serving.settings, req.max_completion_tokens or req.max_tokens, top, None,
                                default_max_tokens=max(1, serving.max_model_len - len(prompt)))
    return params, to_options(req, serving, params, structured=plan.spec or structured)


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request, serving: Serving = Depends(get_serving)):
    serving.check_model(req.model)
    tok = serving.tokenizer
    tool_turns = any(m.tool_calls or m.role == "tool" for m in req.messages)
    plan = plan_tools(req, native=bool(req.tools or tool_turns) and template_renders_tools(tok))
    prompt = render_chat(serving, req.messages, req.add_generation_prompt, plan)
    params, options = await prepare(serving, req, plan, prompt)
    stats = RunStats("chat")
    choices = ChatChoices(tok, params.n, plan, bool(req.logprobs), f"chatcmpl-{stats.request_id}", serving.model_name,
                          hidden_dtype(req))
    outputs = await start(serving, [prompt], params, stats, options)  # refusals raise here, before any response
    if req.stream:
        return stream_response(serving, stats, outputs, choices,
                               include_usage=bool(req.stream_options and req.stream_options.include_usage))
    reasons = await collect(request, serving, stats, outputs, choices.add)
    return JSONResponse(choices.response(reasons, stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens))
