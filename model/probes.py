"""Inspection: one capture forward over the serving weights that reports attention maps and sinks, massive
activations, residual norms and the logit lens. The serving path never runs this code.

Definitions (each is what the request's thresholds and options refer to):
    Massive activation  Sun, Chen, Kolter, Liu, "Massive Activations in Large Language Models" (COLM 2024): an entry
                        of a block's output hidden state (the residual stream after both residual adds, before the
                        final norm) with |x| > `massive_threshold` (100) and |x| >= `massive_ratio` (1000) x the
                        median |x| of that block's whole hidden state (all tokens x all dims), as the paper's
                        `locuslab/massive-activations` code measures it (torch.median of the magnitudes). Signs kept.
    Attention sink      Xiao, Tian, Chen, Han, Lewis, "Efficient Streaming Language Models with Attention Sinks"
                        (ICLR 2024): attention mass the queries put on the first token. Query 0 is left out of it
                        and of every per-head mean here (entropy, mass received): it can only attend to itself.
    Logit lens          nostalgebraist, "interpreting GPT: the logit lens" (2020): output(final_norm(h_l)) for the
                        block outputs h_l, read as a next-token distribution.

Notation as in transformer.py: T tokens, D width, H query heads, K KV heads, E head_dim, V vocabulary; Hs selected
heads, L selected layers.

Cost is bounded: attention probabilities are computed in blocks of query rows and reduced (sums, tiles, top-k,
chosen rows) at once, so no layers x heads x T x T tensor is ever held unless `full` maps were asked for (which the
service refuses beyond its byte budget, see `estimate_map_elements`). A `ProbeRun` advances one block per `step()`,
so the engine thread can interleave serving steps with an inspection.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from model.attention import sdpa
from model.transformer import Transformer

AttentionMode = Literal["none", "full", "rows", "topk", "pooled"]
INCLUDES = frozenset({"massive", "norms", "attention", "logit_lens"})


@dataclass
class ProbeOptions:
    layers: list[int] | None = None  # 0-indexed blocks to report; None = all
    heads: list[int] | None = None  # 0-indexed query heads to report; None = all
    include: frozenset[str] = INCLUDES
    massive_threshold: float = 100.0
    massive_ratio: float = 1000.0
    massive_top_k: int = 3  # largest magnitudes listed per layer, flagged or not (the paper's layer-wise figure)
    massive_max_entries: int = 64  # flagged entries listed per layer (the count is always exact)
    mode: AttentionMode = "none"
    rows: list[int] | None = None  # query positions for mode "rows"
    attention_top_k: int = 8  # keys per query row for mode "topk"
    pool_size: int = 16  # tile side for mode "pooled"
    pool_reduce: Literal["mean", "max"] = "mean"
    lens_top_k: int = 5
    lens_positions: list[int] | None = None  # None = the last token
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


class ProbeAttention:
    """Attention context (model.attention.AttentionContext) that serves the output through the same SDPA call as
    the serving path and, for the probed layers, recomputes softmax(q k^T / sqrt(E)) in blocks of query rows and
    reduces it as `opts` asks. A test checks the reported weights against the output: A @ V == SDPA's output.

    A block may be run in chunks of query rows (`ProbeRun` does, so an inspection of a long prompt never holds the
    engine thread for a whole block): set `num_tokens` to the sequence's T and `row_offset` to each call's first
    row; the keys and values of the rows so far are kept for the block in progress, and a layer's statistics are
    complete (in `stats`) after the call that ends at row T."""

    def __init__(self, opts: ProbeOptions, n_heads: int, n_kv_heads: int, stat_layers: set[int], map_layers: set[int]) -> None:
        self.opts = opts
        self.heads = opts.selected_heads(n_heads)
        group = n_heads // n_kv_heads
        self.kv_groups = [h // group for h in self.heads]
        self.stat_layers, self.map_layers = stat_layers, map_layers
        self.stats: dict[int, tuple[Tensor, Tensor, AttentionMaps | None]] = {}  # layer -> received, entropy, maps
        self.num_tokens: int | None = None  # T; None: every call is a whole sequence
        self.row_offset = 0  # first query row of the next call
        self._kv: tuple[Tensor, Tensor] | None = None  # (T, K, E) each: the block in progress's keys and values
        self._acc: tuple[Tensor, Tensor, AttentionMaps | None] | None = None  # its running sums and maps

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q (1, R, H, E), k/v (1, R, K, E): query rows r0 .. r0 + R - 1 of a T-token sequence -> (1, R, H, E)
        r0, R = self.row_offset, q.shape[1]
        T, r1 = self.num_tokens or R, self.row_offset + R
        if r0 == 0 and r1 == T:  # the whole block in one call
            keys, values, mask = k[0], v[0], None
        else:
            if r0 == 0:
                self._kv = (k.new_empty((T,) + k.shape[2:]), v.new_empty((T,) + v.shape[2:]))
            kb, vb = self._kv
            kb[r0:r1], vb[r0:r1] = k[0], v[0]
            keys, values = kb[:r1], vb[:r1]  # (r1, K, E)
            # causal with an offset: query row r0 + i sees keys 0 .. r0 + i
            mask = (torch.arange(r1, device=q.device) <= torch.arange(r0, r1, device=q.device).unsqueeze(1))[None, None]
        out = sdpa(q, keys[None], values[None], mask, is_causal=mask is None)
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
        scale = 1.0 / math.sqrt(E)
        b = opts.pool_size
        step = max(b, opts.row_block // b * b) if opts.mode == "pooled" else opts.row_block  # whole tiles per block
        for a0 in range(r0, r0 + R, step):
            a1 = min(r0 + R, a0 + step)
            # causal: rows a0..a1-1 see keys 0..a1-1 only
            scores = torch.einsum("hqe,hke->hqk", qh[:, a0 - r0 : a1 - r0], kh[:, :a1]) * scale  # (Hs, A, a1)
            rows = torch.arange(a0, a1, device=q.device).unsqueeze(1)
            scores.masked_fill_(torch.arange(a1, device=q.device).unsqueeze(0) > rows, float("-inf"))
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


@dataclass
class BlockActivations:
    max_abs: float
    median_abs: float
    top: list[ActivationEntry]
    massive: list[ActivationEntry]
    num_massive: int
    flagged: Tensor  # (N, 2) (token, dim) of every flagged entry


def massive_activations(h: Tensor, opts: ProbeOptions) -> BlockActivations:
    """h (T, D): one block's output."""
    mag = h.float().abs()  # (T, D)
    D = mag.shape[1]
    median = mag.median().item()  # over all tokens x dims, as in the paper's code (torch.median: the lower middle)
    flag = (mag > opts.massive_threshold) & (mag >= opts.massive_ratio * median)  # (T, D)

    def entries(flat_idx: Tensor) -> list[ActivationEntry]:
        out = []
        for i in flat_idx.tolist():
            t, d = divmod(i, D)
            value = h[t, d].item()
            out.append(ActivationEntry(t, d, value, abs(value) / median if median > 0 else None, bool(flag[t, d])))
        return out

    flat = mag.flatten()
    top = flat.topk(min(opts.massive_top_k, flat.numel())).indices
    flagged = flag.flatten().nonzero().squeeze(1)
    listed = flagged[flat[flagged].topk(min(opts.massive_max_entries, flagged.numel())).indices]  # largest first
    return BlockActivations(mag.max().item(), median, entries(top), entries(listed), flagged.numel(),
                            flag.nonzero().cpu())


class ProbeRun:
    """One inspection of one sequence, advanced in bounded steps: `step(budget)` returns True when done.

    The forward is the serving one (same modules, RoPE, SDPA) over the whole sequence without a KV cache, in
    inference mode; the per-layer reductions run on each block's output as it is produced. Massive activations
    and per-head sink mass are measured in every block (they feed the summary); everything else only in the
    selected layers.

    A block runs in chunks of query rows (chunked prefill within one block: each chunk attends over the keys of
    the rows before it), sized from the measured cost per row so that one `step(budget_s)` does about
    `budget_s` of work: the engine thread interleaves serving steps with an inspection of any length and never
    waits for a whole block of it. Models whose blocks run across processes (tensor parallelism) take whole
    blocks (`supports_row_chunks = False`).
    """

    MIN_CHUNK_ROWS = 4

    def __init__(self, model: Transformer, token_ids: list[int], opts: ProbeOptions) -> None:
        c = model.config
        T = len(token_ids)
        if T == 0:
            raise ValueError("nothing to inspect: the sequence is empty")
        opts.validate(c.n_layers, c.n_heads, T)
        self.model, self.opts, self.token_ids = model, opts, list(token_ids)
        self.report = opts.selected_layers(c.n_layers)
        every = set(range(c.n_layers)) if "attention" in opts.include else set()
        self.ctx = ProbeAttention(opts, c.n_heads, c.n_kv_heads, every, set(self.report) if opts.mode != "none" else set())
        self.ctx.num_tokens = T
        self.chunked = getattr(model, "supports_row_chunks", True)
        # chunk boundaries on whole pooling tiles, so each chunk's rows fill whole rows of tiles
        self.row_quantum = opts.pool_size if opts.mode == "pooled" else 1
        self.lens_positions = sorted({p % T for p in (opts.lens_positions or [-1])})
        self.next_layer = -1  # -1: the embeddings come next
        self.next_row = 0  # first row of the next chunk of block `next_layer`
        self.h: Tensor | None = None  # (1, T, D) the input of block `next_layer`
        self.h_out: Tensor | None = None  # (1, T, D) its output, filled chunk by chunk
        self.seconds_per_row: float | None = None  # measured cost of one row of one block
        self.probes: dict[int, LayerProbe] = {}
        self.sink_mass_by_layer: dict[int, float] = {}
        self.massive_layers: list[int] = []
        self.massive_dims: set[int] = set()
        self.massive_tokens: set[int] = set()
        self.done = False
        self.elapsed = 0.0

    @torch.inference_mode()
    def step(self, budget_s: float | None = None) -> bool:
        """Advance by about `budget_s` seconds of work (at least one chunk); None: one whole block."""
        t0 = time.perf_counter()
        while not self.done:
            self._advance(budget_s - (time.perf_counter() - t0) if budget_s is not None else None)
            if budget_s is None or time.perf_counter() - t0 >= budget_s:
                break
        self.elapsed += time.perf_counter() - t0
        return self.done

    def _advance(self, budget_s: float | None) -> None:
        """The embeddings, or one chunk of rows of the next block (a whole block when `budget_s` is None)."""
        m, T = self.model, len(self.token_ids)
        if self.next_layer < 0:
            tokens = torch.tensor([self.token_ids], device=m.device)  # (1, T)
            positions = torch.arange(T, device=m.device).unsqueeze(0)  # (1, T)
            self.cos, self.sin = m.rope(positions)  # (1, T, E)
            self.h = m.tok_embeddings(tokens)  # (1, T, D)
            self.next_layer = 0
            return
        i, r0 = self.next_layer, self.next_row
        r1 = r0 + self._chunk_rows(budget_s, T - r0)
        t0 = time.perf_counter()
        self.ctx.row_offset = r0
        if r0 == 0 and r1 == T:
            self.h_out = m.layers[i](self.h, self.cos, self.sin, self.ctx)  # (1, T, D)
        else:
            if r0 == 0:
                self.h_out = torch.empty_like(self.h)
            self.h_out[:, r0:r1] = m.layers[i](self.h[:, r0:r1], self.cos[:, r0:r1], self.sin[:, r0:r1], self.ctx)
        per_row = (time.perf_counter() - t0) / (r1 - r0)
        self.seconds_per_row = per_row if self.seconds_per_row is None else 0.5 * (self.seconds_per_row + per_row)
        self.next_row = r1
        if r1 < T:
            return
        self.h, self.h_out, self.next_row = self.h_out, None, 0  # (1, T, D): residual stream after block i
        self._reduce_block(i, self.h[0])
        self.next_layer += 1
        if self.next_layer == len(m.layers):
            self._finish()
            self.done = True
            self.h = None

    def _chunk_rows(self, budget_s: float | None, remaining: int) -> int:
        if budget_s is None or not self.chunked:
            return remaining
        if self.seconds_per_row is None:
            rows = self.MIN_CHUNK_ROWS
        else:
            rows = max(self.MIN_CHUNK_ROWS, int(max(budget_s, 0.0) / self.seconds_per_row))
        q = self.row_quantum
        rows = max(q, rows // q * q)
        return remaining if rows >= remaining else rows

    def run(self) -> ProbeResult:
        while not self.step():
            pass
        return self.result()

    def _reduce_block(self, i: int, h: Tensor) -> None:
        """h (T, D): block i's output."""
        opts, T = self.opts, len(self.token_ids)
        acts = massive_activations(h, opts)
        if acts.num_massive:
            self.massive_layers.append(i)
            self.massive_tokens.update(acts.flagged[:, 0].tolist())
            self.massive_dims.update(acts.flagged[:, 1].tolist())
        received, entropy, maps = self.ctx.stats.pop(i, (None, None, None))
        if received is not None and T > 1:
            self.sink_mass_by_layer[i] = received[:, 0].mean().item()
        if i not in self.report:
            return
        probe = LayerProbe(i, acts.max_abs, acts.median_abs, acts.top, acts.massive, acts.num_massive)
        if "norms" in opts.include:
            probe.residual_norm = h.float().norm(dim=-1).cpu()  # (T,)
        if received is not None:
            probe._received, probe.maps = received, maps
            probe.heads = [HeadStats(h_, g, received[j, 0].item() if T > 1 else None, None,
                                     entropy[j].item() if T > 1 else None)
                           for j, (h_, g) in enumerate(zip(self.ctx.heads, self.ctx.kv_groups))]
        if "logit_lens" in opts.include:
            probe.lens = self._lens(h)
        self.probes[i] = probe

    def _lens(self, h: Tensor) -> list[LensEntry]:
        """h (T, D) -> top-k of softmax(output(norm(h))) at the lens positions."""
        m = self.model
        pos = torch.tensor(self.lens_positions, device=h.device)
        probs = m.output(m.norm(h[pos])).float().softmax(-1)  # (P, V)
        top = probs.topk(min(self.opts.lens_top_k, probs.shape[-1]), dim=-1)
        return [LensEntry(p, ids, ps) for p, ids, ps in zip(self.lens_positions, top.indices.tolist(), top.values.tolist())]

    def _finish(self) -> None:
        """Mass on the massive-activation tokens needs all of them known: filled in once the last block ran."""
        if len(self.token_ids) < 2:
            return
        tokens = sorted(self.massive_tokens)
        for probe in self.probes.values():
            if probe.heads is None:
                continue
            mass = probe._received[:, tokens].sum(-1) if tokens else torch.zeros(len(probe.heads))
            for hs, v in zip(probe.heads, mass.tolist()):
                hs.massive_mass = v
            probe._received = None

    def result(self) -> ProbeResult:
        if not self.done:
            raise RuntimeError("the probe has not finished")
        return ProbeResult(
            token_ids=self.token_ids, heads=self.ctx.heads, kv_groups=self.ctx.kv_groups,
            layers=[self.probes[i] for i in self.report], sink_mass_by_layer=self.sink_mass_by_layer,
            massive_layers=self.massive_layers, massive_dims=sorted(self.massive_dims),
            massive_tokens=sorted(self.massive_tokens), compute_ms=self.elapsed * 1e3,
        )


def inspect(model: Transformer, token_ids: list[int], opts: ProbeOptions | None = None) -> ProbeResult:
    """Run a whole inspection at once (the engine thread steps a ProbeRun instead, a block at a time)."""
    return ProbeRun(model, token_ids, opts or ProbeOptions()).run()
