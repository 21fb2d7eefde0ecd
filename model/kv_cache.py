"""KV cache: keys and values of past positions, written by index so decode reads them instead of recomputing.

This is the contiguous form (one (B, max_seq_len) slab per layer, as in gpt-fast's `KVCache`), used by
`model.generate`. The paged block pool with prefix reuse that the engine needs replaces it behind the same
`prepare` / `update` interface.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        max_seq_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (n_layers, batch_size, max_seq_len, n_kv_heads, head_dim)  # (L, B, S_max, K, E)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_seq_len = max_seq_len
        self._batch_idx = torch.arange(batch_size, device=device).unsqueeze(1)  # (B, 1)
        self._seq_len = 0  # S for the current forward call

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int, max_seq_len: int) -> "KVCache":
        c = model.config
        return cls(c.n_layers, batch_size, max_seq_len, c.n_kv_heads, c.head_dim, model.dtype, model.device)

    def prepare(self, positions: Tensor) -> int:
        """Called once per forward with positions (B, T): returns S, the key positions attended over (0..S-1)."""
        S = int(positions.max()) + 1
        if S > self.max_seq_len:
            raise ValueError(f"position {S - 1} is beyond the cache's max_seq_len {self.max_seq_len}")
        self._seq_len = S
        return S

    def update(self, layer: int, positions: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, T, K, E) at positions (B, T); return this layer's keys and values (B, S, K, E)."""
        B = k.shape[0]
        self.k[layer, : B][self._batch_idx[:B], positions] = k
        self.v[layer, : B][self._batch_idx[:B], positions] = v
        return self.k[layer, :B, : self._seq_len], self.v[layer, :B, : self._seq_len]
