"""What a loader needs to read only one tensor-parallel rank's part of a checkpoint (model/parallel/plan.py's
`ShardPlan` is the implementation): the loaders know this protocol, never the parallel package."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from model.config import ModelConfig


class WeightShard(Protocol):
    @property
    def local_config(self) -> ModelConfig:
        """The shapes this rank's modules have (its share of heads and FFN width)."""
        ...

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """Our parameter name -> (dim, start, stop) of the full tensor this rank holds; None: replicated."""
        ...


# The whole model's config (read from the file) -> this rank's shard of it.
ShardFor = Callable[[ModelConfig], WeightShard]
