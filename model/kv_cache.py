"""Contiguous KV cache: one (B, max_seq_len) slab per layer, written by index (gpt-fast's `KVCache`).

Used by `model.generate` (one sequence, or rows decoding in lock-step). The engine uses the paged block pool in
`model/engine/paged_cache.py`, whose memory follows the tokens actually held.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.attention import causal_mask, sdpa


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
        window: int = 0,
        scale: float = 0.0,
    ) -> None:
        """`window`, `scale`: the model's sliding window and attention scale (`ModelConfig.sliding_window`,
        `.attention_multiplier`; 0: none, 1/sqrt(E))."""
        shape = (n_layers, batch_size, max_seq_len, n_kv_heads, head_dim)  # (L, B, S_max, K, E)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_seq_len = max_seq_len
        self._batch_idx = torch.arange(batch_size, device=device).unsqueeze(1)  # (B, 1)
        self._positions: Tensor | None = None
        self._mask: Tensor | None = None
        self.window, self.scale = window, scale

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int, max_seq_len: int) -> "KVCache":
        c = model.config
        return cls(c.n_layers, batch_size, max_seq_len, c.n_kv_heads, c.head_dim, model.dtype, model.device,
                   c.sliding_window, c.attention_multiplier)

    def begin_forward(self, positions: Tensor) -> None:
        """Once per forward, positions (B, T): keys are cache positions 0..S-1, S = max position + 1."""
        S = int(positions.max()) + 1
        if S > self.max_seq_len:
            raise ValueError(f"position {S - 1} is beyond the cache's max_seq_len {self.max_seq_len}")
        self._positions = positions
        self._mask = causal_mask(positions, torch.arange(S, device=positions.device), self.window).unsqueeze(1)  # (B, 1, T, S)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Write k, v (B, T, K, E) at this forward's positions, attend q (B, T, H, E) over positions 0..S-1."""
        B, S = k.shape[0], self._mask.shape[-1]
        self.k[layer, :B][self._batch_idx[:B], self._positions] = k
        self.v[layer, :B][self._batch_idx[:B], self._positions] = v
        return sdpa(q, self.k[layer, :B, :S], self.v[layer, :B, :S], self._mask, scale=self.scale)

    def edit(self, layer: int, site: str, x: Tensor) -> Tensor:
        return x  # no interventions on this path (model/interventions.py: the engine and the probes have them)

    def adapt(self, layer: int, site: str, x: Tensor, y: Tensor) -> Tensor:
        return y  # no per-row features on this path (the engine's rows carry them)
