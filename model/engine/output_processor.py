"""From the engine's steps to what clients read (vLLM's `output_processor`): each choice's incremental
detokenization, stop strings, prompt logprobs once, hidden states and the per-row features' per-token values with
their tokens, and the `RequestOutput` deltas.

The engine decides everything that needs no text (stop tokens, max_tokens, the context limit, a per-row feature's
end, aborts, errors) and appends the tokens itself; each step it hands over a `StepOutputs`: the choices with new
tokens, those tokens, and how the engine ended any of them. This processor owns the text: it may run on another
thread than the engine's step (AsyncEngine's output thread), touching only each choice's `OutputState`. A stop
string is the one end it finds itself: `process` returns those ends, and the engine finishes the choice when it
hears of them (the tokens a choice computed meanwhile are never sent).

A choice whose request asked for its final output only (`SamplingParams.output_kind == "final"`: a non-streamed
HTTP request) gets one `RequestOutput` when it ends, with every token, the whole text and every logprob; without stop
strings its text is decoded once, at the end, not token by token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from model.engine.end_of_sequence import Finish
from model.engine.request import FinishReason, Sequence
from model.engine.sampler import TokenLogprobs
from model.engine.sampling_params import SamplingParams
from model.engine.sequence_state import OutputState
from model.text.detokenizer import IncrementalDetokenizer
from model.text.stop_strings import StopStringMatcher
from model.text.tokenizer import Tokenizer

log = logging.getLogger("llamascope.engine")

__all__ = ["Extras", "Finish", "HiddenStates", "OutputProcessor", "RequestOutput", "StepOutputs"]


@dataclass
class RequestOutput:
    """What one step produced for one choice of a request (deltas, not totals; a final-only choice's one output
    holds everything)."""

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
    # the token's values of the per-row features the request carries, by feature (model/features/registry.py)
    features: dict[str, Any] = field(default_factory=dict)
    first_token_time: float | None = None  # time.perf_counter() when the choice's first token was processed
    scheduled_time: float | None = None  # time.perf_counter() when the scheduler first admitted the choice
    # a final-only output's gaps between the steps that brought its tokens (the inter-token latencies a
    # streamed choice's client would have seen; a streamed choice's are measured where its deltas arrive)
    token_gaps: list[float] | None = None

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
class Extras:
    """A choice's step besides its tokens: prompt logprobs scored, hidden states read (positions, (P, L, D)), the
    features' values of each of its tokens (by feature: one a token)."""

    prompt_logprobs: list[TokenLogprobs] | None = None
    hidden: tuple[list[int], torch.Tensor] | None = None
    per_token: dict[str, list] | None = None


@dataclass
class StepOutputs:
    """One engine step (or abort) as the output processor reads it (vLLM's `EngineCoreOutputs`): the choices that
    got tokens, in order, and their tokens (flat: `counts[i]` for choice i, one each when `counts` is None, which is
    every decode step); per token its logprobs where asked; the choices the engine ended (with or without tokens
    this step); each choice's extras."""

    seqs: list[Sequence] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    counts: list[int] | None = None
    logprobs: list[TokenLogprobs | None] | None = None
    finished: dict[Sequence, Finish] = field(default_factory=dict)
    extras: dict[Sequence, Extras] = field(default_factory=dict)

    def add(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs | None] | None = None) -> None:
        """Append a choice with any number of tokens (the general path; the decode path fills the lists itself)."""
        if self.counts is None:
            self.counts = [1] * len(self.seqs)
        if logprobs is not None and self.logprobs is None:
            self.logprobs = [None] * len(self.tokens)
        self.seqs.append(seq)
        self.tokens += tokens
        self.counts.append(len(tokens))
        if self.logprobs is not None:
            self.logprobs += logprobs if logprobs is not None else [None] * len(tokens)

    def extra(self, seq: Sequence) -> Extras:
        e = self.extras.get(seq)
        if e is None:
            e = self.extras[seq] = Extras()
        return e

    def __bool__(self) -> bool:
        return bool(self.seqs or self.finished or self.extras)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def new_state(self, params: SamplingParams) -> OutputState:
        return OutputState(
            detok=IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens),
            stops=StopStringMatcher(params.stop),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            final_only=params.output_kind == "final",
        )

    def process(self, step: StepOutputs, now: float) -> tuple[list[RequestOutput], list[tuple[Sequence, Finish]]]:
        """-> the deltas for clients, in order, and the choices processing ended: by a stop string, or by a failure
        of their own processing (which ends that choice with an error, not the others). `now`: the time
        (perf_counter) the step's tokens count as produced at."""
        outs: list[RequestOutput] = []
        ended: list[tuple[Sequence, Finish]] = []
        tokens, counts, logprobs, finished, extras = step.tokens, step.counts, step.logprobs, step.finished, step.extras
        for seq, extra in extras.items():  # prompt logprobs (a prefill chunk's, before any token), hidden states
            if not seq.output.done:
                self._take_extras(seq, extra)
        at = 0
        for i, seq in enumerate(step.seqs):
            n = 1 if counts is None else counts[i]
            state = seq.output
            if not state.done:  # (else ended by a stop string while the engine computed more: never sent)
                lps = logprobs[at : at + n] if logprobs is not None else None
                try:
                    match = self._append(seq, state, tokens[at : at + n], lps, finished.get(seq), extras.get(seq),
                                         now, outs)
                except Exception as e:  # this choice's text could not be made: it ends with an error
                    log.exception("output processing failed for request %s", seq.request.request_id)
                    end = Finish(FinishReason.ERROR, error=f"generation failed: {type(e).__name__}")
                    out = self._delta(seq, state)
                    self._end(state, out, end)
                    outs.append(out)
                    ended.append((seq, end))
                    match = None
                if match is not None:
                    ended.append((seq, Finish(FinishReason.STOP, match)))
            at += n
        for seq, end in finished.items():  # ended with no token this step (an abort, a failed step)
            state = seq.output
            if state.done:
                continue
            out = state.pending or self._delta(seq, state)
            self._end(state, out, end)
            outs.append(out)
        return outs, ended

    # ---- one choice -----------------------------------------------------------------------------------------

    def _append(self, seq: Sequence, state: OutputState, tokens: list[int], lps, end: Finish | None,
                extra: Extras | None, now: float, outs: list[RequestOutput]) -> str | None:
        """A choice's tokens of this step -> its delta(s) in `outs`; ended by the engine's `end`, or by a stop
        string, which is returned."""
        p = seq.request.params
        stop_token = end is not None and end.stop_token
        per_token = extra.per_token if extra is not None else None
        each = bool(per_token)  # every token its own delta, with its features' values
        if state.first_token_time is None:
            state.first_token_time = now
        final = state.final_only and not each
        out = state.pending if final and state.pending is not None else self._delta(seq, state)
        if final:
            state.pending = out
            if state.last_token_time is not None:
                out.token_gaps = out.token_gaps or []
                out.token_gaps.append(now - state.last_token_time)
            state.last_token_time = now
        matched = None
        for j, token in enumerate(tokens):
            if each and j:
                out.num_output_tokens = state.num_tokens
                outs.append(out)
                out = self._delta(seq, state)
            state.num_tokens += 1
            out.token_ids.append(token)
            if lps is not None and lps[j] is not None:
                out.logprobs = (out.logprobs or []) + [lps[j]]
            if each:
                out.features = {name: values[j] for name, values in per_token.items()}
            if state.pending_hidden:
                self._attach_hidden(seq, state, out)
            last = j == len(tokens) - 1
            if last and stop_token:  # the stop token's own text is not part of the completion (OpenAI, vLLM)
                out.text += state.stops.flush()
                break
            if final and not state.stops.stops:
                continue  # decoded once, at the end
            state.text_streamed = True
            delta = state.detok.feed(token)
            if last and end is not None:
                delta += state.detok.flush()
            if state.num_tokens >= p.min_tokens:  # stop strings do not end a choice before min_tokens
                text, matched = state.stops.feed(delta)
                out.text += text
                if matched is not None:
                    end = Finish(FinishReason.STOP, matched)
                    if not last and out.hidden_states is not None:
                        self._trim_hidden(seq, state, out)
                    break
            else:
                out.text += delta
        if end is None:
            if not final:
                out.num_output_tokens = state.num_tokens
                outs.append(out)
            return None
        if matched is None and not stop_token:  # held back as a possible stop string's start: it was not one
            out.text += state.stops.flush()
        if final and not state.text_streamed:
            ids = out.token_ids[:-1] if stop_token else out.token_ids
            out.text = self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        self._end(state, out, end)
        outs.append(out)
        return matched

    def _delta(self, seq: Sequence, state: OutputState) -> RequestOutput:
        """A new delta with the choice's counts (and its prompt logprobs, the first time)."""
        out = RequestOutput(seq.request.request_id, seq.index, num_prompt_tokens=seq.num_prompt_tokens,
                            num_output_tokens=state.num_tokens, num_cached_tokens=max(0, seq.num_cached_tokens),
                            first_token_time=state.first_token_time, scheduled_time=seq.scheduled_time)
        if state.prompt_logprobs is not None and not state.prompt_logprobs_sent:
            out.prompt_logprobs = state.prompt_logprobs
            state.prompt_logprobs_sent = True
        return out

    @staticmethod
    def _end(state: OutputState, out: RequestOutput, end: Finish) -> None:
        state.done, state.pending = True, None
        out.num_output_tokens, out.first_token_time = state.num_tokens, state.first_token_time
        out.finish_reason, out.stop_reason, out.error = end.reason.value, end.stop_reason, end.error

    @staticmethod
    def _take_extras(seq: Sequence, extra: Extras) -> None:
        state = seq.output
        if extra.prompt_logprobs is not None:
            state.prompt_logprobs += extra.prompt_logprobs
        if extra.hidden is not None:
            state.pending_hidden.append(extra.hidden)

    @staticmethod
    def _attach_hidden(seq: Sequence, state: OutputState, out: RequestOutput) -> None:
        """Hidden states read since the last delta go out with this token (prompt positions with the first)."""
        new = HiddenStates(seq.request.hidden_states.layers, [q for pos, _ in state.pending_hidden for q in pos],
                           torch.cat([v for _, v in state.pending_hidden]))
        state.pending_hidden = []
        old = out.hidden_states
        out.hidden_states = new if old is None else HiddenStates(old.layers, old.positions + new.positions,
                                                                 torch.cat([old.values, new.values]))

    @staticmethod
    def _trim_hidden(seq: Sequence, state: OutputState, out: RequestOutput) -> None:
        """Tokens verified after the one a stop string ended: their positions' reads go with them (one token at a
        time would never have computed those positions)."""
        h = out.hidden_states
        last = seq.num_prompt_tokens + state.num_tokens - 1  # the position of the last token sent
        keep = [i for i, q in enumerate(h.positions) if q < last]
        out.hidden_states = HiddenStates(h.layers, [h.positions[i] for i in keep], h.values[keep]) if keep else None
