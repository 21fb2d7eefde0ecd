"""Where a step's device work runs, and how the host learns that it is done: a stream and its events.

On a GPU the kernels a step launches run later, in order, on the device's stream, while the host goes on; an event
recorded after them completes when the device gets there (CUDA's streams and events, `torch.cuda.Event`). The
engine's overlapped step (model/engine/engine.py) relies on exactly that: it launches step N + 1 before it waits on
step N's event. On the CPU the work is done when the call returns: `HostStream`'s events are complete at once, and
the engine steps one at a time.

A model may bring a stream of its own (its `stream` attribute): benchmarks/host_overhead.py's stand-in simulates a
device that runs beside the host, so the overlapped step and its host work can be measured without a GPU.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Event(Protocol):
    def query(self) -> bool:
        """Whether the device has done everything launched before the event."""
        ...

    def synchronize(self) -> None:
        """Wait until it has."""
        ...


class Stream(Protocol):
    asynchronous: bool  # whether work launched on it runs beside the host (else it is done when the call returns)

    def record(self) -> Event:
        """An event after everything launched so far."""
        ...


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class HostStream:
    """The CPU: every op is done when it returns."""

    asynchronous = False
    _done = _Done()

    def record(self) -> Event:
        return self._done


class CudaStream:
    """The current CUDA stream."""

    asynchronous = True

    def record(self) -> Event:
        event = torch.cuda.Event()
        event.record()
        return event


def bind_device(device: torch.device | str) -> None:
    """Make `device` the calling thread's current CUDA device (a no-op off CUDA). CUDA's current device is per
    thread and starts at 0: events, `torch.cuda.current_stream()`, Triton's launches (on the current device's
    stream) and graph capture all follow it, so a thread that steps a model on cuda:1 without this records events
    and captures graphs on device 0 (vLLM's GPU worker sets its device first, for the same reason)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def stream_for(model: torch.nn.Module) -> Stream:
    """The model's own stream where it has one, else its device's."""
    own = getattr(model, "stream", None)
    if own is not None:
        return own
    return CudaStream() if torch.device(model.device).type == "cuda" else HostStream()
