"""`ProbeAttention`: the attention context an inspection runs the serving modules with. It serves each block's
output through the same SDPA call as serving, and reduces softmax(q k^T / sqrt(E)) in blocks of query rows for the
probed layers (mass each key receives, row entropy, maps in the requested mode), never holding heads x T x T."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from model.attention import causal_mask, sdpa
from model.edits import StepEdits
from model.features.lora import LoRAAdapter
from model.probes.options import AttentionMaps, ProbeOptions

Stats = tuple[Tensor, Tensor, "AttentionMaps | None"]  # mass each key receives (Hs, T), row entropy (Hs,), maps


@dataclass
class RankProbe:
    """What one tensor-parallel rank needs to probe block `layer` over the query heads it owns: sent to every rank
    (model/parallel runs it without knowing what it is: `build` gives the rank's attention context, `result` what
    that context measured, gathered back to rank 0 and merged by `ProbeAttention.merge_ranks`)."""

    opts: ProbeOptions
    layer: int
    stats: bool  # reduce attention in this block
    maps: bool  # and fill maps
    edits: StepEdits | None = None  # the inspection's interventions in this block: every rank applies them to the
    # residual stream, which is the same on every rank after the row-parallel all-reduces

    def build(self, plan, config) -> "ProbeAttention":
        heads = plan.local_heads(self.opts.heads)  # this rank's local indices of the selected heads it owns
        mine = self.stats and heads != []
        return ProbeAttention(dataclasses.replace(self.opts, heads=heads), config.n_heads, config.n_kv_heads,
                              {self.layer} if mine else set(), {self.layer} if mine and self.maps else set(),
                              self.edits, config.sliding_window, config.attention_multiplier)

    def result(self, ctx: "ProbeAttention") -> Stats | None:
        return ctx.stats.pop(self.layer, None)

class ProbeAttention:
    """Attention context (model.attention.AttentionContext) that serves the output through the same SDPA call as
    the serving path and, for the probed layers, recomputes softmax(q k^T / sqrt(E)) in blocks of query rows and
    reduces it as `opts` asks. A test checks the reported weights against the output: A @ V == SDPA's output.

    A block may be run in chunks of query rows (`ProbeRun` does, so an inspection of a long prompt never holds the
    engine thread for a whole block): set `num_tokens` to the sequence's T and `row_offset` to each call's first
    row; the keys and values of the rows so far are kept for the block in progress, and a layer's statistics are
    complete (in `stats`) after the call that ends at row T."""

    def __init__(self, opts: ProbeOptions, n_heads: int, n_kv_heads: int, stat_layers: set[int], map_layers: set[int],
                 edits: StepEdits | None = None, window: int = 0, scale: float = 0.0,
                 adapter: LoRAAdapter | None = None) -> None:
        """`window`, `scale`: the model's sliding window and attention scale (`ModelConfig.sliding_window`,
        `.attention_multiplier`; 0: none, 1/sqrt(E)), which the output and the reported weights both honour.
        `adapter`: the LoRA adapter every row runs under (model/features/lora/adapters.py), or None: the base."""
        self.opts = opts
        self.adapter = adapter
        self.window, self.scale = window, scale
        self.edits = edits  # the inspected sequence's interventions, its rows being its positions
        self.heads = opts.selected_heads(n_heads)
        group = n_heads // n_kv_heads
        self.kv_groups = [h // group for h in self.heads]
        self.stat_layers, self.map_layers = stat_layers, map_layers
        self.stats: dict[int, tuple[Tensor, Tensor, AttentionMaps | None]] = {}  # layer -> received, entropy, maps
        self.num_tokens: int | None = None  # T; None: every call is a whole sequence
        self.row_offset = 0  # first query row of the next call
        self._kv: tuple[Tensor, Tensor] | None = None  # (T, K, E) each: the block in progress's keys and values
        self._acc: tuple[Tensor, Tensor, AttentionMaps | None] | None = None  # its running sums and maps
        # (layer, site) -> a reader of that site's rows, called as (first row, x (R, ...)) after the edits there
        self.taps: dict[tuple[int, str], Callable[[int, Tensor], None]] = {}

    def rank_probe(self, layer: int) -> RankProbe:
        """This context's request for block `layer`, as each tensor-parallel rank runs it."""
        edits = self.edits.restrict(layer) if self.edits is not None and self.edits.has_edits else None
        return RankProbe(self.opts, layer, layer in self.stat_layers, layer in self.map_layers, edits)

    def edit(self, layer: int, site: str, x: Tensor) -> Tensor:
        """x (1, R, D): query rows row_offset .. row_offset + R - 1 of the sequence get its edits at (layer, site);
        a tap there reads the result."""
        if self.edits is not None:
            R = x.shape[1]
            whole = self.row_offset == 0 and R == (self.num_tokens or R)
            x = self.edits.apply(layer, site, x, None if whole else (self.row_offset, R))
        if tap := self.taps.get((layer, site)):
            tap(self.row_offset, x[0])
        return x

    def merge_ranks(self, layer: int, parts: list[Stats | None]) -> None:
        """The ranks' stats for block `layer` (rank order = ascending head ranges) -> this context's, in global head
        order."""
        parts = [p for p in parts if p is not None]
        if layer not in self.stat_layers or not parts:
            return
        received = torch.cat([p[0] for p in parts])  # (Hs, T)
        entropy = torch.cat([p[1] for p in parts])  # (Hs,)
        maps = None
        if parts[0][2] is not None:
            m = parts[0][2]
            maps = AttentionMaps(m.mode, torch.cat([p[2].values for p in parts]),
                                 torch.cat([p[2].indices for p in parts]) if m.indices is not None else None, m.rows)
        self.stats[layer] = (received, entropy, maps)

    def adapt(self, layer: int, site: str, x: Tensor, y: Tensor) -> Tensor:
        """x (1, R, in), y (1, R, out): every row under the inspected sequence's adapter, if any."""
        return y if self.adapter is None else self.adapter.apply(layer, site, x, y)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q (1, R, H, E), k/v (1, R, K, E): query rows r0 .. r0 + R - 1 of a T-token sequence -> (1, R, H, E)
        r0, R = self.row_offset, q.shape[1]
        T, r1 = self.num_tokens or R, self.row_offset + R
        if r0 == 0 and r1 == T:  # the whole block in one call
            keys, values, mask = k[0], v[0], None
            if self.window and T > self.window:
                pos = torch.arange(T, device=q.device)
                mask = causal_mask(pos, pos, self.window)[None, None]
        else:
            if r0 == 0:
                self._kv = (k.new_empty((T,) + k.shape[2:]), v.new_empty((T,) + v.shape[2:]))
            kb, vb = self._kv
            kb[r0:r1], vb[r0:r1] = k[0], v[0]
            keys, values = kb[:r1], vb[:r1]  # (r1, K, E)
            # causal with an offset: query row r0 + i sees keys 0 .. r0 + i (and > r0 + i - window)
            mask = causal_mask(torch.arange(r0, r1, device=q.device), torch.arange(r1, device=q.device),
                               self.window)[None, None]
        out = sdpa(q, keys[None], values[None], mask, is_causal=mask is None, scale=self.scale)
        if layer in self.stat_layers:
            if r0 == 0:
                self._acc = self._start(T, q.device, with_maps=layer in self.map_layers)
            self._reduce(q[0], keys, r0, self._acc)
            if r1 == T:
                received, entropy, maps = self._acc
                denom = max(T - 1, 1)
                self.stats[layer] = ((received / denom).cpu(), (entropy / denom).cpu(), maps)
                self._acc = None
        if r1 == T:
            self._kv = None
        return out

    def _start(self, T: int, device, with_maps: bool) -> tuple[Tensor, Tensor, AttentionMaps | None]:
        Hs = len(self.heads)
        return torch.zeros(Hs, T, device=device), torch.zeros(Hs, device=device), self._new_maps(Hs, T) if with_maps else None

    @torch.no_grad()
    def _reduce(self, q: Tensor, k: Tensor, r0: int, acc: tuple[Tensor, Tensor, AttentionMaps | None]) -> None:
        """q (R, H, E) query rows r0 .. r0 + R - 1, k (r0 + R, K, E) the keys they see: add their sums to `acc`
        (mass each key receives (Hs, T), row entropy (Hs,)) and fill their rows of its maps."""
        opts = self.opts
        R, _, E = q.shape
        received, entropy, maps = acc
        qh = q[:, self.heads].transpose(0, 1).float()  # (Hs, R, E)
        kh = k[:, self.kv_groups].transpose(0, 1).float()  # (Hs, S, E): each selected head's own KV head
        scale = self.scale or 1.0 / math.sqrt(E)
        b = opts.pool_size
        step = max(b, opts.row_block // b * b) if opts.mode == "pooled" else opts.row_block  # whole tiles per block
        for a0 in range(r0, r0 + R, step):
            a1 = min(r0 + R, a0 + step)
            # causal: rows a0..a1-1 see keys 0..a1-1 only (and those within the sliding window)
            scores = torch.einsum("hqe,hke->hqk", qh[:, a0 - r0 : a1 - r0], kh[:, :a1]) * scale  # (Hs, A, a1)
            seen = causal_mask(torch.arange(a0, a1, device=q.device), torch.arange(a1, device=q.device), self.window)
            scores.masked_fill_(~seen, float("-inf"))
            p = scores.softmax(-1)  # (Hs, A, a1)
            counted = p[:, 1:] if a0 == 0 else p
            received[:, :a1] += counted.sum(1)
            entropy -= torch.special.xlogy(counted, counted).sum((1, 2))
            if maps is not None:
                self._fill_maps(maps, p, a0, a1)

    def _new_maps(self, Hs: int, T: int) -> AttentionMaps | None:
        # on the CPU: maps go to the response, and a full map can be large
        o = self.opts
        if o.mode == "full":
            return AttentionMaps("full", torch.zeros(Hs, T, T))
        if o.mode == "rows":
            return AttentionMaps("rows", torch.zeros(Hs, len(o.rows), T), rows=list(o.rows))
        if o.mode == "topk":
            k = min(o.attention_top_k, T)
            return AttentionMaps("topk", torch.zeros(Hs, T, k), torch.zeros(Hs, T, k, dtype=torch.int64))
        if o.mode == "pooled":
            n = math.ceil(T / o.pool_size)
            return AttentionMaps("pooled", torch.zeros(Hs, n, n))
        return None

    def _fill_maps(self, maps: AttentionMaps, p: Tensor, r0: int, r1: int) -> None:
        """p (Hs, R, r1): the probabilities of query rows r0..r1-1 over keys 0..r1-1."""
        p = p.cpu()
        if maps.mode == "full":
            maps.values[:, r0:r1, :r1] = p
        elif maps.mode == "rows":
            for i, r in enumerate(maps.rows):
                if r0 <= r < r1:
                    maps.values[:, i, :r1] = p[:, r - r0]
        elif maps.mode == "topk":
            k = maps.values.shape[-1]
            if p.shape[-1] < k:  # early rows: fewer keys than k; the padding keys are masked (weight 0)
                p = torch.nn.functional.pad(p, (0, k - p.shape[-1]))
            top = p.topk(k, dim=-1)
            maps.values[:, r0:r1], maps.indices[:, r0:r1] = top.values, top.indices
        else:
            b = self.opts.pool_size
            Hs, R, S = p.shape
            nk = math.ceil(S / b)
            pad = torch.nn.functional.pad(p, (0, nk * b - S)).view(Hs, R, nk, b)  # key tiles
            t0, nt = r0 // b, math.ceil(R / b)
            if self.opts.pool_reduce == "mean":
                per_row = pad.sum(-1)  # (Hs, R, nk): each row's mass per key tile
                sums = torch.nn.functional.pad(per_row, (0, 0, 0, nt * b - R)).view(Hs, nt, b, nk).sum(2)
                counts = torch.full((nt,), float(b))
                counts[-1] = R - (nt - 1) * b  # the last query tile may be short
                maps.values[:, t0 : t0 + nt, :nk] = sums / counts.view(1, nt, 1)
            else:
                per_row = pad.amax(-1)
                tiles = torch.nn.functional.pad(per_row, (0, 0, 0, nt * b - R)).view(Hs, nt, b, nk).amax(2)
                maps.values[:, t0 : t0 + nt, :nk] = tiles
