"""Paged KV-cache bookkeeping (torch-free): the block pool, per-sequence block tables, prefix caching.

The K/V tensors themselves live in `model.engine.paged_cache.PagedKVCache`; this decides which block ids hold what.
Design after vLLM (Kwon et al. 2023, "Efficient Memory Management for LLM Serving with PagedAttention", and
`vllm/v1/core/kv_cache_manager.py` / `block_pool.py`):

- A full block is identified by a hash chained over every token before it (parent hash + its own tokens, + what
  the per-row features say changed its positions: `Feature.block_key`, model/features/registry.py), so equal
  hashes mean equal prefixes computed the same way. Full
  blocks are registered under their hash and shared by reference count.
- A block whose reference count drops to 0 goes to the back of the free queue but keeps its hash: it can be
  revived by a later request with the same prefix until it reaches the front and is reused (LRU eviction).
- Sequences free their blocks tail first, so a prefix's later blocks are evicted before its first ones.
- A windowed sequence (model/features/kv_window/) gives back a block from the middle of its table each time its window slides
  past one; its blocks are private (never looked up, registered or shared), since the slide rewrites them.
- Under a model's own sliding window (Mistral v0.1: ModelConfig.sliding_window), a sequence's leading blocks go back
  to the pool once every query it will compute attends past them (`release_behind_window`, vLLM's
  `SlidingWindowManager.remove_skipped_blocks`): its memory follows the window, not the whole context. They stay
  registered in the prefix cache: a block is released, never rewritten.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from model.features.kv_window import Eviction, evict
from model.engine.request import Sequence
from model.features import registry as features


def block_hash(parent: bytes, tokens: list[int], edits: bytes | None = None) -> bytes:
    """A 128-bit BLAKE2 digest over the parent block's hash and this block's token ids: collisions, which would
    silently serve one prompt another's K/V, are not a practical concern (unlike Python's 64-bit `hash`). `edits`:
    the per-row features' key of the block's positions (`Feature.block_key`: the interventions that touched them),
    so a block computed under one intervention is never served to a request under another or none."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))  # each id as 4 little-endian bytes
    if edits is not None:
        h.update(b"edits" + edits)
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        # ref_count == 0 blocks, least recently freed first; never-used blocks start here in id order.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (cached-but-unreferenced ones included: they are evictable)."""
        return len(self.free)

    def allocate(self) -> int:
        block, _ = self.free.popitem(last=False)
        h = self.hash_of[block]
        if h is not None:  # evict: this block's cached prefix is gone
            self.hash_of[block] = None
            if self.by_hash.get(h) == block:
                del self.by_hash[h]
        self.ref_count[block] = 1
        return block

    def lookup(self, h: bytes) -> int | None:
        return self.by_hash.get(h)

    def acquire(self, block: int) -> None:
        """Take one more reference to a cached block (reviving it from the free queue if unreferenced)."""
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free[block] = None  # most recently freed: evicted last
        assert self.ref_count[block] >= 0, f"block {block} released more often than acquired"

    def register(self, block: int, h: bytes) -> None:
        """Record that full block `block` holds the prefix hashing to `h` (first writer wins on duplicates)."""
        if h not in self.by_hash:
            self.by_hash[h] = block
            self.hash_of[block] = h


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.num_cached_prompt_tokens = 0  # served from the prefix cache, since start
        self.num_prompt_tokens = 0  # scheduled for the first time, since start
        self.num_evicted_blocks = 0  # blocks windowed sequences gave back as they slid, since start

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.cache_len + num_new_tokens  # cache positions (a windowed sequence's evicted tokens hold none)
        return max(0, -(-total // self.block_size) - len(seq.block_ids))

    def attach_cached_prefix(self, seq: Sequence, max_tokens: int | None = None) -> int:
        """At a sequence's (re)admission: take the longest run of its full blocks already in the cache, at most
        `max_tokens` tokens of them (None: no limit).

        Sets num_computed_tokens and returns it. At least one token is always left to compute (the sampler
        needs the last position's logits), so a fully cached prompt recomputes its last block.
        """
        assert not seq.block_ids and seq.num_computed_tokens == 0
        hits: list[int] = []
        # A windowed sequence shares nothing: evictions rewrite its blocks in place (moved rows, re-rotated keys),
        # which a block another sequence reads, or the prefix cache may hand out later, must never see.
        if self.enable_prefix_caching and seq.window is None:
            self._extend_hashes(seq, seq.num_tokens)
            limit = len(seq.block_hashes) if max_tokens is None else max_tokens // self.block_size
            for h in seq.block_hashes[:limit]:
                block = self.pool.lookup(h)
                if block is None:
                    break
                hits.append(block)
            if len(hits) * self.block_size >= seq.num_tokens:
                hits.pop()
        for block in hits:
            self.pool.acquire(block)
        seq.block_ids = hits
        seq.block_table_version += 1
        seq.num_committed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_cached_tokens < 0:  # first admission: count for the usage report and hit rate
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            self.num_cached_prompt_tokens += seq.num_cached_tokens
            self.num_prompt_tokens += seq.num_prompt_tokens
        return seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens; all or nothing. False: not enough free blocks."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.pool.num_free:
            return False
        seq.block_ids.extend(self.pool.allocate() for _ in range(need))
        return True

    def commit(self, seq: Sequence) -> None:
        """After a step computed tokens of `seq`: register its newly full blocks in the prefix cache."""
        if not self.enable_prefix_caching or seq.window is not None:
            return
        num_full = seq.num_computed_tokens // self.block_size
        self._extend_hashes(seq, num_full * self.block_size)
        for i in range(seq.num_committed_blocks, num_full):
            self.pool.register(seq.block_ids[i], seq.block_hashes[i])
        seq.num_committed_blocks = max(seq.num_committed_blocks, num_full)

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Forget the K/V of `seq`'s last `num_tokens` computed tokens (drafts a step rejected): they count as not
        computed, their slots are written again by the tokens that take their positions, and tail blocks no longer
        needed go back to the pool. Only uncommitted tokens may be rolled back (the engine commits a drafting
        sequence's blocks after its drafts are resolved), so no block of the prefix cache ever held them. A windowed
        sequence's rolled-back tokens are its cache's last (drafts never cross an eviction point, and the engine
        evicts only after resolving them), so the blocks kept are those of its cache length."""
        assert 0 <= num_tokens <= seq.cache_len
        seq.num_computed_tokens -= num_tokens
        assert seq.num_committed_blocks * self.block_size <= seq.num_computed_tokens, "rolled back committed tokens"
        keep = -(-seq.cache_len // self.block_size)
        while len(seq.block_ids) > keep:
            self.pool.release(seq.block_ids.pop())
        seq.block_table_version += 1

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_ids[seq.num_released_blocks :]):  # tail first: the prefix's head stays cached longest
            self.pool.release(block)
        seq.block_ids = []
        seq.block_table_version += 1
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        seq.num_evicted = 0
        seq.num_released_blocks = 0

    def release_behind_window(self, seq: Sequence, window: int) -> int:
        """After a step (its new blocks committed): give back `seq`'s blocks whose every position is behind the
        sliding `window` of the next token it computes (position p = num_computed_tokens attends to keys > p -
        window), and of every later one; -> how many went back. 0 (no window), a kv_window sequence (its own
        bounded cache: model/features/kv_window/) and one with drafts pending (a rollback may move p back) keep all theirs.

        The attention kernels read keys in groups of 8 from the first one a query attends to rounded down to a
        multiple of 8 (csrc/paged_attention.cpp `attend_tile`), so the blocks kept start at that position."""
        if not window or seq.window is not None or seq.draft_token_ids:
            return 0
        keep_from = max(0, seq.num_computed_tokens + 1 - window) // 8 * 8  # the first position any query reads
        behind = min(keep_from // self.block_size, len(seq.block_ids))
        released = 0
        for i in range(seq.num_released_blocks, behind):
            self.pool.release(seq.block_ids[i])
            released += 1
        seq.num_released_blocks = max(seq.num_released_blocks, behind)
        return released

    def evict(self, seq: Sequence) -> Eviction | None:
        """After a step: the eviction a windowed sequence is due (model/features/kv_window/schedule.py), with its block table
        updated and the evicted block released, or None. The caller applies the returned rows and rotation to the
        cache tensors before anything else is allocated (ContextShift.apply)."""
        window, bs = seq.window, self.block_size
        if window is None or window.evicted(seq.num_computed_tokens, bs) == seq.num_evicted:
            return None
        assert window.evicted(seq.num_computed_tokens, bs) == seq.num_evicted + bs, "a chunk crossed an eviction point"
        ev = evict(seq.block_ids, window, seq.cache_len, bs)
        seq.block_ids = ev.block_ids
        seq.block_table_version += 1
        seq.num_evicted += bs
        self.pool.release(ev.released)
        self.num_evicted_blocks += 1
        return ev

    def _extend_hashes(self, seq: Sequence, num_tokens: int) -> None:
        bs = self.block_size
        req = seq.request
        for i in range(len(seq.block_hashes), num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else req.prefix_root
            edits = features.block_key(req, i * bs, (i + 1) * bs) if req.state else None
            seq.block_hashes.append(block_hash(parent, seq.token_ids(i * bs, (i + 1) * bs), edits))
