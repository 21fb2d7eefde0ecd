"""The OpenAI-compatible request models (with vLLM's extensions): with service/api/openai/responses/schemas.py
(/v1/responses), service/microscope/schemas.py (the microscope's) and service/common/fields.py (the field types and
chat messages all of them use), the only places pydantic lives.

Unknown fields are rejected (`extra="forbid"`): a client that sends something we would ignore learns it at once.
Types are strict (no "5" for 5, no 1 for true): what the OpenAPI document says is what is accepted.
Floats refuse NaN and infinity. Limits that depend on the deployment (n, logprobs, prompt count) are checked in
the routes against Settings.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from service.common.fields import (ChatMessage, ChatTemplateKwargs, Float, FunctionName, Int, NonEmptyText, StopText,
                                   Text, TokenId)
from service.microscope.schemas import HiddenStatesOptions, InspectSummaryOptions, Interventions


def check_stop(v):
    """`stop`'s limits, checked before its type so that the message says which one a value breaks."""
    stops = [v] if isinstance(v, str) else (v if isinstance(v, list) else [])
    if len(stops) > 16:
        raise ValueError("at most 16 stop strings")
    if any(isinstance(s, str) and (not s or len(s) > 256) for s in stops):
        raise ValueError("stop strings must be 1-256 characters")
    return v


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


# stream_options needs stream: true (checked in service/api/openai/sampling_fields.py; said here for the OpenAPI document)
STREAM_OPTIONS_NEED_STREAM = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}


class FeaturesOptions(BaseModel):
    """`features` (llamascope extension, docs/api.md#features): each token's top features of a served dictionary
    (`GET /v1/saes`) at its site (model/features/sae/feature.py)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    sae: Annotated[str, Field(min_length=1, max_length=64)]
    top_k: Int(ge=1, le=64) = 8
    positions: Literal["generated", "prompt", "all"] | Annotated[list[Int(ge=0, lt=1 << 24)],
                                                                   Field(min_length=1, max_length=4096)] = "generated"
    ids: Annotated[list[Int(ge=0, lt=1 << 31)], Field(max_length=256)] | None = None
    error_norm: bool = False


class KVWindowOptions(BaseModel):
    """`kv_window` (llamascope extension): the sink + window KV cache (StreamingLLM, Xiao et al. 2024): keep the first
    `sink_tokens` tokens' K/V and the most recent `window`, so generation runs past the context (docs/engine.md)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    sink_tokens: Int(ge=0, le=1 << 20) = 4
    window: Int(ge=1, le=1 << 24)


# ---- structured outputs (docs/api.md#structured-outputs) ----------------------------------------------------------

JsonSchemaObject = Annotated[dict[str, Any], WithJsonSchema({"type": "object"})]


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`. `strict` is accepted either way: the schema is always enforced."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: FunctionName
    description: str | None = None
    schema_: JsonSchemaObject | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`; `json_schema` is required with (and only with) type "json_schema". One model
    rather than a tagged union, so that an error's location is the field's own path."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["json_schema"]}, "else": {"not": {"required": ["json_schema"]}}})
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only with it')
        return self


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: JsonSchemaObject | str | None = Field(None, alias="json")
    regex: Annotated[str, Field(min_length=1)] | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1024)] | None = None
    grammar: Annotated[str, Field(min_length=1)] | None = None
    json_object: bool | None = None


class SamplingFields(BaseModel):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extensions."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=STREAM_OPTIONS_NEED_STREAM)

    model: str | None = None
    max_tokens: Int(ge=1, le=2**31) | None = None
    temperature: Float = Field(1.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    n: Int(ge=1) = 1
    stop: StopText | Annotated[list[StopText], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Int(ge=-(2**63), lt=2**64) | None = None
    presence_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Annotated[dict[str, Float] | None, WithJsonSchema({"anyOf": [{
        "type": "object", "maxProperties": 1024, "propertyNames": {"pattern": "^[0-9]{1,10}$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}, {"type": "null"}]})] = None
    user: str | None = Field(None, max_length=256)
    # vLLM extensions
    top_k: Int(ge=-1) = 0
    min_p: Float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: Float = Field(1.0, gt=0.0, le=10.0)
    min_tokens: Int(ge=0) = 0
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # llamascope extensions: edits of the residual stream for this request's rows, and block outputs returned
    interventions: Interventions | None = None
    return_hidden_states: HiddenStatesOptions | None = None
    # llamascope extension: each token's features of a served dictionary
    features: FeaturesOptions | None = None
    # llamascope extension
    kv_window: KVWindowOptions | None = None
    # llamascope extension: at most this many speculative drafts a step for this request (0: none); the server's
    # --speculative-config when absent
    num_speculative_tokens: Annotated[int, Field(ge=0, le=16)] | None = None
    # structured outputs: OpenAI's field, vLLM's, and vLLM's older guided_* (at most one constraint per request)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: JsonSchemaObject | str | None = None
    guided_regex: Annotated[str, Field(min_length=1)] | None = None
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: Annotated[str, Field(min_length=1)] | None = None

    @field_validator("stop", mode="before")  # before the type's own checks, so the message says what is wrong
    @classmethod
    def _stop(cls, v):
        return check_stop(v)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return v
        if len(v) > 1024:
            raise ValueError("at most 1024 logit_bias entries")
        for k, b in v.items():
            if not (k.isascii() and k.isdigit()) or int(k) >= 2**31:
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b}")
        return v


class CompletionRequest(SamplingFields):
    prompt: (NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    max_tokens: Int(ge=1, le=2**31) | None = 16
    logprobs: Int(ge=0) | None = None
    inspect: bool | InspectSummaryOptions = False  # llamascope extension
    echo: bool = False
    # accepted only as what they mean by default; the schema says so (the validators below explain a refusal)
    best_of: Annotated[Int(ge=1) | None, WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 1, "maximum": 1},
                                                                   {"type": "null"}]})] = None
    suffix: Annotated[str | None, WithJsonSchema({"type": "null"})] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        def ids(x):
            return isinstance(x, list) and all(
                (type(t) is int or (type(t) is float and t.is_integer())) and 0 <= t < 2**31 for t in x)

        ok = isinstance(v, str) or (isinstance(v, list) and (
            all(isinstance(p, str) for p in v) or ids(v) or all(ids(p) for p in v)))
        if not ok:
            raise ValueError("must be a string, a list of strings, a list of token ids, or a list of token-id lists")
        if not v or (isinstance(v, list) and any(not p for p in v if isinstance(p, (str, list)))):
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        if v is not None and v > 1:
            raise ValueError("best_of > 1 is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v is not None:
            raise ValueError("suffix is not supported")
        return v


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: FunctionName
    description: str | None = None
    parameters: JsonSchemaObject | None = None  # a JSON Schema for the arguments object; None: no arguments
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    # top_logprobs needs logprobs: true (OpenAI); checked in the route, said here for the OpenAPI document
    model_config = ConfigDict(json_schema_extra={"allOf": [STREAM_OPTIONS_NEED_STREAM, {
        "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}]})
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: Int(ge=1, le=2**31) | None = None
    logprobs: bool = False
    top_logprobs: Int(ge=0) | None = None
    add_generation_prompt: bool = True
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool = True
    chat_template_kwargs: ChatTemplateKwargs = None
    include_reasoning: bool = True  # vLLM's: with --reasoning-parser, return reasoning_content (false: leave it out)


class TokenizeRequest(BaseModel):
    # exactly one of prompt / messages (checked in the route; said here for the OpenAPI document)
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "oneOf": [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
                  {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}]})
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    chat_template_kwargs: ChatTemplateKwargs = None  # with messages


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)
