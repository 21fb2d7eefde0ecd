"""The engine's KV cache: a pool of fixed-size blocks per layer, and attention over a ragged batch through it.

Memory follows the tokens held: a sequence of L tokens owns ceil(L / block_size) blocks, listed in its block
table (PagedAttention, Kwon et al. 2023). One engine step packs every scheduled sequence's new tokens into one
row (B = 1, T = N total tokens) so the linear layers run once over all of them; only attention splits by sequence:

- rows with one new token (decode) attend in a few groups of similar context length: each group's blocks are
  gathered into a (Bg, S_g) view, masked by context length, one SDPA call per group and layer (grouping keeps
  the padding of short contexts to the longest small: the gather, not the matmuls, is what costs on CPU);
- rows with several new tokens (prefill chunks) attend one by one: causal SDPA over their own fresh K/V when
  nothing precedes them, else over their gathered blocks with a causal mask offset by the cached prefix.

With the native CPU kernels (model/kernels) the cache write is one call and every decode row attends in one
call straight over its block table (no gather, no padding, no mask); on CUDA, with Triton, decode rows attend
the same way (model/kernels/triton_attention.py). Prefill chunks go through SDPA on every path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model import kernels
from model.attention import sdpa
from model.kernels import triton_attention


@dataclass
class SeqSlice:
    """One sequence's part of a step: tokens [start, start + num_new) of the packed row."""

    start: int
    num_new: int
    context_len: int  # tokens in the cache after this step (cached prefix + num_new)
    block_ids: list[int]


@dataclass
class _DecodeGroup:
    idx: Tensor  # (Bg,) rows of the packed batch
    tables: Tensor  # (Bg * blocks,) block ids, row-major, padded with block 0
    mask: Tensor  # (Bg, 1, 1, blocks * block_size): key slot < context length
    num_rows: int


# A decode group closes when the next (shorter) context would pad to the group's longest by more than this.
GROUP_PAD_RATIO = 0.75


@dataclass
class _Prefill:
    start: int
    end: int
    context_len: int
    blocks: Tensor | None  # (num_blocks,) or None when the chunk has no cached prefix
    mask: Tensor | None  # (1, 1, n, context_len)


def slot_of(block_ids: list[int], position: int, block_size: int) -> int:
    """The pool slot (block * block_size + offset) holding a sequence's token at `position`."""
    return block_ids[position // block_size] * block_size + position % block_size


def padded_tables(seqs: list[SeqSlice], width: int) -> list[list[int]]:
    """Each sequence's block table padded with block 0 (or cut) to `width` (attention stops at the context length,
    so the padding is never read)."""
    return [(s.block_ids + [0] * width)[:width] for s in seqs]


def decode_attention_kernel(q: Tensor, k_pool: Tensor, block_size: int):
    """The kernel that attends decode rows over their block tables in place, for q's device and dtype: the native
    CPU one, or Triton's on CUDA; None where neither applies (the gather + SDPA path then runs). Both take
    (q (N, H, E), k_pool, v_pool, rows (R,), tables (R, W), lens (R,), out (N, H, E))."""
    native = kernels.usable(q)
    if native is not None and q.dtype == k_pool.dtype:
        return native.paged_decode_attention
    if triton_attention.available(q, block_size):
        return triton_attention.paged_decode_attention
    return None


def write_kv(k_pool: Tensor, v_pool: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """Write one step's k, v (N, K, E) into their pool slots (N,) (block * block_size + offset)."""
    native = kernels.usable(k)
    if native is not None and k.dtype == k_pool.dtype:
        native.paged_write(k, v, k_pool, v_pool, slots)
    else:
        K, E = k.shape[-2], k.shape[-1]
        k_pool.view(-1, K, E)[slots] = k
        v_pool.view(-1, K, E)[slots] = v


def kv_config(model):
    """The config whose KV heads a model's cache holds: its own, or a tensor-parallel rank's share of them."""
    return getattr(model, "kv_config", model.config)


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
        self._decode: list[SeqSlice] = []
        self._gather: tuple[list[_DecodeGroup], bool] | None = None
        self.pure_decode = False

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_blocks: int, block_size: int) -> "PagedKVCache":
        c = kv_config(model)
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
        self.step_seqs = seqs  # what tensor-parallel ranks rebuild the same metadata from (model/tp_worker.py)
        bs, dev = self.block_size, self.device
        slots: list[int] = []
        for s in seqs:
            first = s.context_len - s.num_new
            slots.extend(slot_of(s.block_ids, p, bs) for p in range(first, s.context_len))
        self._num_tokens = len(slots)
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)  # (N,)

        decode = [s for s in seqs if s.num_new == 1]
        # Every decode row for the native kernel, in packed order: rows (R,), tables (R, W) padded with block 0
        # (never read: the kernel stops at the context length), context lengths (R,).
        width = max((len(s.block_ids) for s in decode), default=0)
        self.decode_rows = torch.tensor([s.start for s in decode], dtype=torch.long, device=dev)
        self.decode_tables = torch.tensor(padded_tables(decode, width), dtype=torch.long, device=dev).view(len(decode), width)
        self.decode_lens = torch.tensor([s.context_len for s in decode], dtype=torch.long, device=dev)
        self._decode, self._gather = decode, None  # the gather path's groups: built on first use (`_gather_plan`)
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
        self.pure_decode = not self.prefills  # every sequence adds one token: Transformer's native decode path

    def _gather_plan(self) -> tuple[list[_DecodeGroup], bool]:
        """Decode groups of similar context length for the gather + SDPA path, and whether the step is one group
        in packed order (single stream; similar-length batches): attend() then works on views, without gathering
        q by row index or scattering into a fresh output."""
        if self._gather is None:
            decode = sorted(self._decode, key=lambda s: -len(s.block_ids))
            groups: list[_DecodeGroup] = []
            group: list[SeqSlice] = []
            for s in decode + [None]:
                if group and (s is None or len(s.block_ids) < GROUP_PAD_RATIO * len(group[0].block_ids)):
                    groups.append(self._decode_group(group))
                    group = []
                if s is not None:
                    group.append(s)
            decode_only = not self.prefills and len(groups) == 1 and [s.start for s in decode] == list(range(len(decode)))
            self._gather = groups, decode_only
        return self._gather

    def _decode_group(self, group: list[SeqSlice]) -> _DecodeGroup:
        dev, width = self.device, len(group[0].block_ids)
        tables = [b for row in padded_tables(group, width) for b in row]
        lens = torch.tensor([s.context_len for s in group], device=dev)
        return _DecodeGroup(
            idx=torch.tensor([s.start for s in group], dtype=torch.long, device=dev),
            tables=torch.tensor(tables, dtype=torch.long, device=dev),
            mask=(torch.arange(width * self.block_size, device=dev) < lens.unsqueeze(1))[:, None, None, :],
            num_rows=len(group),
        )

    def begin_forward(self, positions: Tensor) -> None:
        if positions.shape != (1, self._num_tokens):
            raise ValueError(f"paged forward expects positions (1, {self._num_tokens}) as set_step said, got {tuple(positions.shape)}")

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (1, N, H, E), k/v (1, N, K, E) -> (1, N, H, E); writes k/v into their slots first."""
        K, E = k.shape[2], k.shape[3]
        k_pool, v_pool = self.k[layer], self.v[layer]  # (NB, bs, K, E)
        write_kv(k_pool, v_pool, self.slot_mapping, k[0], v[0])
        attend_decode = decode_attention_kernel(q, k_pool, self.block_size)
        if attend_decode is not None:  # every decode row straight over its block table: no gather
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (1, N, H, E)
            if len(self.decode_rows):
                attend_decode(q[0], k_pool, v_pool, self.decode_rows, self.decode_tables, self.decode_lens, out[0])
            self._attend_prefills(q, k, v, k_pool, v_pool, out)
            return out
        groups, decode_only = self._gather_plan()
        if decode_only:
            g = groups[0]
            kd = k_pool.index_select(0, g.tables).view(g.num_rows, -1, K, E)  # (N, S, K, E)
            vd = v_pool.index_select(0, g.tables).view(g.num_rows, -1, K, E)
            return sdpa(q.transpose(0, 1), kd, vd, g.mask).transpose(0, 1)  # (N, 1, H, E) -> (1, N, H, E)
        out = torch.empty_like(q)
        for g in groups:
            kd = k_pool.index_select(0, g.tables).view(g.num_rows, -1, K, E)  # (Bg, S_g, K, E)
            vd = v_pool.index_select(0, g.tables).view(g.num_rows, -1, K, E)
            out[0, g.idx] = sdpa(q[0, g.idx].unsqueeze(1), kd, vd, g.mask).squeeze(1)  # (Bg, H, E)
        self._attend_prefills(q, k, v, k_pool, v_pool, out)
        return out

    def _attend_prefills(self, q: Tensor, k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, out: Tensor) -> None:
        K, E = k.shape[2], k.shape[3]
        for p in self.prefills:
            qp = q[:, p.start : p.end]  # (1, n, H, E)
            if p.blocks is None:
                out[:, p.start : p.end] = sdpa(qp, k[:, p.start : p.end], v[:, p.start : p.end], is_causal=True)
            else:
                kp = k_pool.index_select(0, p.blocks).view(1, -1, K, E)[:, : p.context_len]  # (1, ctx, K, E)
                vp = v_pool.index_select(0, p.blocks).view(1, -1, K, E)[:, : p.context_len]
                out[:, p.start : p.end] = sdpa(qp, kp, vp, p.mask)
