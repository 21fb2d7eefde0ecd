"""A choice's state beside its tokens, split by who reads it: the sampling side (`SamplingState`: its seeded
generator, the ids that end it; the runner hands these to the sampler) and the output side (`OutputState`: the
streaming detokenizer, the stop-string matcher, prompt logprobs and hidden states not yet delivered; the output
processor's alone). `Sequence.sampling` and `Sequence.output` hold them; the per-row features' state of the choice is
`Sequence.state`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from model.text.detokenizer import IncrementalDetokenizer
from model.text.stop_strings import StopStringMatcher

if TYPE_CHECKING:
    from model.engine.sampler import SamplingRow, TokenLogprobs


@dataclass
class SamplingState:
    generator: torch.Generator | None  # a seeded request's per-choice stream (None: the global one)
    # ids that end this choice (min_tokens aside): its stop_token_ids, plus the checkpoint's EOS set unless
    # ignore_eos; fixed for the request's life, so built once rather than per generated token
    stop_ids: frozenset[int]
    row: SamplingRow | None = None  # what the sampler reads of it (its output list is the sequence's own, live)


@dataclass
class OutputState:
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    prompt_logprobs: list[TokenLogprobs | None] | None  # [None] for token 0, then one per scored prompt token
    final_only: bool = False  # one output when the choice ends (SamplingParams.output_kind "final")
    prompt_logprobs_sent: bool = False
    # hidden states read and not yet delivered (prompt positions wait for the first token's delta)
    pending_hidden: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)
    num_tokens: int = 0  # tokens processed (sent, or held for a final-only output)
    first_token_time: float | None = None
    last_token_time: float | None = None  # a final-only choice's: when its last step's tokens were processed
    text_streamed: bool = False  # its text decoded token by token (else, final-only, once at the end)
    # a final-only choice's output (an output_processor.RequestOutput, which sits above this module), filled
    # step by step
    pending: object | None = None
    done: bool = False  # its final output went out: anything the engine still sends for it is dropped
