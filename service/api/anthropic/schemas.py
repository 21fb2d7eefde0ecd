"""Anthropic Messages API request models: POST /v1/messages and POST /v1/messages/count_tokens (the shapes of
Anthropic's API reference and of the `anthropic` package's `types/message_create_params.py`; vLLM's
`entrypoints/anthropic/protocol.py` and llama.cpp's `server_chat_convert_anthropic_to_oai` take the same).

As everywhere here, types are strict and unknown fields are refused. Content blocks and messages are unions
tagged by `type` and `role`, so an unknown block type or role is refused naming the tags that exist. Fields of
Anthropic's that change nothing on a local server (`cache_control`: the prefix cache is automatic; `metadata`,
`service_tier`, `output_config.effort`, `thinking.budget_tokens` and `display: "summarized"`) are accepted and
documented as ignored (docs/api.md), since SDKs and coding agents send them on every request. Rules that span
fields (tool_result ids, where blocks may stand, a final assistant turn) are checked in
service/api/anthropic/conversion.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from service.api.openai.schemas import ChatTemplateKwargs, Float, Int, JsonSchemaObject, NonEmptyText, StopText, Text, check_stop

# Anthropic's tool-name pattern, at the chat tools' length limit (service/schemas.py FunctionName)
ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
ToolUseId = Annotated[str, Field(min_length=1, max_length=256)]
MAX_MESSAGES = 1024  # as /v1/chat/completions


def text_or(blocks):
    """A string, or a list of blocks: told apart by the value's type, so that a refusal speaks of the branch the
    client meant (a union would report the string branch's failure first). The tags are ones the error messages
    leave out of a field's path (service/errors.py)."""
    return Annotated[Union[Annotated[Text, Tag("str")], Annotated[list[blocks], Tag("list[blocks]")]],
                     Discriminator(lambda v: "str" if isinstance(v, str) else "list[blocks]")]


def _role(v) -> str | None:
    role = v.get("role") if isinstance(v, dict) else getattr(v, "role", None)
    return f"[{role}]" if role in ("user", "assistant", "system") else None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(Strict):
    """Accepted on blocks, tools and the request, and ignored: every prompt's prefix is cached automatically."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: NonEmptyText  # Anthropic: "text content blocks must be non-empty"
    cache_control: CacheControl | None = None


class ToolUseBlock(Strict):
    """A tool call an earlier assistant turn made (given back with its result)."""

    type: Literal["tool_use"]
    id: ToolUseId
    name: ToolName
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: ToolUseId
    content: text_or(TextBlock) | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(b.text for b in self.content)
        return self.content or ""


class ThinkingBlock(Strict):
    """An earlier assistant turn's reasoning: given back to the chat template as `reasoning_content` (the
    signature is opaque and not checked)."""

    type: Literal["thinking"]
    thinking: Text
    signature: Annotated[str, Field(max_length=4096)]


class RedactedThinkingBlock(Strict):
    """Accepted so that a client can send a reply back whole; its data is opaque, so it renders as nothing."""

    type: Literal["redacted_thinking"]
    data: Annotated[str, Field(max_length=1 << 20)]


UserBlock = Annotated[Union[TextBlock, ToolResultBlock], Field(discriminator="type")]
AssistantBlock = Annotated[Union[TextBlock, ToolUseBlock, ThinkingBlock, RedactedThinkingBlock],
                           Field(discriminator="type")]


class UserMessage(Strict):
    role: Literal["user"]
    content: text_or(UserBlock)


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: text_or(AssistantBlock)


class SystemMessage(Strict):
    """A system message inside `messages` (the `anthropic` package's SystemMessageParam): its text joins the
    top-level `system` prompt, as vLLM does with it."""

    role: Literal["system"]
    content: text_or(TextBlock)


Message = Annotated[Union[Annotated[UserMessage, Tag("[user]")], Annotated[AssistantMessage, Tag("[assistant]")],
                          Annotated[SystemMessage, Tag("[system]")]],
                    Discriminator(_role, custom_error_type="invalid_role",
                                  custom_error_message="role must be 'user', 'assistant' or 'system'")]


class Tool(Strict):
    """A client tool. Anthropic's server tools (web search, code execution, ...) have a `type` of their own and are
    refused: nothing here runs them."""

    type: Literal["custom"] | None = None
    name: ToolName
    description: Text | None = None
    input_schema: JsonSchemaObject
    strict: bool | None = None  # the schema is enforced whenever the call is forced, either way
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, v):
        if isinstance(v, dict) and isinstance(v.get("type"), str) and v["type"] != "custom":
            raise ValueError(f"server tools (type {v['type']!r}) are not served: give client tools, with a name and "
                             "an input_schema")
        return v

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, v):
        if v.get("type") != "object":  # Anthropic: a tool's input is always an object
            raise ValueError('input_schema must be a JSON Schema of "type": "object"')
        return v


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_iff_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name is required with type "tool", and only with it')
        if self.type == "none" and self.disable_parallel_tool_use is not None:
            raise ValueError('disable_parallel_tool_use does not go with type "none"')
        return self


class ThinkingConfig(Strict):
    """"enabled" / "adaptive": the model's reasoning, where it writes one (--reasoning-parser), comes back as
    thinking blocks; "disabled": the template is asked not to reason (`enable_thinking: false`) and no thinking
    block is returned. `budget_tokens` is checked and not enforced: reasoning ends when the model closes it or at
    max_tokens."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int(ge=1, le=2**31) | None = None
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_iff_enabled(self):
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError('budget_tokens is required with type "enabled", and only with it')
        if self.type == "disabled" and self.display is not None:
            raise ValueError('display does not go with type "disabled"')
        return self


class JsonOutputFormat(Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["json_schema"]
    schema_: JsonSchemaObject = Field(alias="schema")


class OutputConfig(Strict):
    format: JsonOutputFormat | None = None  # the reply's text constrained to the schema (structured outputs)
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted, ignored


class Metadata(Strict):
    user_id: Annotated[str, Field(max_length=256)] | None = None  # accepted, ignored


class ConversationFields(Strict):
    """What a conversation's prompt is made of: shared by /v1/messages and /v1/messages/count_tokens."""

    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # the served model (Anthropic: required)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: text_or(TextBlock) | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    # vLLM's and llama.cpp's extension: further variables for the chat template
    chat_template_kwargs: ChatTemplateKwargs = None


class MessagesRequest(ConversationFields):
    max_tokens: Int(ge=1, le=2**31)
    stop_sequences: Annotated[list[StopText], Field(max_length=16)] | None = None
    stream: bool = False
    temperature: Float = Field(1.0, ge=0.0, le=1.0)  # Anthropic's range
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int(ge=0) | None = None  # 0: off
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted, ignored

    @field_validator("stop_sequences", mode="before")
    @classmethod
    def _stop(cls, v):
        return check_stop(v)


class CountTokensRequest(ConversationFields):
    pass
