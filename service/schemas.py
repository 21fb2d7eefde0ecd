"""OpenAI request models and the /inspect request model: the only place pydantic lives.

Unknown fields are rejected (`extra="forbid"`): a client that sends something we would ignore learns it at once.
Floats refuse NaN and infinity. Limits that depend on the deployment (n, logprobs, prompt count) are checked in
the routes against Settings.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator


def _utf8(v: str) -> str:
    # JSON may carry lone UTF-16 surrogates ("\ud800"); no tokenizer can take them, so they are a client error.
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return v


Text = Annotated[str, AfterValidator(_utf8)]
Float = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extensions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=2**31)
    temperature: Float = Field(1.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Float] | None = None
    user: str | None = Field(None, max_length=256)
    # vLLM extensions
    top_k: int = Field(0, ge=-1)
    min_p: Float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: Float = Field(1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        if any(not s or len(s) > 256 for s in stops):
            raise ValueError("stop strings must be 1-256 characters")
        return v

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
    """The `inspect` extension of /v1/completions: the inspection summary of each prompt beside the completion."""

    model_config = ConfigDict(extra="forbid")
    massive_threshold: Float = Field(100.0, gt=0.0)
    massive_ratio: Float = Field(1000.0, gt=0.0)


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    inspect: bool | InspectSummaryOptions = False  # llamascope extension
    max_tokens: int | None = Field(16, ge=1, le=2**31)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        def ids(x):
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in x)

        ok = isinstance(v, str) or (isinstance(v, list) and (
            all(isinstance(p, str) for p in v) or ids(v) or all(ids(p) for p in v)))
        if not ok:
            raise ValueError("must be a string, a list of strings, a list of token ids, or a list of token-id lists")
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
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    name: str | None = Field(None, max_length=64)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)


LayerIndex = Annotated[int, Field(ge=0, lt=1 << 16)]
Position = Annotated[int, Field(ge=-(1 << 20), lt=1 << 20)]  # negative: from the end


class InspectRequest(BaseModel):
    """POST /inspect. Definitions and map layouts: model/probes.py; the response: README "Inspection"."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    # exactly one of the three
    prompt: Text | None = None
    input_ids: list[TokenId] | None = Field(None, min_length=1, max_length=1 << 20)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=1024)
    add_generation_prompt: bool = True
    # generate first, then inspect prompt + completion
    max_tokens: int = Field(0, ge=0, le=1 << 20)
    temperature: Float = Field(0.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    # what to report
    layers: list[LayerIndex] | None = Field(None, min_length=1, max_length=1024)
    heads: list[LayerIndex] | None = Field(None, min_length=1, max_length=1024)
    include: list[Literal["massive", "norms", "attention", "logit_lens"]] | None = Field(None, max_length=4)
    massive_threshold: Float = Field(100.0, gt=0.0)
    massive_ratio: Float = Field(1000.0, gt=0.0)
    massive_top_k: int = Field(3, ge=1, le=100)
    massive_max_entries: int = Field(64, ge=1, le=4096)
    mode: Literal["auto", "none", "full", "rows", "topk", "pooled"] = "auto"
    rows: list[Position] | None = Field(None, min_length=1, max_length=4096)
    attention_top_k: int = Field(8, ge=1, le=1024)
    pool_size: int = Field(16, ge=1, le=1 << 16)
    pool_reduce: Literal["mean", "max"] = "mean"
    format: Literal["base64", "list"] = "base64"
    lens_top_k: int = Field(5, ge=1, le=100)
    lens_positions: list[Position] | None = Field(None, min_length=1, max_length=1024)

    @field_validator("layers", "heads", "rows", "lens_positions")
    @classmethod
    def _unique(cls, v):
        if v is not None and len(set(v)) != len(v):
            raise ValueError("must not repeat an index")
        return v
