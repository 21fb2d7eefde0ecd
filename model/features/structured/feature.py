"""Structured output as a per-row feature (model/features/protocol.py): each stage of a constrained request.

    check     the spec compiles (into this engine's cache, thread-safe: the service asks on a worker thread, so the
              engine thread's own `admit` is a cache hit); InvalidOption naming the request field it came from
    admit     the request's compiled grammar; `start` gives each choice its own state in it (n > 1: one each)
    prepare   the step's sampled rows' masks, started on a worker thread before the forward (masks.py); its part's
              `mask_logits` applies them to those rows' logits before the sampler
    accept    each token appended to a choice advances its state: a grammar that reached its end ends the choice
              ("stop"; "length" when a closing plan closed it because max_tokens was near, closing.py)
    drafts    speculative drafts are verified only as far as the grammar accepts them (none near max_tokens,
              where a closing plan may force tokens); the accepted ones then come through `accept` one by one

Rows carrying a grammar are not plain decoders (the default `plain`): their steps take the general step, where
the masks are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from model.features.protocol import Feature, InvalidOption, SequenceView, StepView
from model.features.structured.compiler import CompiledGrammar, GrammarCompiler, SequenceGrammar
from model.features.structured.masks import GrammarMasks, PendingMasks, StepMasks
from model.features.structured.spec import StructuredOutputSpec
from model.text.tokenizer import Tokenizer


class StructuredOutputs:
    """One engine's structured-output machinery: one compiler (and cache) and one mask buffer."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_num_seqs: int, overlap: bool = True) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size)
        self.masks = GrammarMasks(vocab_size, max_num_seqs, overlap=overlap)

    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        return self.compiler.compile(spec)

    def start_masks(self, rows: Sequence[tuple[SequenceGrammar | None, Sequence[int], int, Sequence[int]]]) -> PendingMasks | None:
        return self.masks.start(rows)


class Structured(Feature):
    name = "structured"

    def __init__(self, engine) -> None:
        super().__init__(engine)
        # nothing is built until used; masks overlap the forward only off-CPU: on CPU the forward owns every core
        # (benchmarks/bench_structured.py)
        self.outputs = StructuredOutputs(engine.tokenizer, engine.vocab_size, engine.max_num_seqs,
                                         overlap=engine.device != "cpu")
        self._shifts: torch.Tensor | None = None  # (32,) int32 bit positions, on the step's device

    def check(self, value: StructuredOutputSpec) -> None:
        try:
            self.outputs.compile(value)
        except ValueError as e:
            raise InvalidOption(value.source, str(e)) from None

    def admit(self, value: StructuredOutputSpec, num_prompt_tokens: int, model_config: Any) -> CompiledGrammar:
        return self.outputs.compile(value)  # `check` compiled it: a cache hit

    def start(self, state: CompiledGrammar) -> SequenceGrammar:
        return state.new_state()

    @classmethod
    def accept(cls, state: SequenceGrammar, token: int) -> str | None:
        if state.accept(token):
            return "length" if state.closing else "stop"
        return None

    @classmethod
    def drafts(cls, state: SequenceGrammar, seq: SequenceView, drafts: list[int]) -> list[int]:
        return state.valid_drafts(drafts, seq.request.params.max_tokens - len(seq.output_token_ids))

    def prepare(self, step: StepView) -> StepMasks | None:
        rows = _mask_rows(step.sample, self.name)
        if rows is None:
            return None
        pending = self.outputs.start_masks(rows)
        if pending is None:
            return None
        if self._shifts is None or self._shifts.device.type != torch.device(step.device).type:
            self._shifts = torch.arange(32, dtype=torch.int32, device=step.device)
        return StepMasks(pending, self._shifts)


def _mask_rows(sample: list[tuple[SequenceView, int]], name: str) -> list[tuple] | None:
    """One entry per sampled row: (grammar, output token ids, tokens left, drafts) for a sequence's first row
    (drafts: the rows after it verify them, masked as the grammar stands after each draft), (None, (), 0, ()) for
    those rows and for rows without a grammar. None when no row has one."""
    rows, prev, any_grammar = [], None, False
    for seq, _ in sample:
        grammar = seq.state.get(name) if seq is not prev else None
        if grammar is None:
            rows.append((None, (), 0, ()))
        else:
            any_grammar = True
            rows.append((grammar, seq.output_token_ids,
                         seq.request.params.max_tokens - len(seq.output_token_ids), seq.draft_token_ids))
        prev = seq
    return rows if any_grammar else None
