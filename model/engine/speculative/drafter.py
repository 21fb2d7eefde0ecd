"""`Drafter`: what the engine asks for drafts and tells what became of them (model/engine/engine.py's `drafter`)."""

from __future__ import annotations

from typing import Protocol

from model.engine.request import Sequence


class Drafter(Protocol):
    def propose(self, seqs: list[Sequence], max_drafts: list[int], num_running: int) -> list[list[int]]:
        """Before a step: for each decoding sequence (its K/V computed up to its last token), at most max_drafts[i]
        tokens to verify after that token; `num_running`: the batch's size."""
        ...

    def resolved(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """After the step that verified `seq`'s drafts: the first `num_accepted` of `num_drafts` were kept."""
        ...

    def release(self, seq: Sequence) -> None:
        """`seq` has finished: drop what the drafter keeps for it."""
        ...
