"""The speculator: the engine's `Drafter` for a `SpeculativeConfig`. It decides how many tokens each row drafts and
counts what was drafted, accepted and emitted.

Each row's number of drafts follows its own recent acceptance, as Hugging Face's assisted generation schedules it
(`num_assistant_tokens_schedule="heuristic"`, transformers/generation/candidate_generator.py): two more after a step
that kept every draft, one fewer after one that did not, between 1 and the configured K (and at most the request's
own `num_speculative_tokens`). Past `disable_by_batch_size` running sequences nothing is drafted: a CPU step over a
large batch is compute-bound, and every rejected row costs what it computed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from model.engine.request import Sequence
from model.engine.speculative.config import SpeculativeConfig


@dataclass
class SpecDecodeStats:
    """Counters since start (vLLM's spec_decode metrics): steps that verified drafts, draft tokens verified, of which
    accepted, tokens emitted by those steps (accepted + the one sampled after them), and acceptances per draft
    position (position i: the (i+1)-th draft of a row was kept)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               self.num_emitted_tokens, list(self.accepted_per_position),
                               list(self.drafted_per_position))


# propose(seqs, ks) -> drafts: one list per sequence, at most ks[i] long
Proposer = Callable[[list[Sequence], list[int]], list[list[int]]]


class Speculator:
    def __init__(self, config: SpeculativeConfig, propose: Proposer, release: Callable[[Sequence], None]) -> None:
        self.config = config
        self._propose, self._release = propose, release
        self._k: dict[Sequence, int] = {}  # each drafting row's current number of drafts
        K = config.num_speculative_tokens
        self.stats = SpecDecodeStats(accepted_per_position=[0] * K, drafted_per_position=[0] * K)

    def propose(self, seqs: list[Sequence], max_drafts: list[int], num_running: int) -> list[list[int]]:
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running >= limit:
            return [[] for _ in seqs]
        K = self.config.num_speculative_tokens
        ks = [min(self._k.get(s, K), m) for s, m in zip(seqs, max_drafts)]
        return self._propose(seqs, ks)

    def resolved(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        s.num_emitted_tokens += num_accepted + 1
        for i in range(num_drafts):
            s.drafted_per_position[i] += 1
            s.accepted_per_position[i] += i < num_accepted
        K = self.config.num_speculative_tokens
        k = self._k.get(seq, K)
        self._k[seq] = min(K, k + 2) if num_accepted == num_drafts else max(1, k - 1)

    def release(self, seq: Sequence) -> None:
        self._k.pop(seq, None)
        self._release(seq)
