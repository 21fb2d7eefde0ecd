"""The engine's speculator for a `SpeculativeConfig`: its proposer built over the engine's sizes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from model.engine.engine_sizes import EngineSizes
from model.engine.speculative.config import SpeculativeConfig
from model.engine.speculative.draft_model import DraftModelProposer
from model.engine.speculative.ngram import NgramProposer
from model.engine.speculative.speculator import Speculator

if TYPE_CHECKING:
    from model.transformer import Transformer


def build_speculator(config: SpeculativeConfig, target: Transformer, draft_model: Transformer | None,
                     sizes: EngineSizes, *, distributed: bool) -> Speculator:
    """The speculator for an engine of these sizes (the draft model's KV pool holds as many tokens as the engine's).
    ValueError when the configuration does not fit the engine (a draft model missing or of another vocabulary)."""
    if config.method == "ngram":
        ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        return Speculator(config, lambda seqs, ks: [ngram.propose(s, k) for s, k in zip(seqs, ks)], ngram.release)
    if draft_model is None:
        raise ValueError("speculative method 'draft_model' needs the draft model loaded (Engine(draft_model=...))")
    V, Vd = target.config.vocab_size, draft_model.config.vocab_size
    if Vd != V:
        raise ValueError(f"the draft model's vocabulary ({Vd} tokens) differs from the served model's ({V})")
    if distributed:
        raise ValueError("a draft model with tensor parallelism is not supported (the ngram method is)")
    proposer = DraftModelProposer(draft_model, sizes)
    # a one-row decode step reads every weight once: the draft's step costs about its share of the bytes
    return Speculator(config, proposer.propose, proposer.release,
                      draft_cost=_weight_bytes(draft_model) / max(1, _weight_bytes(target)))


def _weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
