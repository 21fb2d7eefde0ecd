"""Timing primitives and result records shared by every side of the benchmark.

Every side is timed the same way: a `Clock` is started just before the request is handed over (add_request,
generate, the first forward) and `mark()`ed each time a token becomes available. From those marks:

    TTFT          = first mark - start
    decode tok/s  = (n - 1) / (last mark - first mark)    tokens after the first, over the time they took
    throughput    = output tokens of all requests / (end of the last request - start)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


class Clock:
    """Seconds since `start()` at each `mark()`.

    On CUDA a mark is an event recorded on the current stream: it reads the time the GPU got there, without a host
    sync that would change what is timed (transformers' generate avoids one per token on purpose). On CPU it is
    `perf_counter`. Read the marks with `times()` once the timed work is over.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._start = None
        self._marks: list = []

    def start(self) -> Clock:
        self._marks = []
        if self.cuda:
            torch.cuda.synchronize()  # nothing earlier may leak into the timed span
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        return self

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append(ev)
        else:
            self._marks.append(time.perf_counter())

    def times(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [self._start.elapsed_time(ev) / 1e3 for ev in self._marks]
        return [t - self._start for t in self._marks]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class StreamResult:
    """One request generating alone."""

    token_ids: list[int]
    ttft_s: float
    decode_tok_s: float
    total_s: float
    steps_by_path: dict[str, int] | None = None  # ours: the engine steps per execution path the runner chose

    @classmethod
    def from_token_times(cls, token_ids: list[int], times: list[float], steps_by_path: dict[str, int] | None = None) -> StreamResult:
        """times[i]: seconds from the start until token i was available."""
        if len(times) != len(token_ids) or not times:
            raise ValueError(f"{len(token_ids)} tokens but {len(times)} token times")
        n = len(times)
        decode = (n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else float("nan")
        return cls(list(token_ids), times[0], decode, times[-1], steps_by_path)

    def summary(self) -> dict:
        out = {"num_tokens": len(self.token_ids), "ttft_s": self.ttft_s, "decode_tok_s": self.decode_tok_s,
               "total_s": self.total_s}
        if self.steps_by_path is not None:
            out["steps_by_path"] = self.steps_by_path
        return out


@dataclass
class ConcurrentResult:
    """Many requests, all submitted at t = 0; per-request times are from that moment."""

    ttft_s: list[float]  # (N,)
    latency_s: list[float]  # (N,) until the request's last token
    num_output_tokens: int
    wall_s: float  # until the last request finished
    token_ids: list[list[int]] | None = None  # (N, n) where every request was really run
    notes: dict = field(default_factory=dict)  # how the peer was run (extrapolation, engine counters)

    def summary(self) -> dict:
        return {
            "num_requests": len(self.ttft_s),
            "num_output_tokens": self.num_output_tokens,
            "wall_s": self.wall_s,
            "throughput_tok_s": self.num_output_tokens / self.wall_s,
            "ttft_p50_s": percentile(self.ttft_s, 50),
            "ttft_p99_s": percentile(self.ttft_s, 99),
            "latency_p50_s": percentile(self.latency_s, 50),
            "latency_p99_s": percentile(self.latency_s, 99),
            **self.notes,
        }
