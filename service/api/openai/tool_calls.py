"""OpenAI tool calls on /v1/chat/completions: `tools` + `tool_choice` -> a prompt, an output constraint, and the
parse of what the model wrote back into `tool_calls` (streamed as deltas). Behaviour per tool_choice, docs/api.md:

- "none" (or no tools): plain text; the tools are not shown to the model (vLLM's default).
- named {"type": "function", "function": {"name": N}}: the output is constrained to N's arguments, a JSON object
  matching its `parameters` schema (vLLM does the same), returned as one call to N; streamed as argument deltas.
- "required": the output is constrained to {"tool_calls": [{"name": ..., "arguments": {...}}, ...]} with each
  call's arguments matching its tool's schema (at least one call; exactly one with parallel_tool_calls false).
- "auto", template with a tool format (it renders `tools`): the tools go through the template, the output is free,
  and calls are read back in the model's own format by `--tool-call-parser` (service/api/openai/tool_parsers.py: Hermes-style
  `<tool_call>{...}</tool_call>` blocks, Mistral's `[TOOL_CALLS] [...]`, a bare Llama-3.x-style JSON call);
  anything else is the reply's content.
- "auto", template without one (the default model, SmolLM2-135M-Instruct, renders no tools): llama.cpp's generic
  format (`common/chat.cpp`, `common_chat_params_init_generic`): a system message lists the tools and asks for JSON,
  and the output is constrained to either {"tool_calls": [...]} as for "required", or {"response": "<text>"},
  which becomes the content.
Wherever the template has no tool format, the same system message describes the tools (named and required too),
earlier assistant calls are written back as that JSON, and tool results are `tool` messages.
"required" and "auto" stream their result when the choice ends: whether it is a call is known only then.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from model.features import StructuredOutputSpec
from model.text import Tokenizer
from service.common.errors import APIError
from service.api.openai.schemas import ChatCompletionRequest, Tool
from service.common.fields import ChatMessage
from service.api.openai.structured_outputs import close_objects, json_schema_spec
from service.api.openai.tool_parsers import call_id, parse_tool_calls, template_call_id

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def _refuse(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def template_renders_tools(tok: Tokenizer) -> bool:
    """Whether the chat template has a tool format: it renders a probe tool's name when given one."""
    probe = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "llamascope_probe_tool", "description": "probe",
                                             "parameters": dict(NO_ARGUMENTS)}}
    try:
        return "llamascope_probe_tool" in tok.apply_chat_template(probe, tools=[tool])
    except Exception:  # a template that cannot take tools has no tool format
        return False


@dataclass
class ToolPlan:
    mode: str  # "none" | "named" | "required" | "auto_generic" | "auto_template"
    tools: list[Tool] = field(default_factory=list)
    named: str | None = None
    parallel: bool = True
    native: bool = False  # the template renders the tools itself
    parser: str = "auto"  # how an "auto_template" reply's calls are read (--tool-call-parser)
    template_format: str | None = None  # the template's own call format (tool_parsers.template_tool_format)
    spec: StructuredOutputSpec | None = None
    tool_specs: list[StructuredOutputSpec] = field(default_factory=list)  # each tool's arguments, to check alone

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"


def _arguments_schema(tool: Tool) -> dict:
    return close_objects(tool.function.parameters) if tool.function.parameters is not None else NO_ARGUMENTS


def _calls_schema(tools: list[Tool], parallel: bool) -> dict:
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": _arguments_schema(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    array = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
            "additionalProperties": False}


def plan_tools(req: ChatCompletionRequest, native: bool, parser: str = "auto",
               template_format: str | None = None) -> ToolPlan:
    """What the request's tools ask for; 400 naming the field for a choice that names no tool, a strict tool
    without parameters, or tools beside another output constraint."""
    plan = _plan(req, native)
    plan.parser, plan.template_format = parser, template_format
    return plan


def _plan(req: ChatCompletionRequest, native: bool) -> ToolPlan:
    tools, choice = req.tools or [], req.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise _refuse("tool_choice needs tools", "tool_choice")
        return ToolPlan("none", native=native)
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise _refuse(f"two tools are named {name!r}", f"tools[{i}].function.name")
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan("none", tools, native=native)
    for i, t in enumerate(tools):
        if t.function.strict and t.function.parameters is None:
            raise _refuse(f"tool {t.function.name!r} is strict but has no parameters schema",
                          f"tools[{i}].function.parameters")
    try:
        specs = [json_schema_spec(_arguments_schema(t), f"tools[{i}].function.parameters") for i, t in enumerate(tools)]
    except ValueError as e:  # not serializable as JSON (NaN); the message starts with the field
        raise _refuse(str(e), str(e).split(":", 1)[0]) from None
    plan = ToolPlan("auto_template" if choice == "auto" and native else "auto_generic", tools,
                    parallel=req.parallel_tool_calls, native=native, tool_specs=specs)
    if isinstance(choice, str) and choice == "required":
        plan.mode = "required"
    elif not isinstance(choice, str):
        if choice.function.name not in names:
            raise _refuse(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                          "tool_choice.function.name")
        plan.mode, plan.named = "named", choice.function.name
    schema = {"named": lambda: _arguments_schema(tools[names.index(plan.named)]),
              "required": lambda: _calls_schema(tools, plan.parallel),
              "auto_generic": lambda: {"anyOf": [_calls_schema(tools, plan.parallel), {
                  "type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                  "additionalProperties": False}]}}.get(plan.mode)
    if schema is not None:
        plan.spec = StructuredOutputSpec.json_schema(schema(), "tools")  # its parts are closed already
    return plan


# ---- the prompt ------------------------------------------------------------------------------------------------


def _system_note(plan: ToolPlan) -> str:
    listed = json.dumps([{"name": t.function.name, "description": t.function.description or "",
                          "parameters": _arguments_schema(t)} for t in plan.tools], ensure_ascii=False)
    note = f"You can call these tools (name, description, JSON Schema of the arguments):\n{listed}\n"
    calls = '{"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]}'
    if plan.mode == "named":
        return note + f'Call the tool "{plan.named}": respond with its arguments as a JSON object.'
    if plan.mode == "required":
        return note + f"Respond in JSON with the calls to make: {calls}"
    return note + f'Respond in JSON, either with {calls} to call tools, or with {{"response": <text>}} to reply.'


def _parsed_arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def template_messages(messages: list[ChatMessage], plan: ToolPlan) -> list[dict]:
    """Messages as the chat template gets them: tool calls and results in the template's terms where it has a tool
    format (HF's convention: arguments as an object), as the generic JSON where it has none."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            if plan.native:
                d["tool_calls"] = [{"id": template_call_id(c.id, plan.template_format), "type": "function", "function": {
                    "name": c.function.name, "arguments": _parsed_arguments(c.function.arguments)}}
                    for c in m.tool_calls]
            else:
                calls = [{"name": c.function.name, "arguments": _parsed_arguments(c.function.arguments)}
                         for c in m.tool_calls]
                d["content"] = (d["content"] + "\n" if d["content"] else "") + json.dumps(
                    {"tool_calls": calls}, ensure_ascii=False)
        if m.tool_call_id is not None:
            d["tool_call_id"] = template_call_id(m.tool_call_id, plan.template_format) if plan.native else m.tool_call_id
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    if plan.calls_tools and not plan.native:
        note = _system_note(plan)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


def template_tools(plan: ToolPlan) -> list[dict] | None:
    return [t.model_dump(exclude_none=True) for t in plan.tools] if plan.native and plan.calls_tools else None


# ---- the output --------------------------------------------------------------------------------------------------


def _call(name: str, arguments: Any) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def parse_output(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """A finished choice's text -> (content, tool calls). Text that is not a call stays content (a reply cut by
    max_tokens, say)."""
    if plan.mode == "named":
        return None, [_call(plan.named, text)]
    if plan.mode == "auto_template":
        return parse_tool_calls(plan.parser, text, {t.function.name for t in plan.tools})
    obj = _parsed_arguments(text)
    if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
        return None, [_call(c["name"], c["arguments"]) for c in obj["tool_calls"]]
    if isinstance(obj, dict) and isinstance(obj.get("response"), str):
        return obj["response"], []
    return text, []


class ChoiceMessage:
    """One choice's assistant message, built from its text deltas per the plan: `delta` gives what to stream now
    (None: nothing yet), `message` the whole message, `finish_reason` OpenAI's reason."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.text = plan, ""
        self.content: str | None = None
        self.calls: list[dict] = []
        self._named_id = call_id()
        self._started = False

    def delta(self, text: str, finished: bool) -> dict | None:
        self.text += text
        mode = self.plan.mode
        if mode == "none":
            return {"content": text} if text else None
        if mode == "named":
            if not text and (self._started or not finished):
                return None
            fn = {"arguments": text} if self._started else {"name": self.plan.named, "arguments": text}
            head = {} if self._started else {"id": self._named_id, "type": "function"}
            self._started = True
            return {"tool_calls": [{"index": 0, **head, "function": fn}]}
        if not finished:
            return None
        content, calls = self._parse()
        if calls:
            return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
        return {"content": content} if content else None

    def _parse(self) -> tuple[str | None, list[dict]]:
        self.content, self.calls = parse_output(self.plan, self.text)
        if self.plan.mode == "named":
            self.calls[0]["id"] = self._named_id
        return self.content, self.calls

    def message(self) -> dict:
        if self.plan.mode == "none":
            return {"role": "assistant", "content": self.text}
        content, calls = self._parse()
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}

    def finish_reason(self, reason: str | None) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call; a forced named call ends with "stop"
        if reason == "stop" and self.calls and self.plan.mode in ("required", "auto_generic", "auto_template"):
            return "tool_calls"
        return reason
