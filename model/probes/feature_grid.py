"""`FeatureGrid`: one dictionary's features over an inspected sequence (the feature x token grid of /inspect), worked
out in bounded steps on the engine thread after the inspection's forward recorded the dictionary's site.

For a T-token sequence and a dictionary of F features reading (layer, site) (model/features/sae/dictionary.py):

    by token     each token's `top_k` features by activation, largest first, the active ones only (f > 0)
    features     U = the union of every token's top_k and the requested `ids`; for each, its activations at the
                 T tokens (kept sparse: the nonzero ones), its max and its mean over the T tokens
    promotes /   the `LOGIT_TOKENS` largest and smallest entries of W_U (g * d_i): what feature i's decoder direction
    suppresses   d_i (at the dictionary's output site, through wo for a head_output dictionary) adds to the logits,
                 through the final norm's gain g and the unembedding W_U (divided by Granite's logits scaling), as
                 the logit lens maps a residual stream (model/probes/__init__.py; `Transformer.logits`) without
                 the norm's division by rms(d_i), which scales all V entries alike. sae_vis's logits table
                 (callummcdougall/sae_vis, `feature_resid_dir @ W_U` over TransformerLens' W_U, whose
                 `fold_layer_norm` multiplies the final norm's gain into it) and Neuronpedia's positive and negative
                 logits are the same numbers.

Three stages, each in chunks sized from its measured cost per row, so one `advance(budget_s)` does about budget_s
of work and serving steps run between them: (1) encode the recorded rows, keep each row's top_k (the union is
known only when every row has been seen); (2) encode them again, keep the union's columns, sparse; (3) the logit
lists of the union's features not computed before. The encoder runs twice rather than holding T x F activations;
stage 3 remembers each (model, dictionary)'s lists, which depend on the weights only, so a feature's lists are
computed once per server.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from model.features.sae import Dictionary

LOGIT_TOKENS = 10  # tokens listed per feature on each side
# the sites an inspection's forward hands its attention context (model/transformer.py's `ctx.edit` calls)
GRID_SITES = ("block_output", "attention_output", "resid_mid", "mlp_input", "mlp_output", "head_output")


class FeatureGridTooLarge(ValueError):
    """The grid's nonzero activations exceed what the response may carry (`max_entries`)."""


@dataclass
class FeatureRequest:
    """What an inspection's feature grid is asked for: `dictionary` (served as `name`), each token's `top_k`, the
    feature `ids` always reported, and a bound on the nonzero activations kept (the response's size)."""

    name: str
    dictionary: Dictionary
    top_k: int = 8
    ids: list[int] | None = None
    max_entries: int = 1 << 22

    def validate(self) -> None:
        """ValueError naming the field (`features.ids`, `features.top_k`) for a request this dictionary cannot
        answer."""
        F = self.dictionary.d_sae
        if self.top_k < 1:
            raise ValueError("features.top_k: must be at least 1")
        if self.dictionary.hook_out.site == "mlp_hidden":
            raise ValueError(f"features.sae: dictionary {self.name!r} writes the MLP's hidden activation, which has "
                             "no direction in the residual stream to read through the unembedding")
        bad = [i for i in self.ids or [] if not 0 <= i < F]
        if bad:
            raise ValueError(f"features.ids: {bad[0]} is out of range [0, {F}) for dictionary {self.name!r}")


@dataclass
class FeatureGridResult:
    name: str
    dictionary: Dictionary
    top_k: int
    top_ids: Tensor  # (T, top_k) int64: each token's features, largest first (-1 past its active ones)
    top_values: Tensor  # (T, top_k) float32 (0 past its active ones)
    ids: Tensor  # (U,) int64: the grid's features, by descending max activation, then id
    max: Tensor  # (U,) float32 over the T tokens
    mean: Tensor  # (U,) float32 over the T tokens
    entry_feature: Tensor  # (N,) int64: index into `ids` of each nonzero activation, ascending
    entry_position: Tensor  # (N,) int64: its token, ascending within a feature
    entry_value: Tensor  # (N,) float32
    promote_ids: Tensor  # (U, LOGIT_TOKENS) int64: token ids, largest logit first
    promote_logits: Tensor  # (U, LOGIT_TOKENS) float32
    suppress_ids: Tensor  # (U, LOGIT_TOKENS) int64: smallest logit first
    suppress_logits: Tensor  # (U, LOGIT_TOKENS) float32


# (model, dictionary) -> (computed (F,) bool, ids (F, 2N) int64, logits (F, 2N) float32): the promote / suppress
# lists, which depend on the weights only; weak on both, so an unloaded dictionary takes its lists with it
_LOGIT_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def residual_directions(model, d: Dictionary, features: Tensor) -> Tensor:
    """The decoder directions of `features` (n,) as they enter the residual stream (n, D): W_dec's rows, through
    the attention's output projection wo for a dictionary that writes the heads' outputs (TransformerLens' hook_z,
    H * E wide). (A post-norm model's norm after the attention is left out: the direction is the one before it.)"""
    rows = d.W_dec[features.to(d.W_dec.device)].to(model.device, model.dtype)  # (n, D_out)
    if d.hook_out.site == "head_output":
        rows = model.layers[d.hook_out.layer].attention.wo(rows)  # (n, D)
        if model.config.residual_multiplier != 1.0:  # what the residual add takes (Granite)
            rows = rows * model.config.residual_multiplier
    return rows


def direction_logits(model, directions: Tensor) -> Tensor:
    """directions (n, D) in the residual stream -> W_U (g * d) (n, V) float32: the LM head on the final norm's gain
    times each direction, divided by the logits scaling, as `Transformer.logits` ends."""
    out = model.output(directions * model.norm.weight).float()
    scaling = model.config.logits_scaling
    return out / scaling if scaling != 1.0 else out


class FeatureGrid:
    """Records rows of the dictionary's input site (`rows`, called by the forward's attention context with each chunk
    of rows as it is produced), then `advance(budget_s)` until `done`."""

    MIN_ROWS = 16
    MIN_FEATURES = 4

    def __init__(self, model, request: FeatureRequest, num_tokens: int) -> None:
        request.validate()
        self.model, self.request, self.T = model, request, num_tokens
        d = request.dictionary
        self.hook = d.hook_in
        self.x = torch.empty(num_tokens, d.d_in, dtype=torch.float32, device=d.W_enc.device)  # (T, D_in)
        self.recorded = 0
        self.k = min(request.top_k, d.d_sae)
        self.top_ids = torch.full((num_tokens, self.k), -1, dtype=torch.int64)
        self.top_values = torch.zeros(num_tokens, self.k)
        self.stage, self.row = 1, 0
        self.union: Tensor | None = None  # (U,) int64, ascending
        self.col_max = self.col_sum = None  # (U,) float32
        self.coo: list[tuple[Tensor, Tensor, Tensor]] = []  # per chunk: union index, position, value
        self.num_entries = 0
        self.todo: Tensor | None = None  # (n,) feature ids whose logit lists are still to compute
        self.cost: dict[int, float] = {}  # stage -> measured seconds per row (per feature in stage 3)
        self.result: FeatureGridResult | None = None

    @property
    def done(self) -> bool:
        return self.result is not None

    def rows(self, r0: int, x: Tensor) -> None:
        """x (R, ...) rows r0 .. r0 + R - 1 of the site (the heads' outputs (R, H, E) flattened to H * E)."""
        self.x[r0 : r0 + x.shape[0]] = x.reshape(x.shape[0], -1)
        self.recorded = max(self.recorded, r0 + x.shape[0])

    def advance(self, budget_s: float | None) -> None:
        """About `budget_s` of work (at least one chunk; None: a whole stage)."""
        if self.recorded < self.T:
            raise RuntimeError(f"the forward recorded {self.recorded} of {self.T} rows at {self.hook}")
        t0, stage = time.perf_counter(), self.stage
        n = self._chunk(budget_s)
        if stage == 1:
            self._top(n)
        elif stage == 2:
            self._columns(n)
        else:
            self._logits(n)
        self.cost[stage] = (time.perf_counter() - t0) / max(n, 1)

    def _chunk(self, budget_s: float | None) -> int:
        left = (self.T - self.row) if self.stage in (1, 2) else len(self.todo)
        if budget_s is None:
            return max(left, 1)
        per = self.cost.get(self.stage)
        least = self.MIN_ROWS if self.stage in (1, 2) else self.MIN_FEATURES
        n = least if per is None else max(least, int(max(budget_s, 0.0) / max(per, 1e-9)))
        return max(1, min(n, left))

    def _top(self, n: int) -> None:
        r0, r1 = self.row, self.row + n
        f = self.request.dictionary.encode(self.x[r0:r1]).float()  # (R, F)
        values, ids = f.topk(self.k, dim=-1, sorted=True)  # (R, k) each, largest first
        active = values > 0
        self.top_values[r0:r1] = torch.where(active, values, 0.0).cpu()
        self.top_ids[r0:r1] = torch.where(active, ids, -1).cpu()
        self.row = r1
        if r1 == self.T:
            chosen = self.top_ids[self.top_ids >= 0]
            extra = torch.tensor(self.request.ids or [], dtype=torch.int64)
            self.union = torch.unique(torch.cat([chosen, extra]))  # (U,) ascending
            U = len(self.union)
            self.col_max, self.col_sum = torch.zeros(U), torch.zeros(U)
            self.stage, self.row = 2, 0

    def _columns(self, n: int) -> None:
        r0, r1 = self.row, self.row + n
        f = self.request.dictionary.encode(self.x[r0:r1]).float()  # (R, F)
        cols = f[:, self.union.to(f.device)].cpu()  # (R, U)
        self.col_max = torch.maximum(self.col_max, cols.amax(0))
        self.col_sum += cols.sum(0)
        pos, feat = cols.nonzero(as_tuple=True)  # row-major: (position, feature) pairs
        self.num_entries += len(pos)
        if self.num_entries > self.request.max_entries:
            raise FeatureGridTooLarge(
                f"features: the grid has more than {self.request.max_entries} nonzero activations "
                f"({len(self.union)} features over {self.T} tokens), over the inspect response budget; ask for a "
                "smaller features.top_k, fewer features.ids or a shorter sequence")
        self.coo.append((feat, pos + r0, cols[pos, feat]))
        self.row = r1
        if r1 == self.T:
            self.x = None
            self.stage = 3
            cached = self._cache()[0]
            self.todo = self.union[~cached[self.union]]

    def _cache(self) -> tuple[Tensor, Tensor, Tensor]:
        d = self.request.dictionary
        per_model = _LOGIT_CACHE.setdefault(self.model, weakref.WeakKeyDictionary())
        if d not in per_model:
            per_model[d] = (torch.zeros(d.d_sae, dtype=torch.bool),
                            torch.zeros(d.d_sae, 2 * LOGIT_TOKENS, dtype=torch.int64),
                            torch.zeros(d.d_sae, 2 * LOGIT_TOKENS))
        return per_model[d]

    def _logits(self, n: int) -> None:
        computed, ids, logits = self._cache()
        if len(self.todo):
            chunk, self.todo = self.todo[:n], self.todo[n:]
            z = direction_logits(self.model, residual_directions(self.model, self.request.dictionary,
                                                                 chunk.to(self.model.device)))  # (n, V)
            N = min(LOGIT_TOKENS, z.shape[-1])
            hi, lo = z.topk(N, dim=-1), z.topk(N, dim=-1, largest=False)
            ids[chunk, :N], logits[chunk, :N] = hi.indices.cpu(), hi.values.cpu()
            ids[chunk, LOGIT_TOKENS : LOGIT_TOKENS + N] = lo.indices.cpu()
            logits[chunk, LOGIT_TOKENS : LOGIT_TOKENS + N] = lo.values.cpu()
            computed[chunk] = True
        if not len(self.todo):
            self._finish(ids, logits)

    def _finish(self, ids: Tensor, logits: Tensor) -> None:
        union, T = self.union, self.T
        mean = self.col_sum / T
        # by descending max, then ascending id (a stable sort of the ascending union)
        order = torch.sort(-self.col_max, stable=True).indices  # (U,)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order))
        feat = torch.cat([c[0] for c in self.coo]) if self.coo else torch.zeros(0, dtype=torch.int64)
        pos = torch.cat([c[1] for c in self.coo]) if self.coo else torch.zeros(0, dtype=torch.int64)
        val = torch.cat([c[2] for c in self.coo]) if self.coo else torch.zeros(0)
        feat = rank[feat]
        by = torch.sort(feat * T + pos).indices  # by feature, then position
        N = min(LOGIT_TOKENS, self.model.config.vocab_size)
        lists = ids[union[order]], logits[union[order]]  # (U, 2 LOGIT_TOKENS) each
        self.coo = []
        self.result = FeatureGridResult(
            name=self.request.name, dictionary=self.request.dictionary, top_k=self.k,
            top_ids=self.top_ids, top_values=self.top_values, ids=union[order], max=self.col_max[order],
            mean=mean[order], entry_feature=feat[by], entry_position=pos[by], entry_value=val[by],
            promote_ids=lists[0][:, :N], promote_logits=lists[1][:, :N],
            suppress_ids=lists[0][:, LOGIT_TOKENS : LOGIT_TOKENS + N],
            suppress_logits=lists[1][:, LOGIT_TOKENS : LOGIT_TOKENS + N])
