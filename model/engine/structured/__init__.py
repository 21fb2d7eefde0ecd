"""Structured outputs: a request's output constrained to a JSON schema, a regex, a choice or a grammar, per row.

- spec.py      `StructuredOutputSpec`: the typed field `SamplingParams.structured` carries (no grammar engine here);
- compiler.py  spec -> llguidance grammar, compiled once per distinct spec (LRU), and each sequence's state in it;
- masks.py     a step's allowed-token bitmask, filled on a worker thread while the forward runs;
- closing.py   a JSON reply near max_tokens closed in time (its last tokens close what is open).

`StructuredOutputs` is what the engine holds: its hooks (model/engine/engine.py) are `compile` when a request is
added, `start_masks` before the forward, the sampler's `allowed=` argument, and `SequenceGrammar.accept` after each
appended token.
"""

from __future__ import annotations

from collections.abc import Sequence

from model.engine.structured.compiler import CompiledGrammar, GrammarCompiler, SequenceGrammar
from model.engine.structured.masks import GrammarMasks, PendingMasks
from model.engine.structured.spec import StructuredOutputSpec
from model.text.tokenizer import Tokenizer

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarMasks", "PendingMasks", "SequenceGrammar",
           "StructuredOutputSpec", "StructuredOutputs"]


class StructuredOutputs:
    """The engine's structured-output machinery: one compiler (and cache) and one mask buffer per engine."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_num_seqs: int, overlap: bool = True) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size)
        self.masks = GrammarMasks(vocab_size, max_num_seqs, overlap=overlap)

    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        return self.compiler.compile(spec)

    def start_masks(self, rows: Sequence[tuple[SequenceGrammar | None, Sequence[int], int, Sequence[int]]]) -> PendingMasks | None:
        return self.masks.start(rows)
