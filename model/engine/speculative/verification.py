"""Speculative decoding in the engine's step: drafts proposed before a step (`propose`), verified by the step's rows
of several tokens, and resolved after it (`resolve`): the drafts the samples agree with are kept, the rest's K/V
rolled back. The engine asks it at those two points and when a sequence finishes (`release`); what a sequence
drafts comes from its `Drafter` (drafter.py: the speculator over a proposer, or a test's own).

A draft is kept only where it equals the token sampled at its position (each verification row is sampled as if
the drafts before it were accepted: input_batch.py's `_sampling_row`), so the output is what decoding one token at a
time samples, a seeded row's included (its noise is replayed for the rows it keeps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from model.engine.request import Sequence
from model.engine.sampler import TokenLogprobs, replay_noise
from model.engine.speculative.drafter import Drafter
from model.features import registry as features

if TYPE_CHECKING:
    from model.engine.kv_cache_manager import KVCacheManager

Sampled = list[tuple[int, TokenLogprobs | None]]


class Verification:
    def __init__(self, drafter: Drafter | None, kv: KVCacheManager, settle: Callable[[Sequence], None],
                 vocab_size: int, max_model_len: int) -> None:
        """`settle`: the engine's step after a sequence's tokens are computed (its newly full blocks committed, a
        windowed one's eviction), run once its drafts are resolved."""
        self.drafter, self.kv, self.settle = drafter, kv, settle
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self._noise_states: dict[Sequence, torch.Tensor] = {}  # seeded drafting rows' generator before the step

    def propose(self, running: list[Sequence]) -> None:
        """Ask the drafter for tokens to verify after each decoding sequence's last one (rows of several tokens).
        A sequence keeps the drafts its per-row features let it verify (`Feature.drafts`: each verification row is
        then as the feature stands after the drafts before it); a hidden-state read gets the positions of the kept tokens only; a windowed sequence drafts no
        further than its next eviction point (model/features/kv_window/schedule.py's chunk_limit: its K/V is evicted, and its keys shifted,
        only once its drafts are resolved, so a rollback never meets an eviction) and, its cache being bounded, past
        the context too. Per-token feature values are recorded for every verification row, and each kept token's
        go out with it. Not for sequences whose request turned speculation off."""
        seqs, rooms = [], []
        bs = self.kv.block_size
        for seq in running:
            o = seq.request.options
            if seq.draft_token_ids or seq.num_computed_tokens != seq.num_tokens - 1 or o.num_speculative_tokens == 0:
                continue
            w = o.kv_window
            reach = self.max_model_len - seq.num_tokens - 1 if w is None else w.chunk_limit(seq.num_computed_tokens, bs) - 1
            room = min(seq.request.params.max_tokens - len(seq.output_token_ids) - 1, reach)
            if o.num_speculative_tokens is not None:
                room = min(room, o.num_speculative_tokens)
            if room > 0:
                seqs.append(seq)
                rooms.append(room)
        if not seqs:
            return
        for seq, room, drafts in zip(seqs, rooms, self.drafter.propose(seqs, rooms, len(running))):
            seq.draft_token_ids = list(drafts)[:room]
            if seq.state and seq.draft_token_ids:
                seq.draft_token_ids = features.drafts(seq, seq.draft_token_ids)
            g = seq.sampling.generator
            if seq.draft_token_ids and g is not None:
                self._noise_states[seq] = g.get_state()

    def resolve(self, seq: Sequence, sampled: Sampled) -> Sampled:
        """A drafting sequence's rows were sampled each as if the drafts before it were accepted: keep the drafts
        the samples agree with and the sample after them, roll back the K/V of the rest, then settle it. -> the
        tokens to append, in order."""
        drafts = seq.draft_token_ids
        j = 0
        while j < len(drafts) and sampled[j][0] == drafts[j]:
            j += 1
        self.kv.rollback(seq, len(drafts) - j)
        seq.draft_token_ids = []
        self.settle(seq)
        state = self._noise_states.pop(seq, None)
        if state is not None and j < len(drafts):  # a seeded row drew noise for rows it did not keep: replay the kept
            seq.sampling.generator.set_state(state)
            replay_noise(seq.sampling.generator, seq.request.params, self.vocab_size, j + 1)
        self.drafter.resolved(seq, len(drafts), j)
        return sampled[: j + 1]

    def release(self, seq: Sequence) -> None:
        """`seq` has finished: the drafter and this drop what they keep for it."""
        if self.drafter is not None:
            self.drafter.release(seq)
            self._noise_states.pop(seq, None)
