"""From sampled tokens to what clients read (vLLM's `output_processor`): each choice's incremental detokenization,
stop tokens and stop strings, the length limits, prompt logprobs once, and the `RequestOutput` deltas.

It decides when a sequence ends and why; the engine then takes it out of the scheduler and frees its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.engine.request import FinishReason, Sequence
from model.engine.sampler import TokenLogprobs
from model.engine.sampling_params import SamplingParams
from model.engine.telemetry import TokenTelemetry
from model.engine.sequence_state import OutputState
from model.text.detokenizer import IncrementalDetokenizer
from model.text.stop_strings import StopStringMatcher
from model.text.tokenizer import Tokenizer



@dataclass
class RequestOutput:
    """What one step produced for one choice of a request (deltas, not totals)."""

    request_id: str
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once, with the first token
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # so far, this choice
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    hidden_states: HiddenStates | None = None  # the block outputs read since the last delta (the request asked)
    telemetry: TokenTelemetry | None = None  # the token's attention telemetry, when the request asked for it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class HiddenStates:
    """Block outputs (the residual stream) of some positions of a sequence: values (n_positions, n_layers, D)."""

    layers: list[int]
    positions: list[int]
    values: torch.Tensor  # float32, on the CPU


@dataclass
class Finish:
    reason: FinishReason
    stop_reason: int | str | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer, self.max_model_len = tokenizer, max_model_len

    def new_state(self, params: SamplingParams) -> OutputState:
        return OutputState(
            detok=IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens),
            stops=StopStringMatcher(params.stop),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    def add_prompt_logprobs(self, seq: Sequence, logprobs: list[TokenLogprobs]) -> None:
        seq.output.prompt_logprobs += logprobs
        seq.num_scored_prompt_positions = len(seq.output.prompt_logprobs) - 1

    def add_hidden_states(self, seq: Sequence, positions: list[int], values: torch.Tensor) -> None:
        seq.output.pending_hidden.append((positions, values))

    def append(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> tuple[RequestOutput, Finish | None]:
        """Append a sampled token: the output delta, and how the sequence ends if it does."""
        p, state, sampling = seq.request.params, seq.output, seq.sampling
        seq.output_token_ids.append(token)
        out = self.output(seq)
        out.token_ids = [token]
        out.logprobs = [lp] if lp is not None else None
        if state.pending_hidden:  # with the token whose position (or prompt) they were read at
            out.hidden_states = HiddenStates(seq.request.hidden_states.layers,
                                             [q for pos, _ in state.pending_hidden for q in pos],
                                             torch.cat([v for _, v in state.pending_hidden]))
            state.pending_hidden = []
        n_out = len(seq.output_token_ids)
        may_stop = n_out >= p.min_tokens  # neither stop tokens nor stop strings end it before min_tokens
        if may_stop and token in sampling.stop_ids:
            # The stop token's own text is not part of the completion (OpenAI / vLLM); text held back as a
            # possible stop-string start turned out not to be one.
            out.text = state.stops.flush()
            return out, Finish(FinishReason.STOP, token if token in p.stop_token_ids else None)
        # [structured outputs] advance the grammar; a complete grammar ends the choice like a stop (min_tokens aside)
        grammar_done = sampling.grammar is not None and sampling.grammar.accept(token)
        # a windowed sequence's cache stays within the context however long it runs: only max_tokens ends it
        ending = grammar_done or n_out >= p.max_tokens or (seq.num_tokens >= self.max_model_len and seq.window is None)
        delta = state.detok.feed(token) + (state.detok.flush() if ending else "")
        if may_stop:
            out.text, matched = state.stops.feed(delta)
            if matched is not None:
                return out, Finish(FinishReason.STOP, matched)
        else:
            out.text = delta
        if ending:
            out.text += state.stops.flush()
            # a reply closed because max_tokens was near (structured/closing.py) ends with "length", not "stop"
            done = grammar_done and not sampling.grammar.closing
            return out, Finish(FinishReason.STOP if done else FinishReason.LENGTH)
        return out, None

    def append_all(self, seq: Sequence, sampled: list[tuple[int, TokenLogprobs | None]], each: bool = False
                   ) -> tuple[list[RequestOutput], Finish | None]:
        """Append the tokens one step produced for `seq` (a drafting sequence's accepted drafts and the token after
        them), stopping at the first that ends it: what follows a stop is never appended or sent. One delta for them
        all, or with `each` one per token (attention telemetry: every token its own chunk)."""
        outs: list[RequestOutput] = []
        finish = None
        for token, lp in sampled:
            out, finish = self.append(seq, token, lp)
            if each or not outs:
                outs.append(out)
            else:
                merged = outs[0]
                merged.token_ids += out.token_ids
                merged.text += out.text
                if out.logprobs is not None:
                    merged.logprobs = (merged.logprobs or []) + out.logprobs
                merged.num_output_tokens = out.num_output_tokens
            if finish is not None:
                break
        first = outs[0]
        if finish is not None and sum(len(o.token_ids) for o in outs) < len(sampled) and first.hidden_states is not None:
            # drafts verified after the one that ended it: their positions' reads go with them (one token at a
            # time would never have computed those positions)
            h = first.hidden_states
            keep = [i for i, p in enumerate(h.positions) if p < seq.num_tokens - 1]
            first.hidden_states = HiddenStates(h.layers, [h.positions[i] for i in keep], h.values[keep]) if keep else None
        return outs, finish

    def output(self, seq: Sequence) -> RequestOutput:
        """A delta with the sequence's counts (and its prompt logprobs, the first time); tokens and text empty."""
        state = seq.output
        out = RequestOutput(
            seq.request.request_id, seq.index,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            num_cached_tokens=max(0, seq.num_cached_tokens),
        )
        if state.prompt_logprobs is not None and not state.prompt_logprobs_sent:
            out.prompt_logprobs = state.prompt_logprobs
            state.prompt_logprobs_sent = True
        if seq.finish_reason is not None:
            out.finish_reason, out.stop_reason = seq.finish_reason.value, seq.stop_reason
        return out
