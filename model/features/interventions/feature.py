"""Interventions as a per-row feature (model/features/protocol.py), for the stages that are the feature's own: the
request's plan, made once against its prompt at admission (`InterventionPlan`, model/interventions.py), and each
block's share of the prefix-cache key (`InterventionPlan.block_digest`: a block computed under edits is never
served to a request without them, and a request whose edits start later shares the blocks before them).

The step's edits themselves stay in the one table a step shares with hidden-state reads (model/edits.py's
`StepEdits`, built by the runner and applied by every path through `ForwardContext.edits`)."""

from __future__ import annotations

from typing import Any

from model.features.protocol import Feature
from model.interventions import HeadShape, Intervention, InterventionPlan


class Interventions(Feature):
    name = "interventions"

    def admit(self, value: tuple[Intervention, ...], num_prompt_tokens: int, model_config: Any) -> InterventionPlan:
        c = model_config
        return InterventionPlan(list(value), num_prompt_tokens, c.n_layers, c.dim, HeadShape.of(c))

    @classmethod
    def block_key(cls, state: InterventionPlan, start: int, end: int) -> bytes | None:
        return state.block_digest(start, end)
