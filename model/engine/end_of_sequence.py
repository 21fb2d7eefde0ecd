"""The end-of-sequence rule, written once: when an appended token ends a choice, and how.

Every step that appends tokens asks `finish_after` once per token, in order: the general step (`Engine._append`,
a drafting sequence's kept tokens one by one), the decode step and the overlapped step (`Engine._land`). The
scheduler asks `reaches_length` ahead of a token it has not read yet (an overlapped step's rows whose in-flight
token ends them by length are not launched again: `Scheduler.schedule_decode`). vLLM keeps its rule in one
function too (vllm/v1/core/sched/utils.py, `check_stop`, asked once per appended token).
"""

from __future__ import annotations

from dataclasses import dataclass

from model.engine.request import FinishReason, Sequence
from model.engine.sampling_params import SamplingParams
from model.features import registry as features


@dataclass
class Finish:
    reason: FinishReason
    stop_reason: int | str | None = None
    error: str | None = None
    stop_token: bool = False  # ended by a stop token (EOS or stop_token_ids): its text is not part of the output


def reaches_length(params: SamplingParams, num_output: int, num_tokens: int, windowed: bool, max_model_len: int) -> bool:
    """Whether a choice with `num_output` output tokens of `num_tokens` in all is at its length: max_tokens, or the
    context (a windowed sequence's cache stays within the context however long it runs: only max_tokens ends it)."""
    return num_output >= params.max_tokens or (num_tokens >= max_model_len and not windowed)


def finish_after(seq: Sequence, token: int, max_model_len: int) -> Finish | None:
    """`token`, just appended to `seq`'s output: how it ends the choice, or None. In order: a stop token (EOS or
    stop_token_ids, not before min_tokens), the per-row features' say (each advanced here by the token:
    `Feature.accept`, model/features/registry.py; "stop" or "length" where one ends the choice), then
    `reaches_length`."""
    p, sampling = seq.request.params, seq.sampling
    n_out = len(seq.output_token_ids)
    if n_out >= p.min_tokens and token in sampling.stop_ids:
        return Finish(FinishReason.STOP, token if token in p.stop_token_ids else None, stop_token=True)
    end = features.accept(seq, token) if seq.state else None
    if end is not None:
        return Finish(FinishReason(end))
    if reaches_length(p, n_out, seq.num_tokens, seq.window is not None, max_model_len):
        return Finish(FinishReason.LENGTH)
    return None
