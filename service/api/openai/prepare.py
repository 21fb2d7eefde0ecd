"""Request preparation the routes share: prompts to token ids (a completions prompt in any of its four forms, chat
messages through the checkpoint's template), a whole completions request and a whole chat request (for
/v1/chat/completions and /v1/responses, which runs as one), each refusal a 400 / 413 naming the field. Routes import
these from here, never from one another."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

from model.engine import RequestOptions, SamplingParams
from model.features import TelemetryOptions
from model.text.reasoning import ReasoningParser
from service.common.errors import APIError
from service.api.openai.option_fields import to_options
from service.api.openai.sampling_fields import to_sampling_params
from service.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from service.common.fields import ChatMessage
from service.microscope.schemas import InspectSummaryOptions
from service.common.serving import Serving
from service.api.openai.structured_outputs import requested_spec
from service.microscope.probing import check_inspect_length
from service.api.openai.tool_calls import ToolPlan, plan_tools, template_messages, template_renders_tools, template_tools
from service.api.openai.tool_parsers import template_tool_format


def tokenize_prompts(serving: Serving, prompt) -> list[list[int]]:
    """A completions `prompt` (a string, a list of strings, token ids, or lists of token ids) -> one id list each."""
    tok = serving.tokenizer
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
    if len(prompts) > serving.settings.max_prompts:
        raise APIError(400, f"at most {serving.settings.max_prompts} prompts per request, got {len(prompts)}",
                       param="prompt")
    check_token_ids([t for p in prompts for t in p], serving, "prompt")
    return prompts


def check_token_ids(ids: list[int], serving: Serving, param: str) -> None:
    V = serving.config.vocab_size
    if any(t >= V for t in ids):
        raise APIError(400, f"{param}: token ids must be below the vocabulary size {V}", param=param, code="invalid_token")


def render_chat(serving: Serving, messages: list[ChatMessage], add_generation_prompt: bool = True,
                plan: ToolPlan | None = None, template_kwargs: dict | None = None) -> list[int]:
    """Chat messages (and the tools of `plan`) through the checkpoint's chat template -> token ids."""
    return render_chat_prompt(serving, messages, add_generation_prompt, plan, template_kwargs)[1]


def render_chat_prompt(serving: Serving, messages: list[ChatMessage], add_generation_prompt: bool = True,
                       plan: ToolPlan | None = None, template_kwargs: dict | None = None) -> tuple[str, list[int]]:
    """The rendered conversation and its token ids. `template_kwargs`: the request's `chat_template_kwargs`, of
    which the template gets those it reads (vLLM's resolve_chat_template_kwargs)."""
    tok = serving.tokenizer
    plan = plan or ToolPlan("none")
    extra = {}
    if template_kwargs and tok.template is not None:
        try:
            extra = tok.template.accepted_kwargs(template_kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param="chat_template_kwargs", code="invalid_value") from None
    try:
        text = tok.apply_chat_template(template_messages(messages, plan), add_generation_prompt=add_generation_prompt,
                                       tools=template_tools(plan), **extra)
    except Exception as e:  # no template, or the template's own raise_exception (e.g. roles out of order)
        raise APIError(400, f"cannot render the chat template: {e}", param="messages", code="chat_template") from None
    ids = tok.encode(text, add_bos=False)  # the template writes any BOS itself (transformers: add_special_tokens=False)
    if not ids:
        raise APIError(400, "the rendered conversation is empty", param="messages", code="empty_prompt")
    return text, ids


@dataclass
class CompletionRun:
    """What a completions request runs as: its prompts' token ids, sampling and options."""

    prompts: list[list[int]]
    params: SamplingParams
    options: RequestOptions


def stream_telemetry(req: CompletionRequest) -> TelemetryOptions | None:
    """`inspect: {"stream": true}`: per-token attention telemetry, which only a streamed completion can carry."""
    o = req.inspect
    if not isinstance(o, InspectSummaryOptions) or not o.stream:
        return None
    if not req.stream:
        raise APIError(400, "inspect.stream needs stream: true (the telemetry travels in each token's chunk)",
                       param="inspect", code="invalid_value")
    return TelemetryOptions(top_k=o.top_k, massive_threshold=o.massive_threshold, massive_ratio=o.massive_ratio)


def prepare_completion(serving: Serving, req: CompletionRequest, adapter: str | None) -> CompletionRun:
    """A completions request's prompts, sampling and options under LoRA adapter `adapter` (or the base), every
    refusal raised before anything is submitted."""
    prompts = tokenize_prompts(serving, req.prompt)
    telemetry = stream_telemetry(req)
    structured = requested_spec(req)
    prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
    params = to_sampling_params(req, serving.settings, req.max_tokens, req.logprobs, prompt_lp,
                                default_max_tokens=max(1, serving.max_model_len - max(len(p) for p in prompts)))
    if req.inspect and telemetry is None:  # the summary inspects each prompt: the inspection limit applies
        for p in prompts:
            check_inspect_length(serving, len(p))
    return CompletionRun(prompts, params, to_options(req, serving, params, adapter, telemetry, structured))


@dataclass
class ChatRun:
    """What a chat request runs as: its rendered text and token ids, tool plan, sampling and options."""

    text: str
    prompt: list[int]
    plan: ToolPlan
    params: SamplingParams
    options: RequestOptions


async def prepare_chat(serving: Serving, req: ChatCompletionRequest, adapter: str | None) -> ChatRun:
    """A chat request's prompt (its tools planned and rendered, its chat_template_kwargs given to the template),
    sampling and options under LoRA adapter `adapter` (or the base), every refusal raised before anything is
    submitted."""
    tok = serving.tokenizer
    tool_turns = any(m.tool_calls or m.role == "tool" for m in req.messages)
    plan = plan_tools(req, native=bool(req.tools or tool_turns) and template_renders_tools(tok),
                      parser=serving.settings.tool_call_parser, template_format=template_tool_format(tok.chat_template))
    text, prompt = render_chat_prompt(serving, req.messages, req.add_generation_prompt, plan, req.chat_template_kwargs)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs", code="invalid_value")
    structured = requested_spec(req)
    if structured is not None and plan.calls_tools:
        raise APIError(400, f"{structured.source} cannot be combined with tool calls (tool_choice "
                       f"{plan.named or plan.mode.split('_')[0]}): give one output constraint", param=structured.source,
                       code="invalid_value")
    for spec in plan.tool_specs:  # each tool's grammar alone first, so that a refusal names the tool
        await serving.check(RequestOptions(structured=spec))
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = to_sampling_params(req, serving.settings, req.max_completion_tokens or req.max_tokens, top, None,
                                default_max_tokens=max(1, serving.max_model_len - len(prompt)))
    if plan.mode == "auto_template" and "mistral" in (plan.parser, plan.template_format):
        # Mistral's [TOOL_CALLS] is a control token: kept in the text for the parser (vLLM's MistralToolParser
        # adjust_request does the same)
        params = dataclasses.replace(params, skip_special_tokens=False)
    return ChatRun(text, prompt, plan, params, to_options(req, serving, params, adapter, structured=plan.spec or structured))


def reasoning_splits(serving: Serving, req: ChatCompletionRequest, prompt_text: str, constrained: bool):
    """A new reasoning split per choice under --reasoning-parser (None without one). A grammar-constrained reply
    has no room for a reasoning block, and Qwen3's `enable_thinking: false` turns it off: both are all content."""
    name = serving.settings.reasoning_parser
    if name is None:
        return None
    switched_off = name == "qwen3" and (req.chat_template_kwargs or {}).get("enable_thinking", True) is False
    thinking = not constrained and not switched_off
    return partial(ReasoningParser(name).split, prompt_text, thinking)
