"""Requests and sequences as the scheduler and engine see them (torch-free bookkeeping).

A `Request` is what a client submitted: one prompt, sampling parameters, n choices. Each choice is a `Sequence`:
prompt + generated tokens, how many of them have K/V computed in the cache (`num_computed_tokens`, which catches
up with `num_tokens` as vLLM's v1 scheduler has it), and the blocks that hold them.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from model.engine.request_options import PLAIN, RequestOptions
from model.features import registry as features

if TYPE_CHECKING:
    from model.features.kv_window import KVWindow
    from model.engine.sequence_state import OutputState, SamplingState
    from model.engine.sampling_params import SamplingParams
    from model.interventions import HiddenStateRead, InterventionPlan


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # the client went away or asked to cancel
    ERROR = "error"  # the step that held it failed


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: "Request"
    index: int  # choice index within the request
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    # tokens proposed after the output and not verified yet (`Engine.drafter`): computed in the same step as the
    # last output token, each of their rows sampled; the step keeps those the samples agree with and rolls back the
    # K/V of the rest (`Verification.resolve`, model/engine/speculative/verification.py)
    draft_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # bumped by the KV manager whenever block_ids changes other than by blocks appended at its end (a rollback, an
    # eviction, a free, a cached prefix attached), so the persistent batch knows to rewrite its row
    block_table_version: int = 0
    slot: int = -1  # its row in the running batch (model/engine/persistent_batch.py), -1 when not running
    sample_row: int = -1  # its row among the samples of the last decode step launched for it (the overlapped step)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of this sequence's full blocks
    num_committed_blocks: int = 0  # leading blocks already registered in the prefix cache
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first schedule (-1: not yet)
    num_preemptions: int = 0
    # time.perf_counter() when the scheduler first admitted it (a preempted sequence keeps its first): the end of its
    # time in the queue, as vLLM's `scheduled_ts` (vllm/v1/metrics/stats.py); None while it has never run
    scheduled_time: float | None = None
    # a kv_window's sequence (model/features/kv_window/schedule.py): non-sink tokens evicted from its cache so far;
    # token t >= S of such a sequence sits at cache position t - num_evicted
    num_evicted: int = 0
    # under the model's sliding window (ModelConfig.sliding_window): leading blocks of block_ids given back to the
    # pool, no query of the sequence attending to their positions any more (KVCacheManager.release_behind_window);
    # their ids stay in the table, never read
    num_released_blocks: int = 0
    # prompt positions whose logits have been scored for prompt logprobs (position j scores prompt token j + 1)
    num_scored_prompt_positions: int = 0
    # positions whose hidden states (the request's `hidden_states` read) have been taken: never read twice, even
    # when a preemption recomputes them
    num_read_positions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # its state beside its tokens (model/engine/sequence_state.py): the sampler's side (seeded generator, stop ids)
    # and the output processor's (detokenizer, stop strings, prompt logprobs and hidden states to deliver)
    sampling: SamplingState | None = None
    output: OutputState | None = None
    # the per-row features' state of this choice, by feature (`Feature.start`, model/features/registry.py)
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Prompt + output + drafts: the tokens whose K/V the sequence computes."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + len(self.draft_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def last_token_id(self) -> int:
        """The last token of prompt + output (a decode row's input)."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output + drafts, without concatenating the whole list."""
        P, O = len(self.prompt_token_ids), len(self.output_token_ids)
        if end <= P:  # a prompt chunk
            return self.prompt_token_ids[start:end]
        if start >= P and end <= P + O:  # a decode row
            return self.output_token_ids[start - P : end - P]
        out: list[int] = []
        for part in (self.prompt_token_ids, self.output_token_ids, self.draft_token_ids):
            n = len(part)
            if start < n and end > 0:
                out += part[max(0, start) : min(n, end)]
            start, end = start - n, end - n
        return out

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def window(self) -> "KVWindow | None":
        """The request's sink + window cache, or None (the whole sequence stays cached)."""
        return self.request.options.kv_window

    @property
    def cache_len(self) -> int:
        """Cache positions in use: the computed tokens less those evicted."""
        return self.num_computed_tokens - self.num_evicted

    def max_cached_tokens(self) -> int | None:
        """Tokens the prefix cache may supply at (re)admission; None: no limit. Prompt logprobs still owed need the
        logits of their positions, so those positions are computed, never taken from the cache (vLLM does the
        same): the cache may supply only the positions already scored, whatever admission this is. Hidden states
        still owed for prompt positions are the same: computed, not cached."""
        limits = []
        if getattr(self.request.params, "prompt_logprobs", None) is not None \
                and self.num_scored_prompt_positions < self.num_prompt_tokens - 1:
            limits.append(self.num_scored_prompt_positions)
        read = self.request.hidden_states
        if read is not None:
            first = read.first_prompt_position(self.num_prompt_tokens, self.num_read_positions)
            if first is not None:
                limits.append(first)
        first = features.max_cached_tokens(self)  # the per-row features' prompt rows still to read, likewise
        if first is not None:
            limits.append(first)
        return min(limits) if limits else None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    # n > 1: choices after the first wait here until the first's prompt is in the cache, then share its blocks
    pending_siblings: list[Sequence] = field(default_factory=list)
    # everything it carries beside prompt and sampling (model/engine/request_options.py)
    options: RequestOptions = PLAIN
    # the per-row features' per-request state, by feature (`Feature.admit`, model/features/registry.py)
    state: dict[str, Any] = field(default_factory=dict)
    # the root of its blocks' prefix-cache hash chain: b"" for the base model, else the features' (`prefix_key`)
    prefix_root: bytes = b""
    # Its rows need nothing per step but tokens, positions and block tables: no kv window, edits, reads,
    # registered per-row feature (model/features/registry.py, `plain`) or background budget. A step whose every row
    # is such a decode row takes the engine's decode path (`Scheduler.schedule_decode`, `ModelRunner.execute_decode`).
    plain_decode: bool = False
    # ... and every row is `Sampler`'s plain greedy row: an argmax and nothing else
    plain_greedy: bool = False
    # ... and its rows can be launched before the host has its previous token (the engine's overlapped step): no
    # sampling step reads the tokens so far (penalties), and no min_tokens counts them
    overlappable: bool = False

    def __post_init__(self) -> None:
        o, p = self.options, self.params
        self.plain_decode = (o.kv_window is None and features.plain(o) and not o.background
                             and o.hidden_states is None)
        if p is None:  # (bookkeeping tests build requests without sampling)
            return
        penalties = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        self.overlappable = self.plain_decode and not penalties and p.min_tokens == 0 and not p.score_token_ids
        self.plain_greedy = (self.overlappable and p.greedy and p.logprobs is None and not p.logit_bias)

    @property
    def interventions(self) -> "InterventionPlan | None":
        """Its options' edits, planned against its prompt (the interventions feature's state)."""
        return self.state.get("interventions")

    @property
    def hidden_states(self) -> "HiddenStateRead | None":
        return self.options.hidden_states

    @property
    def is_finished(self) -> bool:
        return not self.pending_siblings and all(s.is_finished for s in self.seqs)
