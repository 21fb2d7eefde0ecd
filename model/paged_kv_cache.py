"""The engine's KV cache: a pool of fixed-size blocks per layer, and attention over a ragged batch through it.

Memory follows the tokens held: a sequence of L tokens owns ceil(L / block_size) blocks, listed in its block
table (PagedAttention, Kwon et al. 2023). One engine step packs every scheduled sequence's new tokens into one
row (B = 1, T = N total tokens) so the linear layers run once over all of them; only attention splits by sequence:

- rows with one new token (decode) attend together: their blocks are gathered into a (Bd, S_max) view and
  masked by context length, one SDPA call per layer;
- rows with several new tokens (prefill chunks) attend one by one: causal SDPA over their own fresh K/V when
  nothing precedes them, else over their gathered blocks with a causal mask offset by the cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model.attention import sdpa


@dataclass
class SeqSlice:
    """One sequence's part of a step: tokens [start, start + num_new) of the packed row."""

    start: int
    num_new: int
    context_len: int  # tokens in the cache after this step (cached prefix + num_new)
    block_ids: list[int]


@dataclass
class _Prefill:
    start: int
    end: int
    context_len: int
    blocks: Tensor | None  # (num_blocks,) or None when the chunk has no cached prefix
    mask: Tensor | None  # (1, 1, n, context_len)


class PagedKVCache:
    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (n_layers, num_blocks, block_size, n_kv_heads, head_dim)  # (L, NB, bs, K, E)
        # Zero-filled, not empty: padded gathers read unused slots, and garbage NaNs would survive the -inf mask.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device = torch.device(device)
        self._num_tokens = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_blocks: int, block_size: int) -> "PagedKVCache":
        c = model.config
        return cls(c.n_layers, num_blocks, block_size, c.n_kv_heads, c.head_dim, model.dtype, model.device)

    @staticmethod
    def bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
        """K and V of `block_size` tokens over all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.n_layers * block_size * config.n_kv_heads * config.head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def set_step(self, seqs: list[SeqSlice]) -> None:
        """Build this step's attention metadata once; every layer's `attend` reuses it."""
        bs, dev = self.block_size, self.device
        slots: list[int] = []
        for s in seqs:
            first = s.context_len - s.num_new
            slots.extend(s.block_ids[p // bs] * bs + p % bs for p in range(first, s.context_len))
        self._num_tokens = len(slots)
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)  # (N,)

        decode = [s for s in seqs if s.num_new == 1]
        self.all_decode = len(decode) == len(seqs)  # then row i of the packed batch is decode row i
        self.decode_idx = None
        if decode:
            width = max(len(s.block_ids) for s in decode)
            tables = [s.block_ids + [0] * (width - len(s.block_ids)) for s in decode]
            self.decode_idx = torch.tensor([s.start for s in decode], dtype=torch.long, device=dev)  # (Bd,)
            self.decode_tables = torch.tensor(tables, dtype=torch.long, device=dev)  # (Bd, max_blocks)
            lens = torch.tensor([s.context_len for s in decode], device=dev)
            self.decode_mask = (torch.arange(width * bs, device=dev) < lens.unsqueeze(1))[:, None, None, :]  # (Bd, 1, 1, S)
        self.prefills: list[_Prefill] = []
        for s in seqs:
            if s.num_new == 1:
                continue
            prefix = s.context_len - s.num_new
            if prefix == 0:
                self.prefills.append(_Prefill(s.start, s.start + s.num_new, s.context_len, None, None))
                continue
            n_blocks = -(-s.context_len // bs)
            blocks = torch.tensor(s.block_ids[:n_blocks], dtype=torch.long, device=dev)
            q_pos = torch.arange(prefix, s.context_len, device=dev)
            mask = (torch.arange(s.context_len, device=dev) <= q_pos.unsqueeze(1))[None, None]  # (1, 1, n, ctx)
            self.prefills.append(_Prefill(s.start, s.start + s.num_new, s.context_len, blocks, mask))

    def begin_forward(self, positions: Tensor) -> None:
        if positions.shape != (1, self._num_tokens):
            raise ValueError(f"paged forward expects positions (1, {self._num_tokens}) as set_step said, got {tuple(positions.shape)}")

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (1, N, H, E), k/v (1, N, K, E) -> (1, N, H, E); writes k/v into their slots first."""
        K, E = k.shape[2], k.shape[3]
        k_pool, v_pool = self.k[layer], self.v[layer]  # (NB, bs, K, E)
        k_pool.view(-1, K, E)[self.slot_mapping] = k[0]
        v_pool.view(-1, K, E)[self.slot_mapping] = v[0]
        if self.decode_idx is not None:
            Bd = self.decode_idx.shape[0]
            kd = k_pool[self.decode_tables].view(Bd, -1, K, E)  # (Bd, S, K, E)
            vd = v_pool[self.decode_tables].view(Bd, -1, K, E)
            if self.all_decode:  # pure decode step: no scatter in or out of the packed row
                return sdpa(q[0].unsqueeze(1), kd, vd, self.decode_mask).transpose(0, 1)  # (1, N, H, E)
            out = torch.empty_like(q)
            qd = q[0, self.decode_idx].unsqueeze(1)  # (Bd, 1, H, E)
            out[0, self.decode_idx] = sdpa(qd, kd, vd, self.decode_mask).squeeze(1)
        else:
            out = torch.empty_like(q)
        for p in self.prefills:
            qp = q[:, p.start : p.end]  # (1, n, H, E)
            if p.blocks is None:
                out[:, p.start : p.end] = sdpa(qp, k[:, p.start : p.end], v[:, p.start : p.end], is_causal=True)
            else:
                kp = k_pool[p.blocks].view(1, -1, K, E)[:, : p.context_len]  # (1, ctx, K, E)
                vp = v_pool[p.blocks].view(1, -1, K, E)[:, : p.context_len]
                out[:, p.start : p.end] = sdpa(qp, kp, vp, p.mask)
        return out
