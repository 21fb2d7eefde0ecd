"""Random paged KV pools for the attention kernels' tests (the native ones in pytest, the Triton ones in
tests/triton_interpret_check.py): each sequence's blocks scattered over the pool, as a long-running server leaves
them."""

from __future__ import annotations

import random

import torch

from model.kernels import kv_int8


def scattered_pools(lens: list[int], bs: int, K: int, E: int, g: torch.Generator, seed: int, spare: int,
                     dtype: torch.dtype = torch.float32):
    """Random K and V pools with `spare` blocks beyond what `lens` need, each sequence's blocks scattered over them.
    -> k_pool, v_pool (NB, bs, K, E) (E + 4 int8 blocks for dtype int8: kv_int8.py), the block tables (lists) and
    them padded with 0 as a tensor (S, W)."""
    n_blocks = sum(-(-n // bs) for n in lens) + spare
    store = kv_int8.pack if dtype == torch.int8 else (lambda x: x.to(dtype))
    k_pool = store(torch.randn(n_blocks, bs, K, E, generator=g))
    v_pool = store(torch.randn(n_blocks, bs, K, E, generator=g))
    ids = list(range(n_blocks))
    random.Random(seed).shuffle(ids)  # scattered blocks
    tables, at = [], 0
    for n in lens:
        tables.append(ids[at : at + -(-n // bs)])
        at += -(-n // bs)
    width = max(map(len, tables))
    return k_pool, v_pool, tables, torch.tensor([t + [0] * (width - len(t)) for t in tables])
