"""The strict field types every request model is built of (both faces' pydantic models use them), and chat messages:
the conversation /v1/chat/completions takes, which the microscope's routes take as a prompt too.

Types are strict (no "5" for 5, no 1 for true): what the OpenAPI document says is what is accepted. Text must be valid
Unicode; floats refuse NaN and infinity.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from model.text.chat_template import RESERVED_VARIABLES


def _utf8(v: str) -> str:
    # JSON may carry lone UTF-16 surrogates ("\ud800"); no tokenizer can take them, so they are a client error.
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return v


def _json_int(v):
    # Strict about type (no "5", no true), but an integer-valued number such as 26.0 is an integer in JSON Schema
    # (and so in the OpenAPI document), so it is taken as one; 26.5 is not.
    return int(v) if type(v) is float and v.is_integer() else v


def Int(**bounds):
    """A strict integer with bounds (`ge`, `lt`, ...). The bounds sit inside, before the validator, so they reach
    the JSON schema as minimum / maximum."""
    return Annotated[int, Field(**bounds), BeforeValidator(_json_int)]


Text = Annotated[str, AfterValidator(_utf8)]
Float = Annotated[float, Field(allow_inf_nan=False)]
# `x-token-id`: service/common/openapi.py narrows the bound to the served model's vocabulary in the OpenAPI document
TokenId = Annotated[Int(ge=0, lt=2**31), Field(json_schema_extra={"x-token-id": True})]
NonEmptyText = Annotated[Text, Field(min_length=1)]
StopText = Annotated[Text, Field(min_length=1, max_length=256)]
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: FunctionName
    arguments: Text  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    """A tool call an earlier assistant turn made (sent back by the client with the tool's result)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: Annotated[str, Field(max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


def _template_kwargs(v):
    if v is None:
        return v
    if len(v) > 64:
        raise ValueError("at most 64 chat_template_kwargs")
    for k in v:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", k):
            raise ValueError(f"chat_template_kwargs keys must be template variable names, got {k!r}")
        if k in RESERVED_VARIABLES:
            raise ValueError(f"chat_template_kwargs may not set {k}: the request has its own field for it")
    _utf8(json.dumps(v, ensure_ascii=False))
    return v


# vLLM's `chat_template_kwargs`: further variables for the chat template (e.g. Qwen3's {"enable_thinking": false});
# the template gets those it reads (model/text/chat_template.py); names the request sets with its own fields are not
# taken
ChatTemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs), WithJsonSchema({"anyOf": [{
    "type": "object", "maxProperties": 64, "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]{0,63}$",
                                                              "not": {"enum": sorted(RESERVED_VARIABLES)}}},
    {"type": "null"}]})]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: str | None = Field(None, max_length=64)
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)  # assistant turns
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None  # tool turns
    reasoning_content: Text | None = None  # an assistant turn's reasoning, given back to templates that read it (Qwen3)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""
