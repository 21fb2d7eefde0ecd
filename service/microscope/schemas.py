"""The microscope's request models: /inspect, /inspect/compare, /inspect/patch, /inspect/attribute and /v1/vectors,
and the fields its extensions add to a generation request (interventions, hidden-state reads, the `inspect` summary).
Strict, as every request model is (service/api/openai/schemas.py says how)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from model.massive import MASSIVE_RATIO, MASSIVE_THRESHOLD
from service.common.fields import ChatMessage, Float, Int, NonEmptyText, TokenId


LayerIndex = Int(ge=0, lt=1 << 16)
HeadIndex = Int(ge=0, lt=1 << 16)
PatchSite = Literal["block_output", "attention_output", "mlp_output", "resid_mid", "mlp_input", "head_output", "head_q",
                    "head_k", "head_v"]
Position = Int(ge=-(1 << 20), lt=1 << 20)  # negative: from the end
TokenIndex = Int(ge=0, lt=1 << 20)
VectorName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]


class VectorRef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: VectorName


HookName = Annotated[str, Field(min_length=1, max_length=256)]  # checked by model/hook_names.parse_hook (400 naming `hook`)


class FeatureRef(BaseModel):
    """A dictionary's feature: `sae`, a name the server serves (GET /v1/saes), and the feature's index."""

    model_config = ConfigDict(extra="forbid", strict=True)
    sae: VectorName
    id: Int(ge=0, lt=1 << 30)


class InterventionItem(BaseModel):
    """One edit of the residual stream (docs/api.md "Interventions"; model/interventions.py). The place is `layer` +
    `site` (default block_output), or `hook` (a TransformerLens hook name or an HF module path), or for a `feature`
    the dictionary's own hook."""

    model_config = ConfigDict(extra="forbid", strict=True)
    layer: LayerIndex | Annotated[list[LayerIndex], Field(min_length=1, max_length=1024)] | None = None
    site: Literal["block_output", "attention_output", "mlp_output", "resid_mid", "mlp_input"] | None = None
    hook: HookName | None = None
    op: Literal["add", "set", "scale", "project_out", "clamp"] = "add"
    feature: FeatureRef | None = None  # add: scale x its decoder row; clamp: its activation held at `value`
    value: Float | None = None  # clamp
    positions: Literal["all", "prompt", "generated"] | Annotated[list[TokenIndex], Field(min_length=1, max_length=4096)] = "all"
    vector: Annotated[list[Float], Field(min_length=1, max_length=1 << 16)] | VectorRef | None = None
    scale: Float = 1.0
    dims: Annotated[list[Int(ge=0, lt=1 << 16)], Field(min_length=1, max_length=1 << 16)] | None = None
    values: Annotated[list[Float], Field(min_length=1, max_length=1 << 16)] | None = None
    factor: Float = 1.0


Interventions = Annotated[list[InterventionItem], Field(max_length=256)]


class HiddenStatesOptions(BaseModel):
    """`return_hidden_states`: one site of some blocks (default their outputs) returned with each generated token,
    named by `layers` + `site` or by `hooks` (names of one site: blocks.L.hook_resid_post, model.layers.L, ...)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    layers: Annotated[list[LayerIndex], Field(min_length=1, max_length=1024)] | None = None
    site: Literal["block_output", "attention_output", "resid_mid", "mlp_normalized", "mlp_input",
                  "mlp_output"] | None = None
    hooks: Annotated[list[HookName], Field(min_length=1, max_length=1024)] | None = None
    positions: Literal["last", "all"] | Annotated[list[TokenIndex], Field(min_length=1, max_length=4096)] = "last"
    dtype: Literal["float32", "float16"] = "float32"


class InspectSummaryOptions(BaseModel):
    """The `inspect` extension of /v1/completions: the inspection summary of each prompt beside the completion, or
    with `stream: true` (on a streamed completion) the attention telemetry of every token in its chunk instead."""

    model_config = ConfigDict(extra="forbid", strict=True)
    massive_threshold: Float = Field(MASSIVE_THRESHOLD, gt=0.0)
    massive_ratio: Float = Field(MASSIVE_RATIO, gt=0.0)
    stream: bool = False
    top_k: Int(ge=1, le=32) = 5  # attended keys per head and layer, with stream


class InspectFeatures(BaseModel):
    """/inspect's `features`: a served dictionary's feature x token grid (model/probes/feature_grid.py)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    sae: Annotated[str, Field(min_length=1, max_length=64)]
    top_k: Int(ge=1, le=64) = 8
    ids: Annotated[list[Int(ge=0, lt=1 << 24)], Field(min_length=1, max_length=1024)] | None = None

    @field_validator("ids")
    @classmethod
    def _unique(cls, v):
        if v is not None and len(set(v)) != len(v):
            raise ValueError("must not repeat a feature")
        return v


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
    features: InspectFeatures | None = None

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
    # instead of sites + layers: TransformerLens hook names or HF module paths (model/hook_names.py)
    hook: HookName | Annotated[list[HookName], Field(min_length=1, max_length=1024)] | None = None

    @field_validator("sites", "layers", "positions", "heads", "hook")
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


class AttributeFeatures(BaseModel):
    """/inspect/attribute's `features`: attribution over a served dictionary's features at its own site
    (model/probes/feature_attribution.py)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    sae: NonEmptyText  # a name in the server's dictionaries (--sae, POST /v1/saes)
    top: Int(ge=1, le=1 << 16) = 20  # the nodes (features, or features at positions) reported, largest first


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
    features: AttributeFeatures | None = None  # either method, over a dictionary's features


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
