"""Interventions: a request's edits of the residual stream, validated, and compiled per token position.

An edit acts at one of the sites of block `layer` (model/transformer.py's `Block.forward` hands each to its
attention context, `ctx.edit(layer, site, x)`), in the block's order:

    attention_output   the attention sub-block's output wo(...), before its residual add      x (.., D)
    resid_mid          the residual stream between the two sub-blocks, h + attention_output: what HF's
                       post_attention_layernorm takes (TransformerLens' hook_resid_mid); an edit here is the
                       stream's, so the MLP and every later block see it                       x (.., D)
    mlp_normalized     resid_mid / rms(resid_mid), the MLP's normed input without the norm's gain
                       (TransformerLens' ln2.hook_normalized): read only, taken from resid_mid after its edits
                       (model/edits.py), never handed to the context                          x (.., D)
    mlp_input          ffn_norm(resid_mid), the feed-forward's input, gain included (HF's mlp input; under
                       post-norm, OLMo-2, resid_mid itself, as a copy: an edit there is the MLP's alone)  x (.., D)
    mlp_output         the feed-forward sub-block's output w2(...), before its residual add   x (.., D)
    block_output       the residual stream after the block (both adds): what a HF forward hook on the decoder
                       layer returns, where /inspect reports massive activations, and where llama.cpp adds a
                       control vector (`build_cvec(cur, il)` after the FFN residual add in src/models/llama.cpp;
                       `llama_adapter_cvec::apply_to` in src/llama-adapter.cpp)

and, inside the attention module (model/transformer.py's `Attention.forward`), on one head (`head`):

    head_q, head_k, head_v   a query head's q, a KV head's k or v, before RoPE (TransformerLens' hook_q / hook_k /
                             hook_v; at one position the rotation is the same for both runs of a patch, so editing
                             before or after it is the same edit)                                    x (.., E)
    head_output              a query head's attention output before wo (TransformerLens' hook_z)     x (.., E)

Operations on the positions they apply to:

    add          x += scale * vector                  activation addition / steering (Turner et al. 2023;
                                                      contrastive activation addition, Rimsky et al. 2024)
    set          x[dims] = values                     zero or mean ablation (Sun et al. 2024, section 3)
    scale        x[dims] *= factor
    project_out  x -= (x . u) u,  u = vector / |vector|   directional ablation (Arditi et al. 2024)
    clamp        x += (v - f_F(x)) d_F                 a sparse autoencoder's feature F held at v (Templeton et al.
                                                      2024; model/features/sae/steer.py's `FeatureClamp`)

Steering by feature `add`s a dictionary's decoder row (resolved to a vector where the request is read); `clamp`
reads the row's own activation of the feature, so it is not affine in x: it is kept apart from the entry
(`Pattern.clamps`) and applied after it, in request order (model/edits.py's clamp table).

Order at one (layer, site): the `project_out` item first (at most one per site), then `set`, `scale` and `add`
in the order given. Those three are per-dimension affine maps, x -> x * keep + put, so any run of them composes
into one (`Entry`): what every execution path applies (model/edits.py), one entry per row and site.

Positions: "all", "prompt" (p < P, the prompt's length), "generated" (p >= P), or explicit token indices. They
resolve per token, from its position alone, so a row's edits never depend on which step computes it (chunked
prefill, preemption and recompute, batching). The prefix cache keys a block by the edits that touched its
positions (`block_digest`): a block computed under one intervention is never served to a request under another.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

# A block's sites in the order it computes them; site k = SITES_PER_BLOCK * layer + SITE_INDEX[site] in every table
# (model/edits.py) and in the native step, whose numbering (csrc/ops.h's `Site`) must stay this one.
SITES = ("attention_output", "resid_mid", "mlp_normalized", "mlp_input", "mlp_output", "block_output")
SITE_INDEX = {s: i for i, s in enumerate(SITES)}
SITES_PER_BLOCK = len(SITES)
READ_ONLY_SITES = ("mlp_normalized",)  # computed for the rows that read it, edited nowhere
EDIT_SITES = tuple(s for s in SITES if s not in READ_ONLY_SITES)
HEAD_SITES = ("head_q", "head_k", "head_v", "head_output")
HEAD_SITE_INDEX = {s: i for i, s in enumerate(HEAD_SITES)}


@dataclass(frozen=True)
class HeadShape:
    """The attention heads a head site indexes: query heads (head_q, head_output) or KV heads (head_k, head_v)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> "HeadShape":  # a ModelConfig
        return cls(config.n_heads, config.n_kv_heads, config.head_dim)

    def count(self, site: str) -> int:
        return self.n_kv_heads if site in ("head_k", "head_v") else self.n_heads
OPS = ("add", "set", "scale", "project_out", "clamp")
POSITION_SETS = ("all", "prompt", "generated")
MAX_POSITIONS = 4096  # explicit positions per item


@dataclass(frozen=True, eq=False)
class Intervention:
    """One edit of block `layer`'s `site` (see the module docstring); `vector` is (D,) float32, or (E,) at a head
    site, where `head` says which."""

    layer: int
    site: str = "block_output"
    op: str = "add"
    positions: str | tuple[int, ...] = "all"
    vector: Tensor | None = None  # add: the direction (times scale); project_out: the direction to remove
    scale: float = 1.0
    dims: tuple[int, ...] = ()
    values: tuple[float, ...] = ()  # set: one per dim
    factor: float = 1.0  # scale
    head: int | None = None  # at a head site: the query head (head_q, head_output) or KV head (head_k, head_v)
    clamp: object = None  # clamp: a FeatureClamp (model/features/sae/steer.py): validate, digest, apply

    def validate(self, n_layers: int, dim: int, where: str = "intervention", heads: HeadShape | None = None) -> None:
        """ValueError naming the field (`where.field`) for anything this model cannot take. A head site needs the
        model's `heads`; its vectors are E wide."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{where}.{name}: {why}")

        if not isinstance(self.layer, int) or not 0 <= self.layer < n_layers:
            raise bad("layer", f"{self.layer!r} is out of range [0, {n_layers})")
        if self.site in HEAD_SITES:
            if heads is None:
                raise bad("site", f"{self.site!r} edits one attention head, which this path cannot")
            if heads.head_dim > dim:  # (vectors of every site share one bank of D-wide rows, model/edits.py)
                raise bad("site", f"head sites need head_dim <= dim ({heads.head_dim} > {dim})")
            n = heads.count(self.site)
            if not isinstance(self.head, int) or not 0 <= self.head < n:
                raise bad("head", f"{self.head!r} is out of range [0, {n}) for {self.site}")
            dim = heads.head_dim
        elif self.site in READ_ONLY_SITES:
            raise bad("site", f"{self.site!r} is read, not edited (edit resid_mid or mlp_input instead)")
        elif self.site not in SITES:
            raise bad("site", f"unknown {self.site!r}; choose from {list(EDIT_SITES + HEAD_SITES)}")
        elif self.head is not None:
            raise bad("head", f"only the head sites {list(HEAD_SITES)} take a head")
        if self.op not in OPS:
            raise bad("op", f"unknown {self.op!r}; choose from {list(OPS)}")
        if isinstance(self.positions, str):
            if self.positions not in POSITION_SETS:
                raise bad("positions", f"unknown {self.positions!r}; choose from {list(POSITION_SETS)} or give indices")
        else:
            if not self.positions or len(self.positions) > MAX_POSITIONS:
                raise bad("positions", f"give 1 to {MAX_POSITIONS} token indices")
            if any(not isinstance(p, int) or p < 0 for p in self.positions):
                raise bad("positions", "token indices must be integers >= 0")
        if self.op in ("add", "project_out"):
            v = self.vector
            if v is None:
                raise bad("vector", f"{self.op} needs a vector")
            if v.dim() != 1 or v.shape[0] != dim:
                raise bad("vector", f"has {v.numel()} values; the model's width is {dim}")
            if not bool(torch.isfinite(v).all()):
                raise bad("vector", "must be finite (no NaN or infinity)")
            if self.op == "project_out" and float(v.double().norm()) == 0.0:
                raise bad("vector", "project_out needs a non-zero direction")
            if not math.isfinite(self.scale):
                raise bad("scale", "must be finite")
        if self.op == "clamp":
            if self.clamp is None:
                raise bad("feature", "clamp needs a dictionary's feature")
            if self.head is not None:
                raise bad("site", "clamp acts on a residual site, not one head")
            if self.clamp.width != dim:
                raise bad("feature", f"the dictionary reads {self.clamp.width} values; the model's width is {dim}")
            self.clamp.validate(where)
        elif self.clamp is not None:
            raise bad("feature", f"only op 'clamp' takes a feature clamp, not {self.op!r}")
        if self.op in ("set", "scale"):
            if not self.dims:
                raise bad("dims", f"{self.op} needs the dimensions it changes")
            if any(not isinstance(d, int) or not 0 <= d < dim for d in self.dims):
                raise bad("dims", f"dimensions must be in [0, {dim})")
            if len(set(self.dims)) != len(self.dims):
                raise bad("dims", "must not repeat a dimension")
        if self.op == "set":
            if len(self.values) != len(self.dims):
                raise bad("values", f"give one value per dim ({len(self.dims)}), got {len(self.values)}")
            if not all(math.isfinite(v) for v in self.values):
                raise bad("values", "must be finite (no NaN or infinity)")
        if self.op == "scale" and not math.isfinite(self.factor):
            raise bad("factor", "must be finite")

    def applies(self, position: int, num_prompt_tokens: int) -> bool:
        p = self.positions
        if p == "all":
            return True
        if p == "prompt":
            return position < num_prompt_tokens
        if p == "generated":
            return position >= num_prompt_tokens
        return position in p

    def positions_in(self, start: int, end: int, num_prompt_tokens: int) -> tuple[int, int] | tuple[int, ...]:
        """The positions of [start, end) this item applies to: a (lo, hi) range, or a tuple of indices."""
        p = self.positions
        if p == "all":
            return (start, end)
        if p == "prompt":
            return (start, max(start, min(end, num_prompt_tokens)))
        if p == "generated":
            return (max(start, num_prompt_tokens), max(start, end)) if end > num_prompt_tokens else (start, start)
        return tuple(q for q in sorted(p) if start <= q < end)

    def digest(self) -> bytes:
        """What the item does, as bytes (its positions aside: `InterventionPlan.block_digest` adds those)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{self.layer}|{self.site}|{self.head}|{self.op}|{self.scale!r}|{self.factor!r}|{self.dims}|{self.values}"
                 .encode())
        if self.vector is not None and self.op in ("add", "project_out"):
            h.update(self.vector.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
        if self.op == "clamp":  # the dictionary's content, the feature and the value
            h.update(self.clamp.digest())
        return h.digest()


def validate_all(items: list[Intervention], n_layers: int, dim: int, names: list[str] | None = None,
                 heads: HeadShape | None = None) -> None:
    """Every item, and the one rule across items: at most one project_out per (layer, site, head). ValueError naming
    the item's field (`names[i]`, default "interventions[i]")."""
    seen: set[tuple[int, str, int | None]] = set()
    for i, it in enumerate(items):
        where = names[i] if names is not None else f"interventions[{i}]"
        it.validate(n_layers, dim, where, heads)
        if it.op == "project_out":
            if (it.layer, it.site, it.head) in seen:
                raise ValueError(f"{where}.op: one project_out per block and site (combine the directions, or use "
                                 "another site)")
            seen.add((it.layer, it.site, it.head))


@dataclass
class Entry:
    """What one row gets at one (layer, site): x -= (x . u) u, then x = x * keep + put (each part optional)."""

    u: Tensor | None = None  # (D,) float32, unit norm
    keep: Tensor | None = None  # (D,) float32
    put: Tensor | None = None  # (D,) float32


def compose(items: list[Intervention], dim: int) -> Entry:
    """The entry of `items` (all at one (layer, site), in request order): project_out first, then the affine
    items composed in order (in float64, rounded once to float32)."""
    entry = Entry()
    keep: np.ndarray | None = None
    put: np.ndarray | None = None
    for it in items:
        if it.op == "project_out":
            u = it.vector.detach().double().cpu()
            entry.u = (u / u.norm()).float()
        elif it.op == "add":
            v = it.scale * it.vector.detach().double().cpu().numpy()
            put = v if put is None else put + v
        else:
            if keep is None:
                keep = np.ones(dim)
            if put is None:
                put = np.zeros(dim)
            d = np.asarray(it.dims, dtype=np.int64)
            if it.op == "set":
                keep[d] = 0.0
                put[d] = np.asarray(it.values, dtype=np.float64)
            else:
                keep[d] *= it.factor
                put[d] *= it.factor
    # an identity part is left out (scale 0 is then no edit at all, bitwise; x + 0 would turn -0.0 into +0.0)
    entry.keep = None if keep is None or (keep == 1.0).all() else torch.from_numpy(keep).float()
    entry.put = None if put is None or not put.any() else torch.from_numpy(put).float()
    return entry


@dataclass
class Pattern:
    """The edits one token gets, as op templates sorted by site (k = SITES_PER_BLOCK layer + site): vector indices into the
    plan's `vectors` (-1: absent); and its edits of single heads, `heads` (S_h, 5): [k_h = 4 layer + head site,
    head, u, keep, put]."""

    sites: np.ndarray  # (S,) int64
    u: np.ndarray  # (S,) int64
    keep: np.ndarray  # (S,) int64
    put: np.ndarray  # (S,) int64
    heads: np.ndarray = field(default_factory=lambda: np.zeros((0, 5), dtype=np.int64))  # (S_h, 5) int64
    # feature clamps after the entry, (S_c, 2) [k, index into the plan's `clamps`], by site, in request order
    clamps: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))
    # (bank offset, (S, 5) op rows) as model/edits.py last laid them out: decode steps reuse them
    template: tuple[int, np.ndarray] | None = field(default=None, repr=False)

    @property
    def empty(self) -> bool:
        return self.sites.size == 0 and self.heads.shape[0] == 0 and self.clamps.shape[0] == 0


class InterventionPlan:
    """One sequence's interventions (its prompt's length P fixed), compiled: the few distinct `Pattern`s its
    tokens can get (prompt, generated, and each explicit position), the vectors they read (`vectors`) and the
    feature clamps (`clamps`, the items' FeatureClamps, which patterns name by index)."""

    def __init__(self, items: list[Intervention], num_prompt_tokens: int, n_layers: int, dim: int,
                 heads: HeadShape | None = None) -> None:
        """`heads`: the model's, where items may edit single heads (their E-wide vectors are zero-padded to D in
        `vectors`, whose rows every site shares)."""
        validate_all(items, n_layers, dim, heads=heads)
        self.items, self.num_prompt_tokens, self.n_layers, self.dim = list(items), num_prompt_tokens, n_layers, dim
        self.digests = [it.digest() for it in self.items]
        self.explicit = sorted({p for it in self.items if not isinstance(it.positions, str) for p in it.positions})
        self._explicit_set = set(self.explicit)
        self.clamps = [it.clamp for it in self.items if it.op == "clamp"]
        clamp_index = {i: j for j, i in enumerate(i for i, it in enumerate(self.items) if it.op == "clamp")}
        vectors: list[Tensor] = []
        by_subset: dict[tuple[int, ...], tuple[int, int, int]] = {}  # item ids at one site -> vector indices

        def index(t: Tensor | None) -> int:
            if t is None:
                return -1
            vectors.append(t if t.shape[0] == dim else torch.nn.functional.pad(t, (0, dim - t.shape[0])))
            return len(vectors) - 1

        def key(it: Intervention) -> tuple[int, ...]:  # residual sites (k,), head sites (k_h, head)
            if it.head is None:
                return (SITES_PER_BLOCK * it.layer + SITE_INDEX[it.site],)
            return (4 * it.layer + HEAD_SITE_INDEX[it.site], it.head)

        def compile_at(position: int) -> Pattern:
            by_site: dict[tuple[int, ...], list[int]] = {}
            for i, it in enumerate(self.items):
                if it.applies(position, num_prompt_tokens):
                    by_site.setdefault(key(it), []).append(i)
            rows, head_rows, clamp_rows = [], [], []
            for k in sorted(by_site):
                clamp_rows += [(k[0], clamp_index[i]) for i in by_site[k] if i in clamp_index]
                ids = tuple(sorted((i for i in by_site[k] if i not in clamp_index),
                                   key=lambda i: self.items[i].op != "project_out"))
                if not ids:
                    continue
                if ids not in by_subset:
                    e = compose([self.items[i] for i in ids], dim if len(k) == 1 else heads.head_dim)
                    by_subset[ids] = (index(e.u), index(e.keep), index(e.put))
                if by_subset[ids] != (-1, -1, -1):  # an entry that changes nothing is not an op
                    (rows if len(k) == 1 else head_rows).append((*k, *by_subset[ids]))
            a = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
            return Pattern(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), a[:, 3].copy(),
                           np.asarray(head_rows, dtype=np.int64).reshape(-1, 5),
                           np.asarray(clamp_rows, dtype=np.int64).reshape(-1, 2))

        # each clamp's table entry: its vectors' indices (w, d, b_dec or -1) and parameters (model/features/sae/steer.py)
        self.clamp_rows: list[tuple[int, int, int]] = []
        self.clamp_params: list[list[float]] = []
        for c in self.clamps:
            vs, params = c.table_entry()
            self.clamp_rows.append((index(vs[0]), index(vs[1]), index(vs[2]) if len(vs) > 2 else -1))
            self.clamp_params.append(params)
        self.patterns: dict[object, Pattern] = {}
        # stand-ins for the positions no explicit index names: any prompt position gets what -1 gets (< P, not
        # explicit), any generated one what a position past every sequence gets
        self.patterns["prompt"] = compile_at(-1)
        self.patterns["generated"] = compile_at(1 << 62)
        for p in self.explicit:
            self.patterns[p] = compile_at(p)
        self.vectors = torch.stack(vectors) if vectors else torch.zeros(0, dim)  # (V, D) float32

    def pattern_key(self, position: int) -> object:
        if position in self._explicit_set:
            return position
        return "prompt" if position < self.num_prompt_tokens else "generated"

    def runs(self, start: int, n: int) -> list[tuple[int, int, Pattern]]:
        """Positions [start, start + n) as runs (offset, length, pattern) of equal patterns, empty ones left out."""
        out: list[tuple[int, int, Pattern]] = []
        key, run_start = None, 0
        for i in range(n + 1):
            k = self.pattern_key(start + i) if i < n else object()
            if k != key:
                if key is not None and not self.patterns[key].empty:
                    out.append((run_start, i - run_start, self.patterns[key]))
                key, run_start = k, i
        return out

    def block_digest(self, start: int, end: int) -> bytes | None:
        """The edits that touch positions [start, end), as bytes for the prefix cache's block hash; None when none
        does (then the block hashes as it would without interventions: a request whose edits start later shares
        the blocks before them)."""
        h = None
        for it, d in zip(self.items, self.digests):
            where = it.positions_in(start, end, self.num_prompt_tokens)
            if (len(where) == 2 and isinstance(it.positions, str) and where[0] >= where[1]) or not where:
                continue
            if h is None:
                h = hashlib.blake2b(digest_size=16)
            h.update(d + b"".join(struct.pack("<q", q) for q in where) + (b"r" if isinstance(it.positions, str) else b"x"))
        return None if h is None else h.digest()


@dataclass
class HiddenStateRead:
    """Which block outputs (residual stream) to return for a sequence, and at which positions: "last" (each
    generated token's own position p, the row its logits came from), "all" (every position the sequence
    computes), or explicit indices. `sites` (default: the block output alone) may name any of a block's SITES (after
    any edit there; a sub-block's output before its residual add): what an activation-patching sweep copies
    (model/probes/patching.py). The values come back (positions, layers x sites, D), layer-major: column j is layer
    layers[j // S], site sites[j % S]."""

    layers: list[int]
    positions: str | tuple[int, ...] = "last"
    sites: tuple[str, ...] = ("block_output",)
    _explicit: frozenset[int] = field(default=frozenset(), repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.positions, str):
            self._explicit = frozenset(self.positions)

    def validate(self, n_layers: int, where: str = "return_hidden_states") -> None:
        if not self.layers:
            raise ValueError(f"{where}.layers: give at least one block index")
        if any(not isinstance(l, int) or not 0 <= l < n_layers for l in self.layers):
            raise ValueError(f"{where}.layers: block indices must be in [0, {n_layers})")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"{where}.layers: must not repeat a block")
        if not self.sites or any(s not in SITES for s in self.sites) or len(set(self.sites)) != len(self.sites):
            raise ValueError(f"{where}.sites: one or more distinct sites of {list(SITES)}")
        if isinstance(self.positions, str):
            if self.positions not in ("last", "all"):
                raise ValueError(f"{where}.positions: 'last', 'all' or a list of token indices")
        elif not self.positions or any(not isinstance(p, int) or p < 0 for p in self.positions):
            raise ValueError(f"{where}.positions: token indices must be integers >= 0")

    def wants(self, position: int, num_prompt_tokens: int) -> bool:
        if self.positions == "all":
            return True
        if self.positions == "last":
            return position >= num_prompt_tokens - 1
        return position in self._explicit

    def first_prompt_position(self, num_prompt_tokens: int, read_from: int = 0) -> int | None:
        """The first position in [read_from, P - 1) this read still needs (the prefix cache must not skip it), or
        None. (P - 1, the last prompt position, is always computed.)"""
        end = num_prompt_tokens - 1
        if self.positions == "all":
            return read_from if read_from < end else None
        if self.positions == "last":
            return None
        early = [p for p in self._explicit if read_from <= p < end]
        return min(early) if early else None
