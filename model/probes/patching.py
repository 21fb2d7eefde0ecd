"""Activation patching (causal tracing): which activations carry the behaviour that tells a clean prompt from a
corrupted one.

Meng et al. 2022, "Locating and Editing Factual Associations in GPT" (section 2.1, causal tracing): run a clean and
a corrupted prompt, copy one activation of the clean run into the corrupted run at one (layer, position, site) and
measure how much of the clean behaviour comes back. Heimersheim & Nanda 2024, "How to use and interpret activation
patching", give the practice this module follows: a logit difference (or log-probability) metric at the last
position, normalised so that 0 is the corrupted run and 1 the clean one,

    normalised(cell) = (m(patched) - m(corrupted)) / (m(clean) - m(corrupted)),

"denoising" (clean into corrupted: which activations suffice to restore the behaviour) by default, "noising"
(corrupted into clean: which are necessary) on request; a noising sweep's cells are near 1 where an activation
does not matter and fall where it does.

Here a sweep runs on the serving engine as ordinary rows (service/microscope/routes/patch.py drives it):

    source run   the prompt whose activations are copied (clean when denoising), with a hidden-state read
                 (model/interventions.py's `HiddenStateRead`) of every swept (layer, site) at every swept position
    target run   the prompt they are copied into, unedited: its metric is the other baseline, and its KV blocks enter
                 the prefix cache
    cells        one request per (site, layer, position): the target prompt with one `set` intervention writing the
                 source's value, all D dims, at that (layer, site, position); a `set` of every dim is the value
                 itself, bitwise (model/edits.py). Positions before the patched one are the target run's, so the
                 prefix cache serves their whole blocks.

Sites: "block_output" (the residual stream after block l, what a HF forward hook on the decoder layer returns),
"attention_output" and "mlp_output" (the sub-blocks' outputs before their residual adds), "resid_mid" (the stream
between them) and "mlp_input" (the MLP's normed input): the sites an intervention sets (EDIT_SITES); and per head (a cell per
head: `heads` are query heads, and head_k / head_v sweep the KV heads those read): "head_output" (a head's output
before wo, TransformerLens' hook_z), "head_q", "head_k", "head_v" (before RoPE: at one position the rotation is the
same in both runs, so this is the same patch as after it). The source values of the head sites are read by one
capture forward of the source prompt (model/probes/capture.py): the engine's hidden-state reads carry the residual
stream's width only.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from model.interventions import EDIT_SITES, HEAD_SITES, HeadShape, HiddenStateRead, Intervention

METRICS = ("logit_diff", "logprob")
DIRECTIONS = ("denoise", "noise")


@dataclass(frozen=True)
class Cell:
    site: str
    layer: int
    position: int
    head: int | None = None  # at a head site: the query head (head_q, head_output) or KV head (head_k, head_v)


@dataclass
class PatchSweep:
    """One sweep's shape: the grid is sites x layers x positions (in the order given), with a head axis before the
    positions at the head sites, over a T-token prompt pair. `answer` / `contrast`: the token ids the metric reads at
    the last position (`contrast` only for logit_diff). `heads`: the query heads of the head sites (None: every one
    of `head_shape`'s)."""

    sites: list[str]
    layers: list[int]
    positions: list[int]
    num_tokens: int
    answer: int
    contrast: int | None = None
    metric: str = "logit_diff"
    direction: str = "denoise"
    heads: list[int] | None = None
    head_shape: HeadShape | None = None

    def validate(self, n_layers: int) -> None:
        """ValueError whose message starts with the field it is about ("layers: ...")."""
        T = self.num_tokens
        known = EDIT_SITES + HEAD_SITES
        if not self.sites or any(s not in known for s in self.sites):
            bad = [s for s in self.sites if s not in known]
            raise ValueError(f"sites: unknown {bad[0]!r}; choose from {list(known)}" if bad else "sites: give at least one")
        if self.head_sites:
            if self.head_shape is None:
                raise ValueError("sites: head sites need the model's heads")
            H = self.head_shape.n_heads
            if self.heads is not None and (not self.heads or any(not 0 <= h < H for h in self.heads)):
                raise ValueError(f"heads: query head indices must be in [0, {H}) for this model")
            if self.heads is not None and len(set(self.heads)) != len(self.heads):
                raise ValueError("heads: must not repeat a head")
        if len(set(self.sites)) != len(self.sites):
            raise ValueError("sites: must not repeat a site")
        if not self.layers or any(not 0 <= l < n_layers for l in self.layers):
            raise ValueError(f"layers: block indices must be in [0, {n_layers}) for this model")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError("layers: must not repeat a block")
        if not self.positions or any(not 0 <= p < T for p in self.positions):
            raise ValueError(f"positions: token indices must be in [-{T}, {T}) for these {T}-token prompts")
        if len(set(self.positions)) != len(self.positions):
            raise ValueError("positions: must not repeat a position")
        if self.metric not in METRICS:
            raise ValueError(f"metric: unknown {self.metric!r}; choose from {list(METRICS)}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction: unknown {self.direction!r}; choose from {list(DIRECTIONS)}")
        if self.metric == "logit_diff" and self.contrast is None:
            raise ValueError("contrast: logit_diff needs a contrast token")

    @property
    def head_sites(self) -> list[str]:
        return [s for s in self.sites if s in HEAD_SITES]

    @property
    def residual_sites(self) -> list[str]:
        return [s for s in self.sites if s in EDIT_SITES]

    def heads_of(self, site: str) -> list[int | None]:
        """The head axis of a site: [None] at a residual site; the swept query heads, or for head_k / head_v the KV
        heads they read (grouped-query attention: head h reads KV head h // (H / K))."""
        if site not in HEAD_SITES:
            return [None]
        hs = self.head_shape
        heads = list(range(hs.n_heads)) if self.heads is None else list(self.heads)
        if site in ("head_k", "head_v"):
            group = hs.n_heads // hs.n_kv_heads
            return sorted({h // group for h in heads})
        return heads

    @property
    def num_cells(self) -> int:
        return sum(len(self.heads_of(s)) for s in self.sites) * len(self.layers) * len(self.positions)

    def cells(self) -> list[Cell]:
        """Every cell, in the grid's order (site, then layer, then head at a head site, then position)."""
        return [Cell(s, l, p, h) for s in self.sites for l in self.layers for h in self.heads_of(s)
                for p in self.positions]

    def source_read(self) -> HiddenStateRead | None:
        """The source run's read: every swept (layer, residual site) at every swept position (None: no such site)."""
        sites = self.residual_sites
        return HiddenStateRead(list(self.layers), tuple(sorted(self.positions)), tuple(sites)) if sites else None

    def score_token_ids(self) -> tuple[int, ...]:
        return (self.answer,) if self.contrast is None else (self.answer, self.contrast)

    def source_bytes(self, dim: int) -> int:
        """What the sweep holds while it runs: the source's values (read once, then one `set` vector a cell, its
        plan's float64 copy included), float32 values of `dim` each (a head's, zero-padded to `dim` in the cell's
        plan: model/interventions.py)."""
        return self.num_cells * dim * 4 * 3


def metric(sweep: PatchSweep, scored: list[float]) -> float:
    """The metric from the raw log-probabilities of sweep.score_token_ids() at the last position: logit_diff =
    logit(answer) - logit(contrast) (the log-softmax normaliser cancels), or logprob = log p(answer)."""
    return scored[0] - scored[1] if sweep.metric == "logit_diff" else scored[0]


def cell_interventions(sweep: PatchSweep, source: Tensor | None, positions: list[int],
                       captured: dict[tuple[int, str], Tensor] | None = None,
                       cells: list[Cell] | None = None) -> list[list[Intervention]]:
    """One `set` of the whole activation per cell (all D dims, or a head's E), with the source's value: `source`
    (n_positions, n_layers x n_residual_sites, D) float32 as the read returns it (positions in `positions`' order,
    columns layer-major), else `captured` {(layer, site): (n_positions, D) or (n_positions, heads, E)}
    (model/probes/capture.py's values, at `positions`); for `cells` (default: every cell of the sweep)."""
    S = len(sweep.residual_sites)
    row = {p: i for i, p in enumerate(positions)}
    col = {(l, s): i * S + j for i, l in enumerate(sweep.layers) for j, s in enumerate(sweep.residual_sites)}
    out = []
    for c in sweep.cells() if cells is None else cells:
        if c.head is None and source is not None:
            v = source[row[c.position], col[(c.layer, c.site)]]  # (D,)
        else:
            v = captured[(c.layer, c.site)][row[c.position]]  # (D,) or (heads, E)
            v = v if c.head is None else v[c.head]  # (E,)
        out.append([Intervention(c.layer, c.site, "set", (c.position,), dims=tuple(range(v.shape[0])),
                                 values=tuple(v.tolist()), head=c.head)])
    return out


def normalise(values: list[float], clean: float, corrupted: float) -> list[float]:
    """0 at the corrupted run's metric, 1 at the clean run's (ValueError when the two are equal)."""
    span = clean - corrupted
    if span == 0.0:
        raise ValueError("corrupted: the clean and corrupted runs give the same metric; there is nothing to restore")
    return [(v - corrupted) / span for v in values]


def grid(sweep: PatchSweep, flat: list[float]) -> list[list]:
    """Cells in `cells()` order -> [site][layer][position], or [site][layer][head][position] at a head site."""
    L, P = len(sweep.layers), len(sweep.positions)
    out, at = [], 0
    for s in sweep.sites:
        heads = sweep.heads_of(s)
        rows = []
        for _ in range(L):
            per_head = [flat[at + i * P : at + (i + 1) * P] for i in range(len(heads))]
            rows.append(per_head if s in HEAD_SITES else per_head[0])
            at += len(heads) * P
        out.append(rows)
    return out
