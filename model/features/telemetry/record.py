"""Attention telemetry streamed with every token: for each sampled token, per layer, the attention mass its query
put on the sink tokens (per head), its top-k attended keys, and the massive activations (Sun et al. 2024) in its
residual stream, all read off the forward pass that produced the token.

Where each number comes from:
- attention: the decode kernels record it from the softmax they compute anyway (model/kernels/attention_telemetry.py:
  native, Triton, and the PyTorch reference), for the rows that asked; a sequence's first token comes from a prefill
  chunk: where prefill rows attend over the pool row by row (CPU, `PagedKVCache.paged_prefill`) its last row is a
  decode-kernel row like any other; elsewhere that row is run once more through the decode kernel for its telemetry
  only (its output is discarded, so the SDPA output the model used is untouched);
- the residual stream after each block: the fused native decode call copies the asking rows out after each block
  (step_layers' `telemetry` list); the module path reads them with forward hooks on the blocks, installed for
  the step only.
A step in which no sequence asked runs none of this: no buffers, no hooks, the kernels' plain variants. The CUDA
graphs are captured without telemetry: a step carrying it runs the native or the module path (`paths`).

The query row of a sampled token is the token before it (`position`): what the model looked at when it produced the
token. Its attention row is /inspect's row at that position (a test holds the two equal); the massive-activation
ratio is taken against the median |h| of this token's own hidden state, where /inspect takes the whole sequence's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from torch import Tensor

from model.features.protocol import Part, SequenceView, StepView
from model.kernels import ops
from model.kernels.attention_telemetry import AttentionTelemetry


@dataclass
class TokenTelemetry:
    """One sampled token's telemetry (CPU tensors; L layers, H query heads, k keys, m listed activations)."""

    position: int  # the query row: the token fed in, whose forward produced the sampled token
    sink_tokens: int  # leading keys counted as sinks (1: token 0; a kv_window's sink_tokens)
    sink_mass: Tensor  # (L, H) float32
    top_positions: Tensor  # (L, H, k) int64 token positions, -1 where the context had fewer than k keys
    top_probs: Tensor  # (L, H, k) float32
    max_abs: Tensor  # (L,) largest |h| of the token's hidden state after each block
    median_abs: Tensor  # (L,) median |h| (torch.median, as /inspect and the paper's code)
    top_dims: Tensor  # (L, m) dims of the m largest |h|
    top_values: Tensor  # (L, m) their signed values
    top_massive: Tensor  # (L, m) bool: which of them pass the thresholds
    num_massive: Tensor  # (L,) int64: entries passing the thresholds


@dataclass
class TelemetryRow:
    """A sampled sequence whose token carries telemetry: where its query row is in this step."""

    seq: SequenceView
    packed_row: int  # its query's row in the packed batch
    position: int  # that query's token position
    decode_index: int | None  # its index among the step's decode rows, or None (the last row of a prefill chunk)
    blocks: list[int]  # its block table, for a prefill row
    cache_len: int  # keys its query attends over


class StepTelemetry(Part):
    """One step's telemetry buffers (slots j = 0..Rt-1, one per row in `rows`) and how each path fills them: the
    feature's part of the step (model/features/protocol.py)."""

    paths = frozenset({"native", "module"})  # the CUDA graphs are captured without it

    def __init__(self, rows: list[TelemetryRow], num_decode: int, n_layers: int, n_heads: int, dim: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.rows = rows
        Rt, L, H = len(rows), n_layers, n_heads
        self.k = max(r.seq.request.options.telemetry.top_k for r in rows)
        self.sink_tokens = [_sink_tokens(r.seq) for r in rows]
        slot = [-1] * num_decode
        for j, r in enumerate(rows):
            if r.decode_index is not None:
                slot[r.decode_index] = j
        self.slot = torch.tensor(slot, dtype=torch.long, device=device)  # (R,)
        self.sink_len = torch.tensor(self.sink_tokens, dtype=torch.long, device=device)  # (Rt,)
        self.sink_mass = torch.zeros(L, Rt, H, device=device)
        self.top_pos = torch.full((L, Rt, H, self.k), -1, dtype=torch.long, device=device)
        self.top_prob = torch.zeros(L, Rt, H, self.k, device=device)
        self.hidden = torch.zeros(L, Rt, dim, dtype=dtype, device=device)
        self.packed_rows = torch.tensor([r.packed_row for r in rows], dtype=torch.long, device=device)
        # prefill rows: (packed row, its table (1, nb), its length (1,), its slot (1,)) for one more decode-kernel row
        self.prefill = [(r.packed_row, torch.tensor([r.blocks], dtype=torch.long, device=device),
                         torch.tensor([r.cache_len], dtype=torch.long, device=device),
                         torch.tensor([j], dtype=torch.long, device=device))
                        for j, r in enumerate(rows) if r.decode_index is None]

    def attention_recorder(self, layer: int, slot: Tensor | None = None) -> AttentionTelemetry:
        """What decode_attention records into for `layer` (the step's decode rows, or one row's `slot`)."""
        return AttentionTelemetry(self.slot if slot is None else slot, self.sink_len, self.sink_mass[layer],
                                  self.top_pos[layer], self.top_prob[layer])

    def native_args(self) -> dict[str, list[Tensor]]:
        """step_layers' telemetry list (model/kernels/csrc/step_layers.cpp)."""
        return {"telemetry": [self.slot, self.sink_len, self.sink_mass, self.top_pos, self.top_prob, self.hidden]}

    def after_attention(self, layer: int, q: Tensor, k_pool: Tensor, v_pool: Tensor, window: int = 0,
                        scale: float = 0.0) -> None:
        """q (1, N, H, E) of the step; the prefill rows' K/V are in the pools already. Each asking prefill row's last
        query once more through the decode kernel, its output thrown away, its telemetry kept. `window`, `scale`:
        the model's sliding window and attention scale (`ops.decode_attention`)."""
        zero = torch.zeros(1, dtype=torch.long, device=q.device)
        for row, table, lens, slot in self.prefill:
            qr = q[0, row : row + 1]  # (1, H, E)
            ops.decode_attention(qr, k_pool, v_pool, zero, table, lens, torch.empty_like(qr),
                                 self.attention_recorder(layer, slot),
                                 window, scale)

    @contextlib.contextmanager
    def module_hooks(self, model: torch.nn.Module) -> Iterator[None]:
        """The module path: each block's output rows for the asking rows, read by forward hooks for this step only."""
        def keep(layer: int):
            def hook(_module, _inputs, out: Tensor) -> None:  # out (1, N, D)
                self.hidden[layer] = out[0].index_select(0, self.packed_rows)
            return hook

        handles = [block.register_forward_hook(keep(i)) for i, block in enumerate(model.layers)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def collect(self, outputs: dict) -> None:
        """Each asking sequence's TokenTelemetry per sampled row, in row order (one, or a drafting sequence's
        verification rows), under "telemetry"."""
        for seq, records in self.results().items():
            outputs.setdefault(seq, {})["telemetry"] = records

    def results(self) -> dict[SequenceView, list[TokenTelemetry]]:
        """Each asking sequence's TokenTelemetry per sampled row, in row order, computed for all rows at once (CPU
        tensors)."""
        rows = self.rows
        pos = self.top_pos.cpu()
        if any(r.seq.num_evicted for r in rows):
            # cache positions -> token positions: a windowed sequence's keys past its sinks sit num_evicted lower
            evicted = torch.tensor([r.seq.num_evicted for r in rows]).view(1, -1, 1, 1)
            first = torch.tensor([r.seq.window.sink_tokens if r.seq.window is not None else 0 for r in rows]).view(1, -1, 1, 1)
            pos = torch.where(pos >= first, pos + evicted, pos)  # -1 stays -1
        h = self.hidden.float().cpu()  # (L, Rt, D)
        mag = h.abs()
        # torch.median's lower median (sorted index (D-1)//2) by selection, not a sort: a third of the time, same values
        mid = (mag.shape[-1] - 1) // 2
        median = torch.from_numpy(np.partition(mag.numpy(), mid, axis=-1)[..., mid])  # (L, Rt)
        m = max(r.seq.request.options.telemetry.massive_top_k for r in rows)
        top = mag.topk(min(m, mag.shape[-1]), dim=-1)
        opts = [r.seq.request.options.telemetry for r in rows]
        if len({(o.massive_threshold, o.massive_ratio) for o in opts}) == 1:  # the usual case: one setting, scalars
            thr, ratio = opts[0].massive_threshold, opts[0].massive_ratio
        else:
            thr = torch.tensor([o.massive_threshold for o in opts]).view(1, -1, 1)
            ratio = torch.tensor([o.massive_ratio for o in opts]).view(1, -1, 1)
        flagged = (mag > thr) & (mag >= ratio * median.unsqueeze(-1))  # (L, Rt, D)
        top_flag = flagged.gather(-1, top.indices)
        values = h.gather(-1, top.indices)
        sink, prob = self.sink_mass.cpu(), self.top_prob.cpu()
        out: dict[SequenceView, list[TokenTelemetry]] = {}
        for j, r in enumerate(rows):
            o, k = opts[j], r.seq.request.options.telemetry.top_k
            out.setdefault(r.seq, []).append(TokenTelemetry(
                r.position, self.sink_tokens[j], sink[:, j], pos[:, j, :, :k], prob[:, j, :, :k],
                top.values[:, j, 0], median[:, j], top.indices[:, j, : o.massive_top_k],
                values[:, j, : o.massive_top_k], top_flag[:, j, : o.massive_top_k], flagged[:, j].sum(-1)))
        return out


def _sink_tokens(seq: SequenceView) -> int:
    """Keys counted as sinks: a kv_window's sink tokens, else token 0 (Xiao et al.'s sink, /inspect's sink_mass)."""
    return seq.window.sink_tokens if seq.window is not None else 1


def step_telemetry(step: StepView) -> StepTelemetry | None:
    """The step's telemetry, or None when no sampled sequence asked for it. Each of `step.sample`'s rows of an asking
    sequence gets a record: a sequence's last row, or each of a drafting sequence's verification rows (its chunk's
    last 1 + drafts rows). `step.paged_prefill`: every row of the step is a decode-kernel row, prefill chunks' last
    rows included; otherwise a sampled row of a chunk of several is run once more through the decode kernel
    (after_attention)."""
    paged_prefill = step.paged_prefill
    asking: dict[int, int] = {}  # id(seq) -> its sampled rows
    for seq, _ in step.sample:
        if seq.request.options.telemetry is not None:
            asking[id(seq)] = asking.get(id(seq), 0) + 1
    if not asking:
        return None
    rows, r = [], 0
    for sl in step.rows:
        seq = sl.seq
        for i in range(sl.num_new - asking.get(id(seq), 0), sl.num_new):  # its sampled rows: the chunk's last
            decode_index = r + i if paged_prefill else (r if sl.num_new == 1 else None)
            keys = sl.context_len - (sl.num_new - 1 - i)  # the row attends to the keys up to its own
            rows.append(TelemetryRow(seq, sl.start + i, sl.num_computed + i, decode_index, list(sl.block_ids), keys))
        r += sl.num_new if paged_prefill else sl.num_new == 1
    c = step.model.config
    return StepTelemetry(rows, r, c.n_layers, c.n_heads, c.dim, step.device, step.model.dtype)
