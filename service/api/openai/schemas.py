"""OpenAI request models and the /inspect request model: with service/api/openai/responses/schemas.py (/v1/responses), the only
place pydantic lives.

Unknown fields are rejected (`extra="forbid"`): a client that sends something we would ignore learns it at once.
Types are strict (no "5" for 5, no 1 for true): what the OpenAPI document says is what is accepted.
Floats refuse NaN and infinity. Limits that depend on the deployment (n, logprobs, prompt count) are checked in
the routes against Settings.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator,
                      model_validator)

from model.massive import MASSIVE_RATIO, MASSIVE_THRESHOLD
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


LayerIndex = Int(ge=0, lt=1 << 16)
HeadIndex = Int(ge=0, lt=1 << 16)
PatchSite = Literal["block_output", "attention_output", "mlp_output", "head_output", "head_q", "head_k", "head_v"]
Position = Int(ge=-(1 << 20), lt=1 << 20)  # negative: from the end
TokenIndex = Int(ge=0, lt=1 << 20)
VectorName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]


class VectorRef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: VectorName


class InterventionItem(BaseModel):
    """One edit of the residual stream (docs/api.md "Interventions"; model/interventions.py)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    layer: LayerIndex | Annotated[list[LayerIndex], Field(min_length=1, max_length=1024)] | None = None
    site: Literal["block_output", "attention_output", "mlp_output"] = "block_output"
    op: Literal["add", "set", "scale", "project_out"] = "add"
    positions: Literal["all", "prompt", "generated"] | Annotated[list[TokenIndex], Field(min_length=1, max_length=4096)] = "all"
    vector: Annotated[list[Float], Field(min_length=1, max_length=1 << 16)] | VectorRef | None = None
    scale: Float = 1.0
    dims: Annotated[list[Int(ge=0, lt=1 << 16)], Field(min_length=1, max_length=1 << 16)] | None = None
    values: Annotated[list[Float], Field(min_length=1, max_length=1 << 16)] | None = None
    factor: Float = 1.0


Interventions = Annotated[list[InterventionItem], Field(max_length=256)]


class HiddenStatesOptions(BaseModel):
    """`return_hidden_states`: block outputs returned with each generated token."""

    model_config = ConfigDict(extra="forbid", strict=True)
    layers: Annotated[list[LayerIndex], Field(min_length=1, max_length=1024)]
    positions: Literal["last", "all"] | Annotated[list[TokenIndex], Field(min_length=1, max_length=4096)] = "last"
    dtype: Literal["float32", "float16"] = "float32"


class KVWindowOptions(BaseModel):
    """`kv_window` (llamascope extension): the sink + window KV cache (StreamingLLM, Xiao et al. 2024): keep the first
    `sink_tokens` tokens' K/V and the most recent `window`, so generation runs past the context (docs/engine.md)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    sink_tokens: Int(ge=0, le=1 << 20) = 4
    window: Int(ge=1, le=1 << 24)


# ---- structured outputs (docs/api.md#structured-outputs) ----------------------------------------------------------

JsonSchemaObject = Annotated[dict[str, Any], WithJsonSchema({"type": "object"})]
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")]


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


class InspectSummaryOptions(BaseModel):
    """The `inspect` extension of /v1/completions: the inspection summary of each prompt beside the completion, or
    with `stream: true` (on a streamed completion) the attention telemetry of every token in its chunk instead."""

    model_config = ConfigDict(extra="forbid", strict=True)
    massive_threshold: Float = Field(MASSIVE_THRESHOLD, gt=0.0)
    massive_ratio: Float = Field(MASSIVE_RATIO, gt=0.0)
    stream: bool = False
    top_k: Int(ge=1, le=32) = 5  # attended keys per head and layer, with stream


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


class LoadLoRARequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRARequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body; its optional lora_int_id is accepted and not used)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


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


class InspectRequest(BaseModel):
    """POST /inspect. Definitions and map layouts: model/probes.py; the request and response: docs/inspection.md."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    # exactly one of the three
    prompt: NonEmptyText | None = None
    input_ids: list[TokenId] | None = Field(None, min_length=1, max_length=1 << 20)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=1024)
    add_generation_prompt: bool = True
    # generate first, then inspect prompt + completion
    max_tokens: Int(ge=0, le=1 << 20) = 0
    temperature: Float = Field(0.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    seed: Int(ge=-(2**63), lt=2**64) | None = None
    # what to report
    layers: list[LayerIndex] | None = Field(None, min_length=1, max_length=1024)
    heads: list[LayerIndex] | None = Field(None, min_length=1, max_length=1024)
    include: list[Literal["massive", "norms", "attention", "logit_lens", "prediction", "hidden_states"]] | None = Field(None, max_length=6)
    massive_threshold: Float = Field(MASSIVE_THRESHOLD, gt=0.0)
    massive_ratio: Float = Field(MASSIVE_RATIO, gt=0.0)
    massive_top_k: Int(ge=1, le=100) = 3
    massive_max_entries: Int(ge=1, le=4096) = 64
    mode: Literal["auto", "none", "full", "rows", "topk", "pooled"] = "auto"
    rows: list[Position] | None = Field(None, min_length=1, max_length=4096)
    attention_top_k: Int(ge=1, le=1024) = 8
    pool_size: Int(ge=1, le=1 << 16) = 16
    pool_reduce: Literal["mean", "max"] = "mean"
    format: Literal["base64", "list"] = "base64"
    lens_top_k: Int(ge=1, le=100) = 5
    lens_positions: list[Position] | None = Field(None, min_length=1, max_length=1024)
    hidden_positions: list[Position] | None = Field(None, min_length=1, max_length=4096)
    hidden_dtype: Literal["float16", "float32"] = "float16"
    interventions: Interventions | None = None

    @field_validator("layers", "heads", "rows", "lens_positions", "hidden_positions")
    @classmethod
    def _unique(cls, v):
        if v is not None and len(set(v)) != len(v):
            raise ValueError("must not repeat an index")
        return v


class CompareRequest(InspectRequest):
    """POST /inspect/compare: one sequence inspected under `model` (the reference: the base, or an adapter) and under
    each of `compare` (LoRA adapters, or the base), with the /inspect options each inspection takes."""

    compare: list[str] = Field(min_length=1, max_length=4)


class PatchRequest(BaseModel):
    """POST /inspect/patch: an activation-patching sweep (model/probes/patching.py; docs/inspection.md)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    # a prompt, or chat messages rendered with the model's template; the two must have equal token counts
    clean: NonEmptyText | Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    corrupted: NonEmptyText | Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    add_generation_prompt: bool = True
    # token strings, one token each (a leading space is part of a token in most vocabularies: " Paris")
    answer: NonEmptyText
    contrast: NonEmptyText | None = None
    metric: Literal["logit_diff", "logprob"] = "logit_diff"
    # "all": the three residual-stream sites; the head sites are named
    sites: list[PatchSite] | Literal["all"] = Field(default_factory=lambda: ["block_output"])
    layers: Annotated[list[LayerIndex], Field(min_length=1, max_length=1024)] | Literal["all"] = "all"
    positions: Annotated[list[Position], Field(min_length=1, max_length=4096)] | Literal["all"] = "all"
    heads: Annotated[list[HeadIndex], Field(min_length=1, max_length=1024)] | Literal["all"] = "all"  # query heads
    direction: Literal["denoise", "noise"] = "denoise"

    @field_validator("sites", "layers", "positions", "heads")
    @classmethod
    def _unique(cls, v):
        if isinstance(v, list) and len(set(v)) != len(v):
            raise ValueError("must not repeat an entry")
        return v

    @field_validator("sites")
    @classmethod
    def _some(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("give at least one site")
        return v


class AttributeRequest(PatchRequest):
    """POST /inspect/attribute: direct logit attribution of `prompt` / `messages`, or attribution patching of `clean`
    / `corrupted` (model/probes/direct_logit.py, attribution_patching.py; docs/inspection.md)."""

    method: Literal["direct_logit", "attribution_patching"]
    prompt: NonEmptyText | None = None  # direct_logit: a prompt, or chat messages
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)] | None = None
    clean: NonEmptyText | Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)] | None = None
    corrupted: NonEmptyText | Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)] | None = None
    verify: Int(ge=0, le=1 << 16) = 0  # attribution_patching: the cells with the largest estimates patched exactly
    qk_fix: bool = True  # attribution_patching: AtP*'s exact attention pattern for head_q / head_k


class VectorRequest(BaseModel):
    """POST /v1/vectors: a steering vector from contrastive prompt pairs (service/microscope/vectors.py)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    name: VectorName
    layers: Annotated[list[LayerIndex], Field(min_length=1, max_length=1024)]
    positive: Annotated[list[NonEmptyText], Field(min_length=1, max_length=64)]
    negative: Annotated[list[NonEmptyText], Field(min_length=1, max_length=64)]
    position: Literal["last", "mean"] = "last"
    normalize: bool = False

    @field_validator("layers")
    @classmethod
    def _unique(cls, v):
        if len(set(v)) != len(v):
            raise ValueError("must not repeat an index")
        return v
