"""Iteration-level scheduling (torch-free): which sequences run this step, and how many tokens each computes.

Continuous batching (Yu et al. 2022, "Orca") with chunked prefill (Agrawal et al. 2024, "Sarathi-Serve"), in
the shape of vLLM's v1 scheduler: every sequence has `num_tokens` (prompt + output) and `num_computed_tokens`;
a step lets each catch up by some amount under a token budget. Running sequences go first (decode tokens and
unfinished prefill chunks, oldest first), then waiting ones are admitted while budget, sequence slots and free
blocks last. When a running sequence cannot get a block, the newest running sequence is preempted: its blocks
are freed and it goes back to the front of the queue to be recomputed later (vLLM's recompute preemption).

Background sequences (`RequestOptions.background`: the rows of an activation-patching sweep) yield to the others, as
inspections do (model/engine/async_engine.py): a waiting foreground sequence is admitted before any waiting
background one, background sequences hold at most half the sequence slots, and while any foreground sequence is
running or waiting they compute at most `max_background_tokens` tokens a step between them; alone, at most
BACKGROUND_IDLE_FACTOR times that, so a request that arrives waits for one short step, not a full batch of them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from model.engine.end_of_sequence import reaches_length
from model.engine.kv_cache_manager import KVCacheManager
from model.engine.persistent_batch import PersistentBatch
from model.engine.request import Sequence, SequenceStatus


# A background sequence alone may take this many times its share: a sweep runs at full speed when nothing else does,
# and a request that arrives waits one short step (docs/performance.md, "Activation patching", measures both)
BACKGROUND_IDLE_FACTOR = 4


class QueueFullError(RuntimeError):
    """Submission refused: the waiting queue is at its limit (the HTTP layer answers 429 with Retry-After)."""


@dataclass
class SchedulerConfig:
    # no defaults here: the engine passes its EngineConfig's (model/engine/engine.py), which Settings' are
    max_num_seqs: int  # running sequences at once
    max_num_batched_tokens: int  # tokens in one step (decode + prefill chunks)
    max_waiting: int  # queued sequences beyond which submission is refused
    max_background_tokens: int  # background tokens a step while foreground sequences run or wait

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "max_background_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


def _background(seq: Sequence) -> bool:
    return seq.request.options.background


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, batch: PersistentBatch | None = None) -> None:
        """`batch`: the running sequences' rows (model/engine/persistent_batch.py), kept in step with `running`."""
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.batch = batch if batch is not None else PersistentBatch(config.max_num_seqs, 0)
        self.max_model_len = 1 << 62  # the engine sets its own
        self.num_preemptions = 0

    def check_capacity(self, num_new: int = 1) -> None:
        if len(self.waiting) + num_new > self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({len(self.waiting)} of {self.config.max_waiting} sequences)")

    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.status = SequenceStatus.WAITING
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and return its blocks to the pool at once."""
        if seq.slot >= 0:
            self.running.remove(seq)
            self.batch.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

    def schedule_decode(self, in_flight: bool = False) -> list[Sequence] | None:
        """The steady state's schedule: every running sequence decodes one token, and nothing waits that could be
        admitted. -> the step's sequences, in the persistent batch's row order (each with a block for its token), or
        None: this step needs `schedule` (a prefill, an admission, a preemption, a sequence that is not a plain
        decoder: model/engine/request.py's `Request.plain_decode`). `in_flight`: a decode step of every running
        sequence is still running, its tokens not on the host yet: each row's input is that token, and a sequence
        that token ends by length (max_tokens, the context) is left out."""
        running, cfg = self.running, self.config
        n = len(running)
        if not n or n > cfg.max_num_batched_tokens or (self.waiting and n < cfg.max_num_seqs):
            return None
        batch = self.batch
        seqs = batch.seqs
        bs, pending, max_len = self.kv.block_size, int(in_flight), self.max_model_len
        ending = None
        for seq in seqs:
            computed = seq.num_computed_tokens
            req = seq.request
            # (a plain decoder drafts nothing: its tokens are its prompt's and its output's)
            if not req.plain_decode or computed != len(seq.prompt_token_ids) + len(seq.output_token_ids) - 1 + pending:
                return None
            # the in-flight token ends it by length: it is not launched again (plain decoders are never windowed)
            if pending and reaches_length(req.params, len(seq.output_token_ids) + 1, computed + 1, False, max_len):
                ending = [] if ending is None else ending
                ending.append(seq)
                continue
            if computed % bs == 0 and computed == len(seq.block_ids) * bs:  # its token starts a block
                if not self.kv.allocate(seq, 1):
                    return None  # out of blocks: `schedule` preempts
                batch.grew(seq)
        if ending:
            ending = set(ending)
            return [s for s in seqs if s not in ending]
        return seqs

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.batch.stale()  # this step may change any running sequence's blocks
        budget = self.config.max_num_batched_tokens
        foreground = any(not _background(q) for q in self.running) or any(not _background(q) for q in self.waiting)
        bg_budget = self.config.max_background_tokens * (1 if foreground else BACKGROUND_IDLE_FACTOR)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            bg = _background(seq)
            n = self._chunk(seq, min(budget, bg_budget) if bg else budget)
            if n == 0:  # a background sequence waits for the next step
                i += 1
                continue
            while not self.kv.allocate(seq, n):
                victim = self.running.pop()  # the newest
                self.batch.remove(victim)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                if bg:
                    bg_budget -= n
                i += 1
                continue
            break  # seq itself was preempted: nothing after it is left to schedule
        if out.preempted:
            return out  # admitting new work right after running out of blocks would only thrash
        max_bg_running = max(1, self.config.max_num_seqs // 2)
        num_bg_running = sum(1 for q in self.running if _background(q))
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = next((q for q in self.waiting if not _background(q)), self.waiting[0])  # foreground first
            bg = _background(seq)
            if bg and (bg_budget <= 0 or num_bg_running >= max_bg_running):
                break
            if seq.num_computed_tokens == 0 and not seq.block_ids:
                self.kv.attach_cached_prefix(seq, max_tokens=seq.max_cached_tokens())
            n = self._chunk(seq, min(budget, bg_budget) if bg else budget)
            if n == 0 or not self.kv.allocate(seq, n):
                self.kv.free(seq)  # give back the cached prefix it took; retried next step
                break
            self.waiting.remove(seq)
            if seq.scheduled_time is None:
                seq.scheduled_time = time.perf_counter()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.batch.add(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            if bg:
                bg_budget -= n
                num_bg_running += 1
        return out

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` computes this step: what it lacks, within the budget, and for a windowed sequence no
        further than its next eviction point (model/features/kv_window/schedule.py: the attended keys then never depend on
        how a sequence was chunked)."""
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        excess = seq.num_tokens - seq.num_computed_tokens - n
        if seq.draft_token_ids and excess > 0:  # verifying drafts takes every row's logits in one step: trim them
            del seq.draft_token_ids[max(0, len(seq.draft_token_ids) - excess):]
        window = seq.window
        return n if window is None else min(n, window.chunk_limit(seq.num_computed_tokens, self.kv.block_size))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.draft_token_ids.clear()  # proposals only: recomputing the sequence starts from its verified tokens
        self.kv.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq, front=True)
        out.preempted.append(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
