"""Request routers for the replica deployment (Ray Serve's custom request router API, `ray.serve.request_router`).

`PrefixAwareRouter` keeps each replica's prefix cache warm: a request whose prompt starts like one a replica served
before (a chat's next turn, a shared system prompt) goes to that replica while its load allows, else to the least
loaded one. The policy is Ray's own `PrefixCacheAffinityRouter` (ray/llm/_internal/serve/routing_policies/
prefix_aware/prefix_aware_router.py): match on prompt text, fall back when the match is short or the load is
imbalanced. Two differences: the index lives in the router (one per ingress replica, no shared tree actor and no
blocking `ray.get` on the event loop), and it is kept as chained hashes of fixed text blocks, as the engine keeps
its KV blocks (model/engine/kv_cache_manager.py), bounded per replica with least-recently-used eviction.

`RoundRobinRouter` is the baseline it is measured against (docs/performance.md#ray-serve-routing): what nginx's
round-robin does, replica after replica, never looking at the prompt.

Both also serve the per-replica metrics endpoints (service/rayserve/replica.py): a call naming a replica goes to
that replica, and a listing call is told the replicas routed among.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from service.rayserve.call import ReplicaCall


def _call(pending_request: PendingRequest | None) -> ReplicaCall | None:
    if pending_request is None:
        return None
    return next((a for a in pending_request.args if isinstance(a, ReplicaCall)), None)


def block_hashes(text: str, block_chars: int) -> list[int]:
    """Chained hashes of the text's whole `block_chars` blocks: equal hash i <=> equal first (i + 1) blocks."""
    hashes, h = [], 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        h = hash((h, text[start:start + block_chars]))
        hashes.append(h)
    return hashes


class PrefixIndex:
    """Which replica has seen which prompt prefixes: per replica, the block hashes of prompts routed to it, least
    recently used first, at most `max_blocks` each (the router's memory stays bounded whatever the traffic)."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.blocks: dict[str, OrderedDict[int, None]] = {}

    def insert(self, replica: str, hashes: list[int]) -> None:
        seen = self.blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)

    def match(self, replica: str, hashes: list[int]) -> int:
        """Leading blocks of `hashes` this replica has seen."""
        seen = self.blocks.get(replica)
        if not seen:
            return 0
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def size(self, replica: str) -> int:
        return len(self.blocks.get(replica, ()))

    def keep_only(self, replicas: set[str]) -> None:
        for gone in set(self.blocks) - replicas:
            del self.blocks[gone]


class _Routing(RequestRouter):
    """What both routers share: pinned calls (one named replica) and listing calls."""

    def _special(self, candidates: list[RunningReplica], call: ReplicaCall | None) -> list[list[RunningReplica]] | None:
        if call is None:
            return None
        if call.replica_ids is not None or call.path == "/replicas":
            call.replica_ids = sorted(r.replica_id.unique_id for r in self.curr_replicas.values())
            return [candidates]
        if call.target_replica is not None:
            pinned = [r for r in candidates if r.replica_id.unique_id == call.target_replica]
            # No such replica (gone, or never was): any replica answers the 404, so the call never waits for one
            return [pinned] if pinned else [candidates]
        return None

    def _queue_len(self, replica: RunningReplica) -> int:
        """Requests in flight on the replica as this router last knew (sent, not finished; probes correct it)."""
        return self.replica_queue_len_cache.get(replica.replica_id) or 0


class PrefixAwareRouter(_Routing):
    def initialize_state(self, block_chars: int = 64, imbalanced_threshold: int = 8, min_match_blocks: int = 1,
                         max_blocks_per_replica: int = 100_000) -> None:
        """`block_chars`: text block the prefixes are matched in (~16 tokens of English, the engine's KV block);
        `imbalanced_threshold`: the prefix's replica is skipped once it has this many more requests in flight than
        the least loaded one; `min_match_blocks`: shorter matches are no match."""
        self.block_chars = block_chars
        self.imbalanced_threshold = imbalanced_threshold
        self.min_match_blocks = min_match_blocks
        self.index = PrefixIndex(max_blocks_per_replica)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        call = _call(pending_request)
        special = self._special(candidate_replicas, call)
        if special is not None:
            return special
        # Least loaded first; among equals the one holding the fewest prefixes, so new conversations spread out
        by_load = sorted(candidate_replicas, key=lambda r: (self._queue_len(r), self.index.size(r.replica_id.unique_id)))
        text = call.prefix_text() if call is not None else None
        if text and by_load:
            hashes = block_hashes(text, self.block_chars)
            best = max(by_load, key=lambda r: self.index.match(r.replica_id.unique_id, hashes))
            matched = self.index.match(best.replica_id.unique_id, hashes)
            if matched >= self.min_match_blocks and \
                    self._queue_len(best) - self._queue_len(by_load[0]) <= self.imbalanced_threshold:
                return [[best]] + [[r] for r in by_load if r is not best]
        # One rank each: the base router tries them in order and skips a replica whose queue is full
        return [[r] for r in by_load]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        call = _call(pending_request)
        text = call.prefix_text() if call is not None else None
        if text:
            self.index.insert(replica_id.unique_id, block_hashes(text, self.block_chars))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.keep_only({r.replica_id.unique_id for r in replicas})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.keep_only({r.unique_id for r in self.curr_replicas} - {replica_id.unique_id})


class RoundRobinRouter(_Routing):
    """The baseline: each request to the next replica in turn (by id), whatever its prompt or load."""

    def initialize_state(self) -> None:
        self.turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        special = self._special(candidate_replicas, _call(pending_request))
        if special is not None:
            return special
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        first = next(self.turn) % len(ordered)
        return [[r] for r in ordered[first:] + ordered[:first]]
