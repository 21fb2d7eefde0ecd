"""`ForwardContext`: one step's forward as every execution path reads it (vLLM's `set_forward_context`, from
vllm/forward_context.py: the per-step attention metadata beside the model call rather than inside the cache).

The runner builds one per step from its input batch: the cache's pools, the step's attention metadata and slices,
its edits of the residual stream (interventions and reads, model/edits.py, or the graphs' static copy of them,
graph_edits.py), and the parts of the per-row features its rows carry (model/features/protocol.py). The module
path hands it to the model as its attention context (model/attention.py: `begin_forward`, `attend`, `edit`,
`adapt`); the native path passes its tensors to the fused call; the CUDA graphs capture a static one; tensor
parallelism sends its slices and edits to the other ranks, which rebuild the same context (`from_slices`). Nothing of
a step is left on the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from model.attention import causal_mask, sdpa
from model.engine.paged_cache import AttentionMetadata, PagedKVCache, PrefillChunk, SeqSlice
from model.kernels import kv_int8, ops

if TYPE_CHECKING:
    from model.features.protocol import StepParts


class Edits(Protocol):
    """A step's edits of the residual stream over its packed rows: `StepEdits` (model/edits.py) or the CUDA graphs'
    static copy (`GraphEdits`)."""

    def apply(self, layer: int, site: str, x: Tensor) -> Tensor: ...


@dataclass
class ForwardContext:
    cache: PagedKVCache
    meta: AttentionMetadata
    slices: list[SeqSlice]  # the step's sequences as plain data (what tensor-parallel ranks rebuild `meta` from)
    edits: Edits | None = None
    parts: StepParts | None = None  # the step's per-row features' parts (model/features/protocol.py)
    _masks: dict[int, Tensor | None] = field(default_factory=dict)  # prefill chunk -> its sliding-window mask

    @classmethod
    def from_slices(cls, cache: PagedKVCache, slices: list[SeqSlice], edits: Edits | None = None,
                    parts: StepParts | None = None) -> "ForwardContext":
        """The context of a step known by its slices alone (tensor-parallel workers, which follow rank 0's steps, and
        tests); the runner writes the same metadata into its persistent buffers instead."""
        meta = AttentionMetadata.from_slices(slices, cache.block_size, cache.device, cache.paged_prefill)
        return cls(cache, meta, slices, edits, parts)

    # ---- the attention context the model's modules call (model/attention.py) ---------------------------------

    def begin_forward(self, positions: Tensor) -> None:
        if positions.shape != (1, self.meta.num_tokens):
            raise ValueError(f"paged forward expects positions (1, {self.meta.num_tokens}) as the step's metadata says, "
                             f"got {tuple(positions.shape)}")

    def edit(self, layer: int, site: str, x: Tensor) -> Tensor:
        """x (1, N, D): each packed row gets its own sequence's edits at (layer, site); rows without any are untouched."""
        return x if self.edits is None else self.edits.apply(layer, site, x)

    def adapt(self, layer: int, site: str, x: Tensor, y: Tensor) -> Tensor:
        """A projection's output y (1, N, out): the rows of a feature's part that changes it (`Part.adapt`) get their
        change; the others are untouched."""
        return y if not self.parts else self.parts.adapt(layer, site, x, y)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (1, N, H, E), k/v (1, N, K, E) -> (1, N, H, E); writes k/v into their slots first. Rows attending over
        their block tables go through the decode kernel (recording into a feature's recorder where a part has one);
        prefill chunks through SDPA over their cached prefix and themselves."""
        meta = self.meta
        k_pool, v_pool = self.cache.k[layer], self.cache.v[layer]  # (NB, bs, K, E), or E + 4 int8 (kv_int8.py)
        window, scale = self.cache.window, self.cache.scale  # the model's (sliding window, attention scale)
        ops.paged_write(k[0], v[0], k_pool, v_pool, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (1, N, H, E)
        rec = self.parts.recorder if self.parts else None
        ops.decode_attention(q[0], k_pool, v_pool, meta.paged_rows, meta.paged_tables, meta.paged_lens, out[0],
                             rec.attention_recorder(layer) if rec is not None else None, window, scale)
        if self.parts:
            for part in self.parts.parts:
                part.after_attention(layer, q, k_pool, v_pool, window, scale)
        if meta.prefill_tiles is not None:  # every chunk in one launch (no window, the default scale: PagedKVCache)
            ops.prefill_attention(q[0], k_pool, v_pool, meta.prefill_tiles, meta.prefill_tables, out[0])
            return out
        for i, p in enumerate(meta.prefills):
            qp, qscale = q[:, p.start : p.end], scale  # (1, n, H, E)
            if k_pool.dtype == torch.int8:  # the queries rounded as the decode kernel rounds them (kv_int8.py)
                qp, qscale = kv_int8.round_query(qp, scale), 1.0
            mask = self._window_mask(i, p) if window else p.mask
            if p.blocks is None:  # (a 16-bit or int8 cache's chunk attends to its keys as the cache holds them)
                kc, vc = (kv_int8.as_stored(x[:, p.start : p.end], k_pool.dtype).to(q.dtype) for x in (k, v))
                out[:, p.start : p.end] = sdpa(qp, kc, vc, mask, is_causal=mask is None, scale=qscale)
            else:
                # (under a window: from the block of the chunk's first row's first key; earlier ones may be freed)
                b0 = max(0, p.context_len - (p.end - p.start) + 1 - window) // self.cache.block_size if window else 0
                ctx = p.context_len - b0 * self.cache.block_size
                kd, vd = (kv_int8.read_blocks(pool, p.blocks[b0:], q.dtype)[None, :ctx]
                          for pool in (k_pool, v_pool))  # (1, ctx, K, E): positions b0 bs ..
                out[:, p.start : p.end] = sdpa(qp, kd, vd, mask, scale=qscale)
        return out

    def _window_mask(self, i: int, p: PrefillChunk) -> Tensor | None:
        """Prefill chunk i's mask under the model's sliding window (once per step, for every layer): its queries at
        positions context_len - n .. context_len - 1 over the keys from the block `attend` gathers from; None where
        the window changes nothing (a chunk of no more than `window` tokens from position 0)."""
        if i not in self._masks:
            window, bs, n = self.cache.window, self.cache.block_size, p.end - p.start
            prefix = p.context_len - n
            if p.blocks is None and n <= window:
                self._masks[i] = None
            else:
                b0 = max(0, prefix + 1 - window) // bs if p.blocks is not None else 0
                dev = self.cache.device
                q_pos = torch.arange(prefix, p.context_len, device=dev)
                self._masks[i] = causal_mask(q_pos, torch.arange(b0 * bs, p.context_len, device=dev), window)[None, None]
        return self._masks[i]
