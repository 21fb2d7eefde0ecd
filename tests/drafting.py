"""A `Drafter` (model/engine/speculative/drafter.py) from a function of one sequence, for tests that script drafts."""

from __future__ import annotations

from collections.abc import Callable

from model.engine.request import Sequence


class PerSequence:
    def __init__(self, draft: Callable[[Sequence], list[int]]) -> None:
        self.draft = draft
        self.resolutions: list[tuple[int, int]] = []  # (drafts, accepted) per verified row

    def propose(self, seqs: list[Sequence], max_drafts: list[int], num_running: int) -> list[list[int]]:
        return [list(self.draft(s))[:m] for s, m in zip(seqs, max_drafts)]

    def resolved(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        self.resolutions.append((num_drafts, num_accepted))

    def release(self, seq: Sequence) -> None:
        pass
