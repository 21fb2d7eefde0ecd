"""A /v1/responses request in the chat route's terms: its conversation (a stored previous response's, then its own
input items) as chat messages, its flat function tools as chat tools, `text.format` as `response_format`,
`max_output_tokens` as `max_tokens`. From there the chat machinery runs it unchanged (service/api/openai/prepare.py: the chat
template, tool plans, structured outputs, sampling and options), as vLLM's serving_responses.py builds chat
messages and runs its chat preprocessing. Refusals raised there name chat's fields; `in_responses_terms` renames
them to this request's.

A conversation is kept as plain items, the same whether it came from a client or from a stored response, so that a
continuation by `previous_response_id` renders exactly the tokens the whole conversation sent again would:
`{"type": "message", "role", "content": text}`, `{"type": "function_call", "call_id", "name", "arguments"}`,
`{"type": "function_call_output", "call_id", "output": text}`.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from service.common.errors import APIError
from service.api.openai.responses.schemas import ContentPart, InputItem, ResponsesRequest
from service.api.openai.schemas import ChatCompletionRequest

MAX_MESSAGES = next(m.max_length for m in ChatCompletionRequest.model_fields["messages"].metadata
                    if hasattr(m, "max_length"))


def _text(content: str | list[ContentPart] | None) -> str:
    if isinstance(content, list):
        return "".join(p.text for p in content)
    return content or ""


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's own input as conversation items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return [_item(it) for it in req.input]


def _item(it: InputItem) -> dict:
    if it.kind == "message":
        return {"type": "message", "role": it.role, "content": _text(it.content)}
    if it.kind == "function_call":
        return {"type": "function_call", "call_id": it.call_id, "name": it.name, "arguments": it.arguments}
    return {"type": "function_call_output", "call_id": it.call_id, "output": _text(it.output)}


def output_items(output: list[dict]) -> list[dict]:
    """A response's output items as conversation items (what sending them back as input gives)."""
    items = []
    for it in output:
        if it["type"] == "message":
            items.append({"type": "message", "role": "assistant",
                          "content": "".join(p["text"] for p in it["content"] if p["type"] == "output_text")})
        elif it["type"] == "function_call":
            items.append({"type": "function_call", "call_id": it["call_id"], "name": it["name"],
                          "arguments": it["arguments"]})
    return items


def chat_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """Conversation items -> chat messages: `instructions` first as a system message (OpenAI: they are not carried
    over from a previous response), function calls as the assistant turn's `tool_calls` (calls that follow one
    another, or follow the assistant's text, are one turn), their outputs as `tool` messages."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for it in items:
        if it["type"] == "message":
            messages.append({"role": it["role"], "content": it["content"]})
        elif it["type"] == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    return messages


def chat_request(req: ResponsesRequest, items: list[dict]) -> ChatCompletionRequest:
    """The chat completion request that generates this response from the conversation `items`."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, 'top_logprobs requires include: ["message.output_text.logprobs"]', param="top_logprobs",
                       code="invalid_value")
    messages = chat_messages(req.instructions, items)
    if len(messages) > MAX_MESSAGES:
        raise APIError(400, f"the conversation has {len(messages)} messages, more than {MAX_MESSAGES}",
                       param="input", code="invalid_value")
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if fmt is not None and fmt.type != "text":
        response_format = {"type": fmt.type}
        if fmt.type == "json_schema":
            response_format["json_schema"] = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description,
                                              "strict": fmt.strict}
    tool_choice = req.tool_choice
    if tool_choice is not None and not isinstance(tool_choice, str):
        tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
    fields = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                  for t in req.tools] if req.tools else None,
        "tool_choice": tool_choice, "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format, "logprobs": req.logprobs,
        "top_logprobs": req.top_logprobs if req.logprobs else None,
        "seed": req.seed, "top_k": req.top_k, "min_p": req.min_p, "repetition_penalty": req.repetition_penalty,
        "stop": req.stop, "interventions": req.interventions, "stream": req.stream,
        "features": req.features,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:  # every field was checked as this request's already; say what did not fit
        raise APIError(400, f"the conversation cannot be run as chat messages: {e.errors()[0]['msg']}",
                       param="input", code="invalid_value") from None


# chat's field names -> this request's, most specific first
_RENAMES = [(re.compile(p), r) for p, r in (
    (r"\bresponse_format\.json_schema\.schema\b", "text.format.schema"),
    (r"\bresponse_format\.json_schema\.name\b", "text.format.name"),
    (r"\bresponse_format\b", "text.format"),
    (r"\btools\[(\d+)\]\.function\.", r"tools[\1]."),
    (r"\btool_choice\.function\.", "tool_choice."),
    (r"\bmax_(completion_)?tokens\b", "max_output_tokens"),
    (r"^logprobs$", "top_logprobs"),
    (r"^messages$", "input"),
)]


def in_responses_terms(e: APIError) -> APIError:
    """A refusal the chat machinery raised, with its field names (in `param` and in the message) as this request
    spells them."""
    def rename(text: str | None) -> str | None:
        for pattern, replacement in _RENAMES:
            text = pattern.sub(replacement, text) if text is not None else None
        return text

    return APIError(e.status, rename(e.message), rename(e.param), e.code, e.headers)
