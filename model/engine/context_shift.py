"""The tensor side of a windowed sequence's eviction (model/features/kv_window/schedule.py): move the rows the compact layout
needs moved and re-rotate the keys that moved down by `shift` cache positions, in every layer, in place.

RoPE rotates each pair (i, i + E/2) of a key at position p by the angle p * inv_freq[i]; rotations compose, so a
key rotated for position p becomes the key for p - shift by one more rotation by -shift * inv_freq[i] (llama.cpp's
K-shift, `llama_kv_cache::build_rope_shift`, applies `ggml_rope_ext` with the shift as the position). The tables
come from the model's own RoPE module, so its frequency scaling (Llama 3.1, linear, GGUF rope_freqs) is the one
applied. The rotation runs in float32 and rounds once to the cache's dtype (an int8 cache's keys: dequantized,
rotated, quantized again with new scales, model/kernels/kv_int8.py; their rows move with their scales).
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.features.kv_window import Eviction
from model.engine.paged_cache import PagedKVCache
from model.kernels import kv_int8
from model.kernels.ops import apply_rotary_tables
from model.transformer import rotary_tables


class ContextShift:
    def __init__(self, model: torch.nn.Module, cache: PagedKVCache) -> None:
        self.cache = cache
        shift = cache.block_size  # every eviction moves keys down by one block
        positions = torch.tensor([[-shift]], device=cache.device)
        cos, sin = model.rope(positions)  # (1, 1, E) float32
        self.cos, self.ssin = rotary_tables(cos, sin, torch.float32)  # (1, 1, 1, E) each
        self.shift = shift
        self.num_evictions = 0

    @torch.inference_mode()
    def apply(self, ev: Eviction) -> None:
        """Rows first (the released block is only read here, before anything can be allocated into it), then the
        rotation of cache positions [S, cache_len) of the new table."""
        assert ev.shift == self.shift, "evictions move keys by one block"
        k, v, bs = self.cache.k, self.cache.v, self.cache.block_size  # (L, NB, bs, K, E) (E + 4: int8)
        if ev.copy is not None:
            src, dst, r = ev.copy
            for part in (*kv_int8.views(k), *kv_int8.views(v)):  # (an int8 row's quants and its scale)
                part[:, dst, r:] = part[:, src, r:]
        if ev.cache_len > ev.sink_tokens:
            pos = torch.arange(ev.sink_tokens, ev.cache_len)
            table = torch.tensor(ev.block_ids)
            slots = (table[pos // bs] * bs + pos % bs).to(self.cache.device)  # (n,)
            keys = kv_int8.read_slots(k, slots, torch.float32)  # (L, n, K, E)
            kv_int8.write_slots(k, slots, self._rotate(keys))
        self.num_evictions += 1

    def _rotate(self, keys: Tensor) -> Tensor:  # (L, n, K, E) -> the same keys at cache positions `shift` lower
        return apply_rotary_tables(keys, self.cos, self.ssin)
