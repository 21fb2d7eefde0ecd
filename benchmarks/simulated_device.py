"""A device that runs beside the host, simulated on the CPU: what lets the engine's overlapped step (launch step
N + 1, then wait for step N) run and be measured without a GPU.

A model given `stream = SimulatedStream(seconds)` makes the engine take its device path (model/engine/stream.py):
separate device buffers filled by one copy a step, samples left where they were computed, one asynchronous copy
back, an event per step. The work itself still runs on the CPU when it is called; what the stream simulates is
time: each `launch()` (a stand-in model's forward) keeps the device busy `seconds` after it is free, and an event
completes when the device reaches it. `synchronize` sleeps until then and counts the waits that blocked.

Used by benchmarks/host_overhead.py and tests/engine/test_overlap.py. Imports nothing but the standard library, so
the benchmark can load it from its own file when it measures another checkout's engine.
"""

from __future__ import annotations

import time


class SimulatedEvent:
    def __init__(self, stream: "SimulatedStream", at: float) -> None:
        self.stream, self.at = stream, at

    def query(self) -> bool:
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        self.stream.waits += 1
        left = self.at - time.perf_counter()
        if left > 0:
            self.stream.blocking_waits += 1
            self.stream.waited_s += left
            time.sleep(left)


class SimulatedStream:
    asynchronous = True

    def __init__(self, device_s: float = 0.0) -> None:
        self.device_s, self.busy_until = device_s, 0.0
        self.waits = self.blocking_waits = 0
        self.waited_s = 0.0

    def launch(self) -> None:
        """A step's device work, queued behind what the device is still doing."""
        self.busy_until = max(time.perf_counter(), self.busy_until) + self.device_s

    def record(self) -> SimulatedEvent:
        return SimulatedEvent(self, self.busy_until)

    def reset_counts(self) -> None:
        self.waits = self.blocking_waits = 0
        self.waited_s = 0.0
