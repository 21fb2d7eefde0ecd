"""Structured outputs: a request's output constrained to a JSON schema, a regex, a choice or a grammar, per row.

- spec.py      `StructuredOutputSpec`: the typed field `RequestOptions.structured` carries (no grammar engine here);
- compiler.py  spec -> llguidance grammar, compiled once per distinct spec (LRU), and each sequence's state in it;
- masks.py     a step's allowed-token bitmask, filled on a worker thread while the forward runs, and its
               application to the constrained rows' logits;
- closing.py   a JSON reply near max_tokens closed in time (its last tokens close what is open);
- feature.py   the per-row feature the engine calls (model/features/protocol.py), holding one engine's compiler,
               cache and mask buffer (`StructuredOutputs`).
"""

from model.features.structured.compiler import CompiledGrammar, GrammarCompiler, SequenceGrammar
from model.features.structured.feature import Structured, StructuredOutputs
from model.features.structured.masks import AllowedTokens, GrammarMasks, PendingMasks, StepMasks
from model.features.structured.spec import StructuredOutputSpec

__all__ = ["AllowedTokens", "CompiledGrammar", "GrammarCompiler", "GrammarMasks", "PendingMasks", "SequenceGrammar",
           "StepMasks", "Structured", "StructuredOutputSpec", "StructuredOutputs"]
