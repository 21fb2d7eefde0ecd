"""What an inspection is asked for (`ProbeOptions`, validated against the model and sequence) and what it reports
(`ProbeResult` and its parts). Definitions of the quantities: model/probes/__init__.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from torch import Tensor

from model.massive import MASSIVE_RATIO, MASSIVE_THRESHOLD

if TYPE_CHECKING:
    from model.probes.feature_grid import FeatureGridResult

AttentionMode = Literal["none", "full", "rows", "topk", "pooled"]
# What an inspection can report; the default leaves out the two whose size or cost grows with the vocabulary or
# the width: "prediction" (the next-token distribution at every position: perplexity and the top next tokens)
# and "hidden_states" (the block outputs themselves)
INCLUDES = frozenset({"massive", "norms", "attention", "logit_lens", "prediction", "hidden_states"})
DEFAULT_INCLUDES = frozenset({"massive", "norms", "attention", "logit_lens"})


@dataclass
class ProbeOptions:
    layers: list[int] | None = None  # 0-indexed blocks to report; None = all
    heads: list[int] | None = None  # 0-indexed query heads to report; None = all
    include: frozenset[str] = DEFAULT_INCLUDES
    massive_threshold: float = MASSIVE_THRESHOLD  # Sun et al.'s criterion (model/massive.py)
    massive_ratio: float = MASSIVE_RATIO
    massive_top_k: int = 3  # largest magnitudes listed per layer, flagged or not (the paper's layer-wise figure)
    massive_max_entries: int = 64  # flagged entries listed per layer (the count is always exact)
    mode: AttentionMode = "none"
    rows: list[int] | None = None  # query positions for mode "rows"
    attention_top_k: int = 8  # keys per query row for mode "topk"
    pool_size: int = 16  # tile side for mode "pooled"
    pool_reduce: Literal["mean", "max"] = "mean"
    lens_top_k: int = 5
    lens_positions: list[int] | None = None  # None = the last token
    hidden_positions: list[int] | None = None  # positions whose block outputs "hidden_states" returns; None = all
    row_block: int = 256  # query rows per attention block (memory: Hs x row_block x T floats)

    def validate(self, n_layers: int, n_heads: int, num_tokens: int) -> None:
        """ValueError naming the field for anything out of range for this model and sequence."""
        def check(name, values, n):
            if values is not None:
                if not values:
                    raise ValueError(f"{name} must not be empty")
                bad = [v for v in values if not 0 <= v < n]
                if bad:
                    raise ValueError(f"{name}: {bad[0]} is out of range [0, {n})")
                if len(set(values)) != len(values):
                    raise ValueError(f"{name} has duplicates")
        check("layers", self.layers, n_layers)
        check("heads", self.heads, n_heads)
        check("rows", self.rows, num_tokens)
        check("lens_positions", [p % num_tokens if -num_tokens <= p < 0 else p for p in self.lens_positions]
              if self.lens_positions is not None else None, num_tokens)
        check("hidden_positions", self.hidden_positions, num_tokens)
        if unknown := set(self.include) - INCLUDES:
            raise ValueError(f"include: unknown {sorted(unknown)[0]!r}; choose from {sorted(INCLUDES)}")
        if self.mode == "rows" and not self.rows:
            raise ValueError("rows: mode 'rows' needs the query positions to report")
        if self.mode not in ("none", "full", "rows", "topk", "pooled"):
            raise ValueError(f"mode: unknown {self.mode!r}")
        if self.mode != "none" and "attention" not in self.include:
            raise ValueError("mode: attention maps need 'attention' in include")
        for name in ("massive_top_k", "massive_max_entries", "attention_top_k", "pool_size", "lens_top_k", "row_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")

    def selected_layers(self, n_layers: int) -> list[int]:
        return sorted(self.layers) if self.layers is not None else list(range(n_layers))

    def selected_heads(self, n_heads: int) -> list[int]:
        return sorted(self.heads) if self.heads is not None else list(range(n_heads))


def estimate_map_elements(opts: ProbeOptions, T: int, n_layers: int, n_heads: int) -> int:
    """Number of map values the options produce for a T-token sequence (topk counts values and indices)."""
    L, Hs = len(opts.selected_layers(n_layers)), len(opts.selected_heads(n_heads))
    if opts.mode == "full":
        per_head = T * T
    elif opts.mode == "rows":
        per_head = len(opts.rows or []) * T
    elif opts.mode == "topk":
        per_head = 2 * T * min(opts.attention_top_k, T)
    elif opts.mode == "pooled":
        per_head = math.ceil(T / opts.pool_size) ** 2
    else:
        per_head = 0
    return L * Hs * per_head


@dataclass
class ActivationEntry:
    token: int  # position in the sequence
    dim: int  # feature (residual-stream) dimension
    value: float  # signed
    ratio: float | None  # |value| / median |h| of the block; None when the median is 0
    massive: bool


@dataclass
class HeadStats:
    head: int
    kv_group: int  # the KV head this query head reads (grouped-query attention: head // (H / K))
    sink_mass: float | None  # mean attention on token 0 over queries 1..T-1
    massive_mass: float | None  # mean attention on the tokens carrying massive activations (queries 1..T-1)
    entropy: float | None  # mean entropy (nats) of the attention rows of queries 1..T-1


@dataclass
class AttentionMaps:
    """Maps of the selected heads, in the order of `ProbeResult.heads`.

    full   values (Hs, T, T): row q is the distribution of query q over keys (zero above the diagonal)
    rows   values (Hs, R, T) for `rows`
    topk   values (Hs, T, k) and indices (Hs, T, k): each row's k largest weights, largest first
    pooled values (Hs, ceil(T/b), ceil(T/b)) over b x b tiles: "mean" sums each row over the key tile and averages
           over the query tile, so every pooled row still sums to 1; "max" is the largest weight in the tile
    """

    mode: AttentionMode
    values: Tensor  # float32
    indices: Tensor | None = None  # int64, topk only
    rows: list[int] | None = None


@dataclass
class LensEntry:
    position: int
    token_ids: list[int]
    probs: list[float]


@dataclass
class LayerProbe:
    layer: int
    max_abs: float
    median_abs: float
    top: list[ActivationEntry]  # the largest magnitudes, flagged or not
    massive: list[ActivationEntry]  # flagged entries, largest first, at most massive_max_entries
    num_massive: int
    residual_norm: Tensor | None = None  # (T,) L2 norm of the block output per token
    heads: list[HeadStats] | None = None
    maps: AttentionMaps | None = None
    lens: list[LensEntry] | None = None
    hidden: Tensor | None = None  # (P, D) float32: the block output at `ProbeResult.hidden_positions`
    _received: Tensor | None = field(default=None, repr=False)  # (Hs, T) mean attention each key receives


@dataclass
class ProbeResult:
    token_ids: list[int]
    heads: list[int]
    kv_groups: list[int]
    layers: list[LayerProbe]  # the selected layers, in order
    sink_mass_by_layer: dict[int, float]  # every block: first-token mass averaged over the selected heads
    massive_layers: list[int]  # every block (selected or not) with at least one massive activation
    massive_dims: list[int]
    massive_tokens: list[int]
    compute_ms: float = 0.0
    hidden_positions: list[int] | None = None  # the positions of each layer's `hidden`
    prediction: Prediction | None = None
    features: "FeatureGridResult | None" = None  # the feature x token grid (model/probes/feature_grid.py)


@dataclass
class Prediction:
    """The model's own next-token distribution (the head after the last block), at every position of the sequence."""

    perplexity: float | None  # exp(mean NLL of tokens 1 .. T-1); None for one token
    num_predicted: int
    next_token_ids: list[int]  # the top-k after the last position, most likely first
    next_token_probs: list[float]
