"""The overlapped step (model/engine/engine.py, `_overlapped_step`) on the CPU: the engine's device path, with a
simulated device stream (benchmarks/simulated_device.py), gives exactly the serial engine's outputs, and a steady
greedy decode step on it reads nothing back from the device but its one copy of the samples, which is counted."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from benchmarks.simulated_device import SimulatedStream
from model.engine import Engine, EngineConfig
from model.engine.sampling_params import SamplingParams
from test_engine import _prompts, assert_pool_clean, run
from tiny import EOS, byte_tokenizer, tiny_model


def _engine(overlap: bool, **kw) -> Engine:
    model = tiny_model(seed=4)
    if overlap:
        model.stream = SimulatedStream()
    cfg = dict(num_blocks=96, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    cfg.update(kw)
    return Engine(model, byte_tokenizer(), EngineConfig(**cfg))


def _requests(n: int = 10) -> dict:
    prompts = _prompts(n, seed=7, lo=2, hi=20)
    kinds = [
        SamplingParams(max_tokens=12, temperature=0.0),  # EOS may end it, in flight
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.9, top_p=0.8, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True, stop=["e", "a"]),  # ended by the text
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, stop_token_ids=[97, 101, 105]),
        SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, output_kind="final"),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),  # not overlappable
    ]
    return {str(i): (p, kinds[i % len(kinds)]) for i, p in enumerate(prompts)}


def test_overlapped_steps_give_the_serial_steps_outputs():
    reqs = _requests()
    arrive = {r: 2 * i for i, r in enumerate(reqs)}
    overlapped = _engine(True)
    assert overlapped.async_scheduling and not _engine(False).async_scheduling
    got, want = run(overlapped, reqs, arrive), run(_engine(False), reqs, arrive)
    for r in reqs:
        g, w = got[r][0], want[r][0]
        assert (g["tokens"], g["text"], g["finish_reason"], g["stop_reason"]) == \
               (w["tokens"], w["text"], w["finish_reason"], w["stop_reason"]), r
        assert [(lp.token_id, lp.rank, lp.top) for lp in g["logprobs"]] == \
               [(lp.token_id, lp.rank, lp.top) for lp in w["logprobs"]]
    assert_pool_clean(overlapped)


def test_overlapped_steps_with_aborts_and_a_full_batch_leave_the_pool_clean():
    """Requests aborted while their step is in flight, and more requests than sequence slots."""
    engine = _engine(True, max_num_seqs=4)
    reqs = _requests(12)
    for rid, (p, params) in reqs.items():
        engine.add_request(rid, p, params)
    finished, aborted, step = set(), set(), 0
    while engine.has_unfinished():
        if step in (6, 9, 13):
            rid = next(r for r in reqs if r not in finished and r not in aborted)
            aborted.add(rid)
            assert all(o.finish_reason == "abort" for o in engine.abort(rid))
        for out in engine.step():
            assert out.request_id not in aborted
            if out.finished:
                finished.add(out.request_id)
        step += 1
        assert step < 1000
    assert finished | aborted == set(reqs)
    assert_pool_clean(engine)


class _Reads(TorchFunctionMode):
    """Counts what a device step would wait for: a read of a tensor's values on the host (not of the host buffers
    the step copies its samples to), and the copies between host buffers and the rest."""

    READS = {"tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"}

    def __init__(self, host: list[torch.Tensor], out: list[torch.Tensor]) -> None:
        super().__init__()
        self.host = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in host]
        self.out = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in out]
        self.reads, self.to_host, self.to_device = [], 0, 0

    def _in(self, t, spans) -> bool:
        p = t.data_ptr()
        return any(a <= p < b for a, b in spans)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS and args and isinstance(args[0], torch.Tensor) and not self._in(args[0], self.host):
            self.reads.append(name)
        if name == "copy_" and len(args) > 1:
            self.to_host += self._in(args[0], self.out) and not self._in(args[1], self.host)
            self.to_device += self._in(args[1], self.host) and not self._in(args[0], self.host)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("logprobs", [None, 2])
def test_a_steady_decode_step_on_the_device_path_waits_for_nothing_but_its_one_copy(logprobs):
    engine = _engine(True)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    for i, p in enumerate(_prompts(6, seed=1, lo=3, hi=9)):
        engine.add_request(str(i), p, params)
    for _ in range(12):  # every prompt prefilled, the pipeline running
        engine.step()
    assert engine.in_flight is not None
    runner = engine.runner
    counter = _Reads(runner.host_buffers(), runner._out_host)
    stream = engine.model.stream
    stream.reset_counts()
    steps = 10
    with counter:
        for _ in range(steps):
            outs = engine.step()
            assert len(outs) == 6 and all(len(o.token_ids) == 1 for o in outs)
    assert counter.reads == []
    assert counter.to_host == steps and counter.to_device == steps  # one packed copy each way a step
    assert stream.waits == steps  # each step waits once: for the step before it, launched a step earlier
    assert engine.runner.path_counts["native"] > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_decode_step_fails_exactly_its_rows(overlap):
    """A fault in a decode step (serial or overlapped) ends each of its sequences with an error, once; the others
    finish; the pool is clean."""
    engine = _engine(overlap, max_num_seqs=3)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(_prompts(6, seed=2, lo=3, hi=6)):
        engine.add_request(str(i), p, params)
    failed = set()

    def hook(scheduled):
        if not failed and len(scheduled) == 3 and all(s.seq.output_token_ids for s in scheduled):
            failed.update(s.seq.request.request_id for s in scheduled)
            raise RuntimeError("injected")

    engine.step_fault_hook = hook
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = out
    assert len(failed) == 3
    assert {r for r, o in finals.items() if o.finish_reason == "error"} == failed
    assert all(o.finish_reason == "length" and o.num_output_tokens == 12 for r, o in finals.items() if r not in failed)
    assert_pool_clean(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_persistent_batch_tables_follow_the_block_lists_step_by_step(overlap):
    """The decode path writes only the rows the decode scheduler gave a block (and every row after a step of another
    kind): after every step, each row's table is its sequence's block list, whatever joined, grew or left."""
    engine = _engine(overlap, block_size=2)
    reqs = _requests(12)
    for i, (rid, (prompt, params)) in enumerate(reqs.items()):
        if i < 6:
            engine.add_request(rid, prompt, params)
    steps = 0
    while engine.has_unfinished() or steps < 12:
        if steps == 6:
            for rid, (prompt, params) in list(reqs.items())[6:]:
                engine.add_request(rid, prompt, params)
        engine.step()
        steps += 1
        batch = engine.scheduler.batch
        batch.sync()
        for seq in batch.seqs:
            blocks = seq.block_ids
            assert batch.tables[seq.slot, : len(blocks)].tolist() == blocks
        assert batch.num_serial == sum(not s.request.overlappable for s in batch.seqs)
        assert batch.num_not_greedy == sum(not s.request.plain_greedy for s in batch.seqs)
    assert engine.runner.path_counts  # (steps ran)
    assert_pool_clean(engine)
