"""The request models of POST /v1/responses (OpenAI's Responses API), beside service/api/openai/schemas.py and in its terms:
unknown fields refused, strict types, NaN refused.

The input items an agent loop sends back are taken as the openai package writes them (`input=[*previous.output,
...]` dumps each output item with its `id`, `status`, `annotations` and `logprobs`): messages, function calls and
function call outputs. Every other item, content part or tool type (images, files, reasoning, hosted tools) is a 400
naming it. Each item and the text format are one model with per-type requirements rather than a tagged union (as
`ResponseFormat` in service/api/openai/schemas.py), so that an error's location is the field's own path.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from service.api.openai.schemas import FeaturesOptions, JsonSchemaObject, check_stop
from service.common.fields import Float, FunctionName, Int, NonEmptyText, StopText, Text
from service.microscope.schemas import Interventions

ITEM_TYPES = ("message", "function_call", "function_call_output")
PART_TYPES = ("input_text", "output_text")
ID = Annotated[str, Field(min_length=1, max_length=256)]
# What each item type needs and what it must not carry (an item without `type` is a message, OpenAI's
# EasyInputMessage); said once here for both the validator and the OpenAPI document.
_ITEM_FIELDS = {"message": ({"role", "content"}, {"call_id", "name", "arguments", "output"}),
                "function_call": ({"call_id", "name", "arguments"}, {"role", "content", "output"}),
                "function_call_output": ({"call_id", "output"}, {"role", "content", "name", "arguments"})}


def _only_known(value: Any, kinds: tuple[str, ...], what: str) -> Any:
    """A clear refusal of an item or part of a type this server does not take, before its fields are checked."""
    if isinstance(value, dict) and "type" in value and value["type"] not in kinds:
        raise ValueError(f"{what} type {value['type']!r} is not supported; this server takes {', '.join(kinds)}")
    return value


class SentTopLogprob(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    token: Text
    logprob: Float
    bytes: list[Int(ge=0, le=255)] | None = None


class SentLogprob(SentTopLogprob):
    """A token's logprob in an output_text part this server wrote (docs/api.md), sent back; ignored."""

    top_logprobs: list[SentTopLogprob] | None = None


class ContentPart(BaseModel):
    """`input_text` (user, system, developer) or `output_text` (an assistant turn sent back); text only."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["input_text", "output_text"]
    text: Text
    # what an output_text part carries when a previous output is sent back; ignored. This server writes no
    # annotations (OpenAI's come from hosted tools). These lists, and a message's parts, are bounded by
    # --max-body-bytes alone: a bound of their own would only refuse an earlier reply sent back.
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None
    logprobs: list[SentLogprob] | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, v):
        return _only_known(v, PART_TYPES, "content part")


def _text_or_list(kind: str):
    """Text, or a list of `kind`, whose errors are only those of the form the value has (a smart union would list
    the string's first). The tags are the names service/common/errors.py leaves out of an error's location."""
    return Discriminator(lambda v: f"list[{kind}]" if isinstance(v, list) else "str")


Content = Annotated[Annotated[Text, Tag("str")] | Annotated[list[ContentPart], Tag("list[ContentPart]")],
                    _text_or_list("ContentPart")]


def _item_schema(schema: dict) -> None:
    rules = []
    for kind, (required, absent) in _ITEM_FIELDS.items():
        cond = {"properties": {"type": {"const": kind}}, "required": ["type"]}
        if kind == "message":  # a message may leave out `type`
            cond = {"anyOf": [cond, {"not": {"required": ["type"]}}]}
        rules.append({"if": cond, "then": {"required": sorted(required),
                                           "not": {"anyOf": [{"required": [f]} for f in sorted(absent)]}}})
    schema["allOf"] = rules


class InputItem(BaseModel):
    """One item of `input`: a message `{"role", "content"}`, a `function_call` the model made earlier
    `{"call_id", "name", "arguments"}`, or a `function_call_output` answering it `{"call_id", "output"}`."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_item_schema)
    type: Literal["message", "function_call", "function_call_output"] | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: Content | None = None
    call_id: ID | None = None
    name: FunctionName | None = None
    arguments: Text | None = None
    output: Content | None = None
    id: ID | None = None  # an output item's own id, sent back; ignored
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, v):
        return _only_known(v, ITEM_TYPES, "input item")

    @model_validator(mode="after")
    def _fields_of_its_type(self):
        required, absent = _ITEM_FIELDS[self.type or "message"]
        missing = sorted(f for f in required if getattr(self, f) is None)
        extra = sorted(f for f in absent if getattr(self, f) is not None)
        if missing:
            raise ValueError(f"a {self.type or 'message'} item needs {', '.join(missing)}")
        if extra:
            raise ValueError(f"a {self.type or 'message'} item takes no {', '.join(extra)}")
        return self

    @property
    def kind(self) -> str:
        return self.type or "message"


class FunctionTool(BaseModel):
    """A function the model may call, in the Responses API's flat form (chat nests it under `function`)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: JsonSchemaObject | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, v):
        return _only_known(v, ("function",), "tool")


class FunctionToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    name: FunctionName


class TextFormat(BaseModel):
    """`text.format`: `text`, `json_object`, or `json_schema` with its `name` and `schema` (required with it, and
    only with it, as OpenAI's Responses API has them)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True, json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["name", "schema"]},
        "else": {"not": {"anyOf": [{"required": [f]} for f in ("name", "schema", "description", "strict")]}}})
    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    schema_: JsonSchemaObject | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_iff_type(self):
        named = [f for f in ("name", "schema_", "description", "strict") if getattr(self, f) is not None]
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError('name and schema are required with type "json_schema"')
        if self.type != "json_schema" and named:
            raise ValueError(f'{named[0].rstrip("_")} is only taken with type "json_schema"')
        return self


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: TextFormat | None = None


class ResponseStreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_obfuscation: bool = False  # accepted; this server never pads its events


Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]


class ResponsesRequest(BaseModel):
    """POST /v1/responses: OpenAI's fields, then vLLM's sampling extensions and llamascope's interventions."""

    # top_logprobs needs the logprobs included (checked in service/api/openai/responses/input.py; said here for the OpenAPI
    # document)
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
        "then": {"required": ["include"], "properties": {"include": {"type": "array", "minItems": 1}}}})
    model: str | None = None
    input: Annotated[Annotated[NonEmptyText, Tag("str")]
                     | Annotated[list[InputItem], Field(min_length=1, max_length=1024), Tag("list[InputItem]")],
                     _text_or_list("InputItem")]
    instructions: Text | None = None
    previous_response_id: ID | None = None
    store: bool = True
    max_output_tokens: Int(ge=1, le=2**31) | None = None
    temperature: Float | None = Field(None, ge=0.0, le=2.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    text: TextOptions | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    include: Annotated[list[Literal["message.output_text.logprobs"]], Field(max_length=1)] | None = None
    top_logprobs: Int(ge=0, le=20) | None = None
    truncation: Literal["disabled"] = "disabled"  # "auto" (dropping the oldest turns) is not supported
    metadata: Metadata | None = None
    user: str | None = Field(None, max_length=256)
    # vLLM's extensions (its ResponsesRequest takes these too)
    seed: Int(ge=-(2**63), lt=2**64) | None = None
    top_k: Int(ge=-1) = 0
    min_p: Float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: Float = Field(1.0, gt=0.0, le=10.0)
    stop: StopText | Annotated[list[StopText], Field(max_length=16)] | None = None
    # llamascope extension: edits of the residual stream for this request's rows (docs/api.md#interventions)
    interventions: Interventions | None = None
    # llamascope extension: each token's features of a served dictionary (docs/api.md#features)
    features: FeaturesOptions | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        return check_stop(v)

    @property
    def logprobs(self) -> bool:
        return bool(self.include)
