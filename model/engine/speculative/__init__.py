"""Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et
al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"): a proposer drafts tokens after
each decoding sequence's last one, the engine verifies them in its own batched step (rows of several tokens,
model/engine/engine.py) and keeps those the target model's samples agree with. Configured as vLLM's
`speculative_config` is (config.py): n-gram prompt lookup (ngram.py) or a draft model (draft_model.py); the
speculator (speculator.py) sizes each row's drafts and counts what was drafted and accepted; verification.py is the
engine's bookkeeping of them (proposed before a step, resolved after it)."""

from model.engine.speculative.config import SpeculativeConfig
from model.engine.speculative.drafter import Drafter
from model.engine.speculative.speculator import SpecDecodeStats, Speculator
from model.engine.speculative.verification import Verification

__all__ = ["Drafter", "SpecDecodeStats", "SpeculativeConfig", "Speculator", "Verification"]
