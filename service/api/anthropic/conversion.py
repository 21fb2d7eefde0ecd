"""A Messages API request in the chat route's terms: its conversation as chat messages, its tools and tool_choice as
chat's, `output_config.format` as `response_format`, `stop_sequences` as `stop`, `thinking` as the template's
`enable_thinking`. From there the chat machinery runs it unchanged (service/prepare.py: the chat template, tool
plans, structured outputs, sampling and options), as vLLM's entrypoints/anthropic/serving.py and llama.cpp's
`server_chat_convert_anthropic_to_oai` (tools/server) build a chat request and run their chat path.

The conversation, in Anthropic's rules (its API reference, "messages"): the top-level `system` and any system
messages are one system prompt (their text joined, as both peers join it); consecutive turns of one role are one
turn; every turn but a final assistant one has content, and a final assistant turn (a prefill) is refused, as
Anthropic refuses it on models without prefill; each `tool_result` answers a `tool_use` of the assistant turn just
before it, and each `tool_use` is answered in the user turn after it. Then, as the peers convert them: an assistant
turn's text is its content, its `tool_use` blocks its `tool_calls` (input as JSON arguments), its `thinking` its
`reasoning_content`; a user turn's `tool_result` blocks are `tool` messages and its text a user message, in the
order the blocks come. Refusals name this request's fields; `in_anthropic_terms` renames those the chat machinery
raises in chat's terms.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from service.api.anthropic.schemas import (MAX_MESSAGES, ConversationFields, MessagesRequest, SystemMessage, TextBlock,
                                           ThinkingBlock, ToolResultBlock, ToolUseBlock)
from service.common.errors import APIError
from service.api.openai.schemas import ChatCompletionRequest

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # "tool" names one: chat's named choice


def _refuse(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _blocks(content) -> list:
    """A message's content as blocks (a string is one text block; an empty one none)."""
    if isinstance(content, str):
        return [TextBlock(type="text", text=content)] if content else []
    return list(content)


def _turns(req: ConversationFields) -> tuple[str | None, list[tuple[str, list[tuple[str, Any]]]]]:
    """(the system prompt, the turns): each turn its role and its blocks, each block with the field path it came
    from (for refusals)."""
    system = [req.system] if isinstance(req.system, str) else [b.text for b in req.system or []]
    turns: list[tuple[str, list[tuple[str, Any]]]] = []
    for i, m in enumerate(req.messages):
        blocks = _blocks(m.content)
        if isinstance(m, SystemMessage):
            system += [b.text for b in blocks]
            continue
        if not blocks:
            raise _refuse(f"messages.{i}: all messages must have non-empty content", f"messages.{i}.content")
        where = [(f"messages.{i}" if isinstance(m.content, str) else f"messages.{i}.content.{j}", b)
                 for j, b in enumerate(blocks)]
        if turns and turns[-1][0] == m.role:  # Anthropic: "consecutive user or assistant turns ... are combined"
            turns[-1][1].extend(where)
        else:
            turns.append((m.role, where))
    if not turns:
        raise _refuse("messages: give at least one user message", "messages")
    if turns[-1][0] != "user":
        raise _refuse("messages: the last message must be a user message: this server does not continue a final "
                      "assistant message (prefill)", "messages")
    return ("".join(system) if system else None), turns


def _check_tool_ids(turns: list[tuple[str, list[tuple[str, Any]]]]) -> None:
    """Each tool_result answers a tool_use of the assistant turn just before; each tool_use is answered."""
    seen: set[str] = set()
    asked: dict[str, str] = {}  # the open calls of the last assistant turn: id -> where
    for role, blocks in turns:
        if role == "assistant":
            asked = {}
            for where, b in blocks:
                if isinstance(b, ToolUseBlock):
                    if b.id in seen:
                        raise _refuse(f"{where}.id: tool_use ids must be unique, {b.id!r} is used twice",
                                      f"{where}.id")
                    seen.add(b.id)
                    asked[b.id] = where
            continue
        for where, b in blocks:
            if isinstance(b, ToolResultBlock):
                if b.tool_use_id not in asked:
                    raise _refuse(f"{where}.tool_use_id: {b.tool_use_id!r} answers no tool_use block of the "
                                  "assistant message just before it (or answers it twice)", f"{where}.tool_use_id")
                del asked[b.tool_use_id]
        if asked:
            ids = ", ".join(asked)
            raise _refuse(f"{next(iter(asked.values()))}: tool_use ids were found without tool_result blocks in the "
                          f"user message after them: {ids}", "messages")
        asked = {}


def _assistant(blocks: list) -> dict:
    text = [{"type": "text", "text": b.text} for b in blocks if isinstance(b, TextBlock)]
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    thinking = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return message


def _user(blocks: list) -> list[dict]:
    """A user turn's blocks in order: each run of text one user message, each tool_result one tool message."""
    messages, text = [], []
    for b in blocks + [None]:
        if isinstance(b, TextBlock):
            text.append({"type": "text", "text": b.text})
            continue
        if text:
            messages.append({"role": "user", "content": text})
            text = []
        if isinstance(b, ToolResultBlock):
            messages.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
    return messages


def chat_messages(req: ConversationFields) -> list[dict]:
    """The conversation as chat messages (system first), every rule above checked."""
    system, turns = _turns(req)
    _check_tool_ids(turns)
    messages = [{"role": "system", "content": system}] if system is not None else []
    for role, blocks in turns:
        plain = [b for _, b in blocks]
        messages += [_assistant(plain)] if role == "assistant" else _user(plain)
    return messages


def thinking_off(req: ConversationFields) -> bool:
    return req.thinking is not None and req.thinking.type == "disabled"


def chat_request(req: ConversationFields) -> ChatCompletionRequest:
    """The chat completion request that answers `req` (a count_tokens request: the same prompt, no sampling)."""
    messages = chat_messages(req)
    if len(messages) > MAX_MESSAGES:
        raise _refuse(f"the conversation has {len(messages)} chat messages (each tool_result is one), more than "
                      f"{MAX_MESSAGES}", "messages")
    kwargs = dict(req.chat_template_kwargs or {})
    if req.thinking is not None:  # Qwen3's (and others') template switch; templates that do not read it ignore it
        kwargs["enable_thinking"] = not thinking_off(req)
    choice = req.tool_choice
    fields: dict[str, Any] = {
        "model": req.model, "messages": messages, "chat_template_kwargs": kwargs or None,
        "tools": [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                    "parameters": t.input_schema, "strict": t.strict}}
                  for t in req.tools] if req.tools else None,
        "tool_choice": None if choice is None else TOOL_CHOICES.get(choice.type) or {
            "type": "function", "function": {"name": choice.name}},
        "parallel_tool_calls": not (choice is not None and choice.disable_parallel_tool_use),
    }
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    if isinstance(req, MessagesRequest):
        fields |= {"max_tokens": req.max_tokens, "stop": req.stop_sequences, "stream": req.stream,
                   "temperature": req.temperature, "top_p": 1.0 if req.top_p is None else req.top_p,
                   "top_k": req.top_k or 0}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:  # every field was checked as this request's already; say what did not fit
        raise _refuse(f"the conversation cannot be run as chat messages: {e.errors()[0]['msg']}", "messages") from None


# chat's field names -> this request's, most specific first
_RENAMES = [(re.compile(p), r) for p, r in (
    (r"\btools\[(\d+)\]\.function\.parameters\b", r"tools.\1.input_schema"),
    (r"\btools\[(\d+)\]\.function\.", r"tools.\1."),
    (r"\btool_choice\.function\.name\b", "tool_choice.name"),
    (r"\bresponse_format\.json_schema\.schema\b", "output_config.format.schema"),
    (r"\bresponse_format\b", "output_config.format"),
    (r"\bmax_(completion_)?tokens\b", "max_tokens"),
    (r"^stop$", "stop_sequences"),
)]


def in_anthropic_terms(e: APIError) -> APIError:
    """A refusal the chat machinery raised, with its field names (in `param` and in the message) as this request
    spells them. Anthropic's envelope has no `param`, so a message that does not name its field starts with it."""
    def rename(text: str | None) -> str | None:
        for pattern, replacement in _RENAMES:
            text = pattern.sub(replacement, text) if text is not None else None
        return text

    message, param = rename(e.message), rename(e.param)
    if param is not None and param not in message:
        message = f"{param}: {message}"
    return APIError(e.status, message, param, e.code, e.headers)

