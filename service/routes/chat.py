"""POST /v1/chat/completions: messages rendered with the checkpoint's chat template, then the engine."""

from __future__ import annotations

import dataclasses
from functools import partial

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from model.engine import RequestOptions, SamplingParams
from model.text.reasoning import ReasoningParser
from service.chat_choices import ChatChoices
from service.errors import APIError
from service.prepare import render_chat_prompt
from service.request_options import hidden_dtype, to_options
from service.runner import RunStats, collect, start, stream_response
from service.sampling_params import to_sampling_params
from service.schemas import ChatCompletionRequest
from service.serving import Serving, serving
from service.structured_outputs import compile_spec, requested_spec
from service.tool_calls import ToolPlan, plan_tools, template_renders_tools
from service.tool_parsers import template_tool_format

router = APIRouter()


async def prepare(state: Serving, req: ChatCompletionRequest, plan: ToolPlan,
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
        await compile_spec(state, spec)
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = to_sampling_params(req, state.settings, req.max_completion_tokens or req.max_tokens, top, None,
                                default_max_tokens=max(1, state.max_model_len - len(prompt)))
    if plan.mode == "auto_template" and "mistral" in (plan.parser, plan.template_format):
        # Mistral's [TOOL_CALLS] is a control token: kept in the text for the parser (vLLM's MistralToolParser
        # adjust_request does the same)
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params, to_options(req, state, params, structured=plan.spec or structured)


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
    tok = state.tokenizer
    tool_turns = any(m.tool_calls or m.role == "tool" for m in req.messages)
    plan = plan_tools(req, native=bool(req.tools or tool_turns) and template_renders_tools(tok),
                      parser=state.settings.tool_call_parser, template_format=template_tool_format(tok.chat_template))
    text, prompt = render_chat_prompt(state, req.messages, req.add_generation_prompt, plan, req.chat_template_kwargs)
    params, options = await prepare(state, req, plan, prompt)
    stats = RunStats("chat")
    choices = ChatChoices(tok, params.n, plan, bool(req.logprobs), f"chatcmpl-{stats.request_id}", state.model_name,
                          hidden_dtype(req), reasoning_splits(state, req, text, options.structured is not None),
                          req.include_reasoning)
    outputs = await start(state, [prompt], params, stats, options)  # refusals raise here, before any response
    if req.stream:
        return stream_response(state, stats, outputs, params.n, choices.envelope, choices.chunk, head=choices.head(),
                               include_usage=bool(req.stream_options and req.stream_options.include_usage))
    reasons = await collect(request, state, stats, outputs, choices.add)
    return JSONResponse(choices.response(reasons, stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens))
