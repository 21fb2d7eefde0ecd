"""CUDA graph capture stood in for on the CPU: what lets model/engine/cuda_graphs.py's capture bookkeeping (which
graphs exist under which keys, when they are captured, what a failed capture leaves) run without a GPU.

`fake_capture(monkeypatch, engine)` turns an "eager" engine's static-buffer step (decode_graphs="eager": everything a
graph replays, on the native kernels) into a capturing one: torch.cuda's streams, graphs and pool are replaced by
stand-ins, a capture runs the step's forward once as the real one does, and a replay runs it again into the output
tensor the capture returned (what a CUDA graph's replay does). It records every capture and whether a step was
running when it happened."""

from __future__ import annotations

import contextlib

import torch


class _Stream:
    def wait_stream(self, other) -> None:
        pass


class _Graph:
    def __init__(self) -> None:
        self.replay = None  # set once captured


class Captures:
    def __init__(self) -> None:
        self.keys: list[tuple[int, bool, bool]] = []  # every capture, in order
        self.during_step: list[tuple[int, bool, bool]] = []  # those made while the runner executed a step
        self.fail: set[tuple[int, bool, bool]] = set()  # keys whose capture raises (as out of memory does)
        self.in_step = False


def stub_cuda(monkeypatch) -> None:
    """torch.cuda's streams, graphs, graph pool and set_device as stand-ins that do nothing."""
    for name, value in (("Stream", _Stream), ("current_stream", _Stream),
                        ("stream", lambda s: contextlib.nullcontext()), ("CUDAGraph", _Graph),
                        ("graph", lambda g, pool=None, **k: contextlib.nullcontext()),
                        ("graph_pool_handle", lambda: None), ("set_device", lambda d: None)):
        monkeypatch.setattr(torch.cuda, name, value, raising=False)


def fake_capture(monkeypatch, engine) -> Captures:
    graphs = engine.runner.graphs
    assert graphs is not None and not graphs.capture, "an engine with decode_graphs='eager'"
    rec = Captures()
    stub_cuda(monkeypatch)
    original = type(graphs)._capture

    def capture(self, b, edited=False, adapted=False):
        key = (b, edited, adapted)
        rec.keys.append(key)
        if rec.in_step:
            rec.during_step.append(key)
        if key in rec.fail:
            def boom(*a, **k):
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            monkeypatch.setattr(self, "_forward", boom)
            try:
                return original(self, b, edited, adapted)
            finally:
                monkeypatch.delattr(self, "_forward")
        original(self, b, edited, adapted)
        if key in self.graphs:
            self.graphs[key].replay = lambda: self.outputs[key].copy_(self._forward(*key))

    monkeypatch.setattr(type(graphs), "_capture", capture)
    for step in ("execute", "launch_decode"):
        real = getattr(engine.runner, step)

        def wrapped(*a, _real=real, **k):
            rec.in_step = True
            try:
                return _real(*a, **k)
            finally:
                rec.in_step = False
        monkeypatch.setattr(engine.runner, step, wrapped)
    graphs.capture = True
    return rec
