"""The end-of-sequence rule (model/engine/end_of_sequence.py) is the one every step asks: the general step, the
serial decode step and the overlapped step each ask it once per appended token, and end each choice where a plain
reading of the rule over the choice's greedy tokens says (stop token from min_tokens on, max_tokens)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

import model.engine.engine as engine_module
from benchmarks.simulated_device import SimulatedStream
from model.engine import Engine, EngineConfig
from model.engine.end_of_sequence import finish_after, reaches_length
from model.features.kv_window import KVWindow
from model.engine.request import FinishReason
from model.engine.sampling_params import SamplingParams
from test_engine import _prompts, assert_pool_clean, run
from tiny import byte_tokenizer, tiny_model


def _engine(overlap: bool, **kw) -> Engine:
    model = tiny_model(seed=4)
    if overlap:
        model.stream = SimulatedStream()
    return Engine(model, byte_tokenizer(), EngineConfig(num_blocks=96, block_size=4, max_num_seqs=8,
                                                       max_num_batched_tokens=64, **kw))


def _asked(monkeypatch) -> list[tuple[str, int, str]]:
    """Every question to the rule: (request id, token, the engine step that asked)."""
    calls: list[tuple[str, int, str]] = []

    def spy(seq, token, max_model_len):
        frame, steps = sys._getframe(1), []
        while frame is not None:
            steps.append(frame.f_code.co_name)
            frame = frame.f_back
        step = next(s for s in ("_overlapped_step", "_decode_step", "core_step") if s in steps)
        calls.append((seq.request.request_id, token, step))
        return finish_after(seq, token, max_model_len)

    monkeypatch.setattr(engine_module, "finish_after", spy)
    return calls


def _expected_end(tokens: list[int], stop: set[int], min_tokens: int, max_tokens: int) -> tuple[int, str]:
    """The rule read plainly over a choice's tokens: how many it keeps, and its finish reason."""
    for i, t in enumerate(tokens[:max_tokens]):
        if t in stop and i + 1 >= min_tokens:
            return i + 1, "stop"
    return max_tokens, "length"


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_serial_and_overlapped_steps_end_each_choice_by_the_one_rule(overlap, monkeypatch):
    prompts = _prompts(6, seed=11, lo=3, hi=15)
    # each prompt's free greedy run, from which the stop tokens are chosen: the 3rd and 5th tokens each
    free = run(_engine(False), {str(i): (p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                                for i, p in enumerate(prompts)})
    tokens = {r: free[r][0]["tokens"] for r in free}
    cases = {}  # request id -> (prompt, params, stop ids, min_tokens, max_tokens)
    for i, p in enumerate(prompts):
        r, t = str(i), tokens[str(i)]
        min_tokens = 4 if i % 3 == 1 else 0
        max_tokens = 8 if min_tokens else 12  # (a min_tokens row is not overlapped: it ends before the others)
        stop = {t[2], t[4]} if i % 3 == 0 else set()
        if min_tokens:  # (the sampler bans stop tokens before min_tokens: chosen from those it never sampled there)
            stop = {x for x in (t[5], t[7]) if x not in t[:min_tokens]}
            assert stop
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, min_tokens=min_tokens,
                                stop_token_ids=sorted(stop))
        cases[r] = (p, params, stop, min_tokens, max_tokens)
    engine = _engine(overlap)
    asked = _asked(monkeypatch)
    got = run(engine, {r: (c[0], c[1]) for r, c in cases.items()})
    for r, (p, params, stop, min_tokens, max_tokens) in cases.items():
        n, reason = _expected_end(tokens[r], stop, min_tokens, max_tokens)
        assert got[r][0]["tokens"] == tokens[r][:n], r
        assert got[r][0]["finish_reason"] == reason, r
        # each appended token asked the rule exactly once, in order
        assert [t for q, t, _ in asked if q == r] == tokens[r][:n], r
    steps = {s for _, _, s in asked}
    assert ("_overlapped_step" in steps) == overlap and "_decode_step" in steps
    assert_pool_clean(engine)


def test_general_step_asks_the_rule_for_each_token(monkeypatch):
    """A prefill step's first token and a windowed sequence's tokens (not a plain decoder: the general step)."""
    engine = _engine(False)
    asked = _asked(monkeypatch)
    prompt = _prompts(1, seed=3, lo=9, hi=9)[0]
    from model.engine.request_options import RequestOptions

    engine.add_request("w", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                       RequestOptions(kv_window=KVWindow(sink_tokens=4, window=8)))
    out = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.token_ids]
    assert len(out) == 5 and [t for _, t, _ in asked] == out
    assert {s for _, _, s in asked} == {"core_step"}


def _seq(params: SamplingParams, n_prompt: int, out: list[int], windowed: bool = False, grammar=None):
    """A stand-in choice: what the rule reads of a sequence (its request's params, sampling state, window, its
    features' state: `grammar` as the structured-output feature's)."""
    sampling = SimpleNamespace(stop_ids=frozenset(params.stop_token_ids) | {0})
    return SimpleNamespace(request=SimpleNamespace(params=params), sampling=sampling, output_token_ids=out,
                           num_tokens=n_prompt + len(out), window=object() if windowed else None,
                           state={} if grammar is None else {"structured": grammar})


class _Grammar:
    def __init__(self, done_at: int, closing: bool = False) -> None:
        self.n, self.done_at, self.closing = 0, done_at, closing

    def accept(self, token: int) -> bool:
        self.n += 1
        return self.n >= self.done_at


def test_the_rule_in_its_order():
    p = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[7])
    assert finish_after(_seq(p, 3, [7]), 7, 100) is None  # before min_tokens
    end = finish_after(_seq(p, 3, [1, 7]), 7, 100)
    assert (end.reason, end.stop_reason, end.stop_token) == (FinishReason.STOP, 7, True)
    end = finish_after(_seq(p, 3, [1, 0]), 0, 100)  # EOS: a stop, no stop_reason
    assert (end.reason, end.stop_reason, end.stop_token) == (FinishReason.STOP, None, True)
    assert finish_after(_seq(p, 3, [1] * 8), 1, 100).reason == FinishReason.LENGTH  # max_tokens
    assert finish_after(_seq(p, 3, [1] * 7), 1, 100) is None
    assert finish_after(_seq(p, 3, [1] * 4), 1, 7).reason == FinishReason.LENGTH  # the context
    assert finish_after(_seq(p, 3, [1] * 4, windowed=True), 1, 7) is None  # a window's cache stays within it
    assert finish_after(_seq(p, 3, [1, 2], grammar=_Grammar(1)), 2, 100).reason == FinishReason.STOP
    assert finish_after(_seq(p, 3, [1, 2], grammar=_Grammar(1, closing=True)), 2, 100).reason == FinishReason.LENGTH
    assert finish_after(_seq(p, 3, [1, 2], grammar=_Grammar(2)), 2, 100) is None
    # the scheduler's look-ahead at an in-flight token is the same length rule
    assert reaches_length(p, 8, 11, False, 100) and reaches_length(p, 3, 100, False, 100)
    assert not reaches_length(p, 3, 100, True, 100) and not reaches_length(p, 7, 10, False, 100)
