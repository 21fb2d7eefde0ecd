"""The speculator: the engine's `Drafter` for a `SpeculativeConfig`. It decides how many tokens each row drafts and
counts what was drafted, accepted and emitted.

Each row drafts the number of tokens k that maximises the step's expected tokens per unit of cost. With a per-draft
acceptance rate a (the row's own, from its recent verifications), k drafts emit (1 - a^(k+1)) / (1 - a) tokens on
average (Leviathan et al. 2023, eq. 1). In units of what one token of a B-row step costs, a step of B rows costs B
and one more row c_B = B (ROW_COST + draft_cost) / (1 + (B - 1) ROW_COST): a row is nearly free beside a one-row
step, whose cost is reading the weights, and costs a whole token's worth in a large batch, which is compute-bound.
So k maximises (B - 1 + E(k)) / (B + k c_B), and is 0 (no drafts) when no k beats one token a row: speculation
backs off by itself as the batch grows. The rate is a decayed count of accepted and rejected drafts, so a row that
stops copying its input stops drafting within a few steps; while it does not draft its rejections fade, so it tries
again. From `disable_by_batch_size` running sequences on, nothing is drafted at all."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from model.engine.request import Sequence
from model.engine.speculative.config import SpeculativeConfig

# What one more row of a speculating sequence costs, as a fraction of a one-token decode step. On a CPU a verified
# row is not free as it is on a GPU: past one row the matmuls are bound by arithmetic, not by reading the weights
# (docs/performance.md#speculative-decoding has the step times this was set from). A draft model adds its own step
# per draft token.
ROW_COST = 0.25
DECAY = 0.7  # weight of a row's earlier verifications against its latest one
PRIOR = (1.0, 1.0)  # (accepted, rejected) pseudo-counts a row starts with: a = 0.5


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
    def __init__(self, config: SpeculativeConfig, propose: Proposer, release: Callable[[Sequence], None],
                 draft_cost: float = 0.0) -> None:
        """`draft_cost`: what proposing one token costs, as a fraction of the target's one-token step (0 for
        n-gram lookup; a draft model's step time over the target's)."""
        self.config = config
        self._propose, self._release = propose, release
        self._counts: dict[Sequence, tuple[float, float]] = {}  # each row's decayed (accepted, rejected) drafts
        K = config.num_speculative_tokens
        self.stats = SpecDecodeStats(accepted_per_position=[0] * K, drafted_per_position=[0] * K)
        # the cost model's two figures (tests set both to 0: every row drafts all it may)
        self.row_cost, self.draft_cost = ROW_COST, draft_cost
        self._tables: dict[tuple, list[int]] = {}  # (batch size, costs) -> best k by acceptance rate

    def propose(self, seqs: list[Sequence], max_drafts: list[int], num_running: int) -> list[list[int]]:
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running >= limit:
            return [[] for _ in seqs]
        ks = [min(self.k_for(s, num_running), m) for s, m in zip(seqs, max_drafts)]
        for s, k in zip(seqs, ks):
            if k == 0:  # not drafting: its rejections fade, so it tries again in a few steps
                acc, rej = self._counts.get(s, PRIOR)
                self._counts[s] = (acc, DECAY * rej)
        go = [i for i, k in enumerate(ks) if k > 0]
        out: list[list[int]] = [[] for _ in seqs]
        if go:
            for i, drafts in zip(go, self._propose([seqs[i] for i in go], [ks[i] for i in go])):
                out[i] = drafts
        return out

    def k_for(self, seq: Sequence, batch: int = 1) -> int:
        """The drafts that maximise the step's expected tokens per unit of cost at this row's acceptance rate."""
        key = (batch, self.row_cost, self.draft_cost)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = best_k_table(self.config.num_speculative_tokens, batch, self.row_cost,
                                                     self.draft_cost)
        acc, rej = self._counts.get(seq, PRIOR)
        return table[int(acc / (acc + rej) * (len(table) - 1))]

    def resolved(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        s.num_emitted_tokens += num_accepted + 1
        for i in range(num_drafts):
            s.drafted_per_position[i] += 1
            s.accepted_per_position[i] += i < num_accepted
        acc, rej = self._counts.get(seq, PRIOR)
        self._counts[seq] = (DECAY * acc + num_accepted, DECAY * rej + (num_accepted < num_drafts))

    def release(self, seq: Sequence) -> None:
        self._counts.pop(seq, None)
        self._release(seq)


def best_k_table(K: int, batch: int, row_cost: float, draft_cost: float, steps: int = 100) -> list[int]:
    """best[i]: the k in 0..K maximising (B - 1 + E(k)) / (B + k c_B) at a = i / steps (the module's docstring)."""
    B = batch
    c = B * (row_cost + draft_cost) / (1 + (B - 1) * row_cost)
    best = []
    for i in range(steps + 1):
        a = min(i / steps, 0.999)
        gains = [(B - 1 + (1 - a ** (k + 1)) / (1 - a)) / (B + k * c) for k in range(K + 1)]
        best.append(max(range(K + 1), key=gains.__getitem__))
    return best
