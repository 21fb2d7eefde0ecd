"""A draft model's proposals (Leviathan et al. 2023; vLLM's `draft_model` method, llama.cpp server's `--model-draft`):
a smaller or more coarsely quantized model with the target's vocabulary decodes K tokens greedily after each
drafting sequence's last one, and the target verifies them in its own step.

The draft keeps its own paged KV cache, block manager and model runner (the engine's, for another model). Each
target sequence has a shadow sequence here whose tokens are the target's verified tokens plus the drafts last
proposed: before proposing, the shadow drops (rolls back) whatever the target did not keep, computes the target's
new tokens in one chunk (the whole prompt the first time, within the step budget), samples the first draft from that
chunk's last row, then decodes the rest one batched step at a time over every drafting sequence.

Drafts are greedy (the draft's distribution is one-hot): the target keeps a draft exactly when the token it samples
there equals it, which for a one-hot proposal is Leviathan et al.'s rejection rule (accept x with probability
min(1, p(x)/q(x)) = p(x); on rejection the token is drawn from the residual max(0, p - q), p without x, which is the
target's own sample conditioned on differing from x). So sampled output keeps the target's distribution exactly."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from model.engine.engine_sizes import EngineSizes
from model.engine.kv_cache_manager import KVCacheManager
from model.engine.model_runner import ModelRunner
from model.engine.stream import stream_for
from model.engine.paged_cache import PagedKVCache
from model.engine.request import Request, Sequence, SequenceStatus
from model.engine.sampler import Sampler
from model.engine.sampling_params import SamplingParams
from model.engine.scheduler import ScheduledSeq
from model.engine.sequence_state import SamplingState

if TYPE_CHECKING:
    from model.transformer import Transformer

log = logging.getLogger("llamascope.engine")


class _Shadow:
    """The draft's copy of one target sequence: `seq` holds the target's verified tokens up to `base` output
    tokens, then the drafts last proposed (computed by the draft up to its num_computed_tokens)."""

    def __init__(self, seq: Sequence) -> None:
        req = Request(f"draft-{seq.seq_id}", seq.prompt_token_ids, _GREEDY)
        self.seq = Sequence(seq.seq_id, req, 0, seq.prompt_token_ids)
        self.seq.sampling = SamplingState(generator=None, stop_ids=frozenset())
        self.seq.status = SequenceStatus.RUNNING
        self.base = 0


# a sequence starts drafting only if the draft has fewer than this many tokens of its history to compute per token
# it still has to generate (a sequence admitted while the batch was too large to draft, now in its last tokens, has
# its whole prompt to catch up)
CATCH_UP_PER_TOKEN = 4
_GREEDY = SamplingParams(max_tokens=1 << 30, temperature=0.0, ignore_eos=True)


class DraftModelProposer:
    def __init__(self, model: Transformer, sizes: EngineSizes) -> None:
        """A draft over the engine's sizes: as many blocks as the engine's pool, the same step budget."""
        self.model = model
        self.budget = sizes.max_num_batched_tokens
        self.max_model_len = sizes.max_model_len  # the draft holds a sequence's whole history (no window)
        self.cache = PagedKVCache.for_model(model, sizes.num_blocks, sizes.block_size)
        self.kv = KVCacheManager(sizes.num_blocks, sizes.block_size, enable_prefix_caching=False)
        # the draft's device work runs where the target's does (model/engine/stream.py): on a device its inputs are
        # staged in buffers of their own, and its events complete when the device gets there
        self.runner = ModelRunner(model, self.cache, Sampler(model.config.vocab_size, model.device), sizes,
                                  stream=stream_for(model))
        self.shadows: dict[Sequence, _Shadow] = {}
        log.info("draft model: %d KV blocks of %d tokens (%.0f MB)", sizes.num_blocks, sizes.block_size,
                 self.cache.nbytes / 1e6)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        drafts: dict[Sequence, list[int]] = {}
        want: dict[Sequence, int] = {}
        first: list[ScheduledSeq] = []
        budget = self.budget
        for seq, k in zip(seqs, ks):
            k = min(k, self.max_model_len - seq.num_tokens)  # a windowed sequence nears the context: the draft's
            if k <= 0:  # cache holds the whole history (no window), so it stops drafting there
                continue
            behind = seq.num_prompt_tokens + len(seq.output_token_ids) - self._computed(seq)
            if behind > CATCH_UP_PER_TOKEN * (seq.request.params.max_tokens - len(seq.output_token_ids)):
                continue  # near its end: computing its whole history in the draft would cost more than drafting gains
            shadow = self._sync(seq)
            s = shadow.seq
            n = s.num_tokens - s.num_computed_tokens  # >= 1: the target's last token at least
            n = min(n, budget)
            if n <= 0 or not self.kv.allocate(s, n):
                continue
            budget -= n
            first.append(ScheduledSeq(s, n))
            want[s] = k
        self._step(first, drafts)  # catches up; the sequences that caught up sample their first draft
        while True:
            rows = [ScheduledSeq(s, 1) for s, d in drafts.items() if len(d) < want[s] and self.kv.allocate(s, 1)]
            if not rows:
                break
            self._step(rows, drafts)
        return [drafts.get(self.shadows[seq].seq, []) if seq in self.shadows else [] for seq in seqs]

    def _computed(self, seq: Sequence) -> int:
        shadow = self.shadows.get(seq)
        return shadow.seq.num_computed_tokens if shadow is not None else 0

    def release(self, seq: Sequence) -> None:
        shadow = self.shadows.pop(seq, None)
        if shadow is not None:
            self.kv.free(shadow.seq)

    def _sync(self, seq: Sequence) -> _Shadow:
        """The shadow of `seq` with the drafts the target rejected dropped and the target's new tokens appended."""
        shadow = self.shadows.get(seq)
        if shadow is None:
            shadow = self.shadows[seq] = _Shadow(seq)
        s, out = shadow.seq, seq.output_token_ids
        m = shadow.base
        while m < len(s.output_token_ids) and m < len(out) and s.output_token_ids[m] == out[m]:
            m += 1
        valid = s.num_prompt_tokens + m  # tokens the shadow holds that the target kept
        if s.num_computed_tokens > valid:
            self.kv.rollback(s, s.num_computed_tokens - valid)
        s.output_token_ids = list(out)
        shadow.base = len(out)
        return shadow

    def _step(self, scheduled: list[ScheduledSeq], drafts: dict[Sequence, list[int]]) -> None:
        if not scheduled:
            return
        result = self.runner.execute(scheduled)
        for sch in scheduled:
            sch.seq.num_computed_tokens += sch.num_new_tokens
        for s, token, _ in result.sampled:
            drafts.setdefault(s, []).append(token)
            s.output_token_ids.append(token)
