"""The sink + window KV cache (StreamingLLM: Xiao et al., ICLR 2024, "Efficient Streaming Language Models with
Attention Sinks"), as schedule arithmetic (torch-free; the tensor side is the engine's model/engine/context_shift.py).

A windowed sequence keeps the K/V of its first `sink_tokens` tokens and of its most recent tokens; whole blocks
are evicted from the middle as it grows, so it can run past the model's context with a bounded cache. Its cache is
compact: sinks at cache positions 0..S-1, the window right after them, and every token is computed at its position
*within the cache*, as the paper does (mit-han-lab/streaming-llm `pos_shift/modify_llama.py` rotates cached keys at
0..len-1 and the query at the cache's end), so RoPE never sees a distance the model was not trained on.

Positions: evicting bs tokens moves every later key bs positions down. We re-rotate those keys by -bs in place (RoPE
rotations compose: R(p - bs) = R(-bs) R(p)), which is llama.cpp's context shift (`seq_rm` of the discarded range and
`seq_add(-n_discard)` of the rest, tools/server/server-context.cpp; the K-shift graph `build_rope_shift` in
src/llama-kv-cache.cpp). The alternative, caching keys unrotated and rotating them at attention time (the paper's
code), would change every decode kernel (native, Triton, the CUDA graphs' step); re-rotation leaves them reading
rotated keys as before, for O(window) work once per block of tokens, and a key is re-rotated at most
(window + bs) / bs times in its life, so rounding stays bounded.

The schedule, S sinks, window W, block size bs: the query of token t attends to the sinks and to the tokens after
the first `evicted(t)` non-sink ones, where

    evicted(t) = bs * max(0, (t - S - W) // bs)

so it sees between W and W + bs - 1 earlier window tokens (and itself), and the cache never holds more than
S + W + bs tokens: at most (S + W) / bs + 2 blocks. The attended set depends on t alone, never on how tokens are
chunked: a prefill chunk stops at the next eviction point (`chunk_limit`), so a prompt computed in chunks, the
same tokens decoded one by one and a sequence recomputed after preemption all see the same keys at the same cache
positions, and prompt logprobs (`echo` + `logprobs`) score a text as generation would see it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVWindow:
    """Per request: keep the first `sink_tokens` tokens' K/V and (at least) the most recent `window`."""

    sink_tokens: int = 4
    window: int = 1024

    def validate(self) -> None:
        for name, lo in (("sink_tokens", 0), ("window", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"kv_window.{name} must be an integer >= {lo}, got {v!r}")

    def max_cache_tokens(self, block_size: int) -> int:
        """The most tokens the cache holds at once (what must fit the context)."""
        return self.sink_tokens + self.window + block_size

    def evicted(self, t: int, block_size: int) -> int:
        """Non-sink tokens dropped from the cache when token t is computed (a multiple of block_size)."""
        return block_size * max(0, (t - self.sink_tokens - self.window) // block_size)

    def chunk_limit(self, num_computed: int, block_size: int) -> int:
        """The most tokens a step may compute from `num_computed` on: up to the next eviction point."""
        base = self.sink_tokens + self.window
        return base + block_size * (max(0, num_computed - base) // block_size + 1) - num_computed


@dataclass
class Eviction:
    """One eviction of `shift` (= block_size) tokens at cache positions [S, S + shift) of a sequence, as the KV
    manager decided it: the block table after it, the block released, and the rows the tensors must move first.

    With S a multiple of the block size the evicted tokens are one whole block, dropped from the table. Otherwise
    block j = S // bs holds the sink tail at offsets [0, r) (r = S % bs) and the window's head at [r, bs): its
    window part is evicted with the first r rows of block j + 1, whose last bs - r rows move into offsets [r, bs) of
    block j (`copy`), and block j + 1 is released. Either way the keys now at cache positions [S, cache_len) are
    re-rotated by -shift."""

    block_ids: list[int]  # the table after the eviction
    released: int  # the block given back to the pool
    copy: tuple[int, int, int] | None  # (src block, dst block, first offset): rows [offset, bs) of src -> dst
    sink_tokens: int
    cache_len: int  # cache positions in use after the eviction
    shift: int


def evict(block_ids: list[int], window: KVWindow, cache_len: int, block_size: int) -> Eviction:
    """Plan one eviction of block_size tokens from a cache of `cache_len` tokens in `block_ids`."""
    S, bs = window.sink_tokens, block_size
    j, r = divmod(S, bs)
    if cache_len < S + bs or len(block_ids) < -(-cache_len // bs):
        raise AssertionError(f"nothing to evict: {cache_len} tokens in {len(block_ids)} blocks, {S} sinks")
    if r == 0:
        released, copy = block_ids[j], None
        table = block_ids[:j] + block_ids[j + 1 :]
    else:
        released, copy = block_ids[j + 1], (block_ids[j + 1], block_ids[j], r)
        table = block_ids[: j + 1] + block_ids[j + 2 :]
    return Eviction(table, released, copy, S, cache_len - bs, bs)
