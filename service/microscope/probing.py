"""Inspections stepped on the engine thread between serving steps (`AsyncEngine.run_job`), on the weights and kernels
that serve completions: the one runner /inspect, /v1/vectors and the `inspect` extension of /v1/completions share,
the job that builds a response in the same slices (`ThenRespond`), and the length limit (--max-inspect-tokens) each
of them checks before it submits anything."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator

from fastapi import Request

from model.engine import EngineJob
from model.interventions import Intervention
from model.probes import FeatureRequest, ProbeOptions, ProbeRun
from service.microscope import inspect_format as fmt
from service.common.errors import APIError
from service.common.runner import until_disconnect
from service.microscope.schemas import InspectSummaryOptions
from service.common.serving import Serving


def check_inspect_length(serving: Serving, T: int, param: str = "prompt") -> None:
    """413 for an inspection (or a probe run for a vector or a summary) of more than --max-inspect-tokens."""
    limit = serving.settings.max_inspect_tokens
    if T > limit:
        raise APIError(413, f"inspecting {T} tokens exceeds the limit of {limit} (max_inspect_tokens)",
                       param=param, code="inspect_too_long")


class ThenRespond:
    """An EngineJob: `job` to its end, then the response `respond()` builds from it, in the same slices of the
    engine thread. `respond` returns a generator that yields between units of a few milliseconds of work and
    returns the response's bytes (`data`).

    Building a large response (an inspection's maps and feature grid, tens of megabytes of JSON) is pure Python and
    one long C call per `json.dumps`, both under the GIL: on the event loop it stalls every stream, and on a worker
    thread it holds the GIL the engine thread needs between its native calls, so every serving step waits for it.
    On the engine thread, in the job's own slices, serving steps run between its units as they do between the
    forward's chunks."""

    def __init__(self, job, respond: Callable[[], Generator[None, None, bytes]]) -> None:
        self.job, self.respond = job, respond
        self.building: Generator[None, None, bytes] | None = None
        self.data: bytes | None = None
        self.units = 0  # the response's units run, for a test to see it built in pieces

    def step(self, budget_s: float) -> bool:
        t0 = time.perf_counter()
        if self.building is None:
            if not self.job.step(budget_s):
                return False
            self.building = self.respond()
        while True:
            try:
                next(self.building)
            except StopIteration as stop:
                self.data = stop.value
                return True
            self.units += 1
            if time.perf_counter() - t0 >= budget_s:
                return False


async def run_probe(serving: Serving, request: Request | None, ids: list[int], opts: ProbeOptions,
                    interventions: list[Intervention] | None = None, num_prompt_tokens: int | None = None,
                    adapter: str | None = None, features: FeatureRequest | None = None) -> ProbeRun:
    """Step a ProbeRun on the engine thread to its end; cancelled if the client of `request` leaves (without a
    request, the caller's own cancellation is the only stop). A full inspection queue or a dead engine raise the
    engine's errors (429 / 503 through errors.install)."""
    return await run_job(serving, request,
                         serving.new_probe(ids, opts, interventions, num_prompt_tokens, adapter, features), len(ids))


async def run_job(serving: Serving, request: Request | None, job: EngineJob, tokens: int = 0) -> EngineJob:
    """Step any inspection job (a probe, a capture forward, an attribution) on the engine thread to its end, under
    the same queue limit (`max_inspect_queued`) and the same share of the engine thread as /inspect."""
    t0 = time.perf_counter()
    running = serving.run_job(job, serving.settings.max_inspect_queued)
    await (until_disconnect(request, running) if request is not None else running)
    serving.metrics.inspect_seconds.observe(time.perf_counter() - t0)
    serving.metrics.inspect_tokens.inc(tokens)
    return job


async def completion_summaries(serving: Serving, prompts: list[list[int]], options: bool | InspectSummaryOptions,
                               interventions: list[Intervention] | None = None,
                               adapter: str | None = None) -> list[dict]:
    """The `inspect` extension of /v1/completions: each prompt's inspection summary (no maps), under the request's
    interventions and LoRA adapter. Runs beside the generation as a task the route cancels if the client leaves."""
    o = options if isinstance(options, InspectSummaryOptions) else InspectSummaryOptions()
    out = []
    for i, ids in enumerate(prompts):
        # the summary covers every block whatever `layers` says; one layer keeps the per-layer part small
        opts = ProbeOptions(include=frozenset({"massive", "attention"}), massive_threshold=o.massive_threshold,
                            massive_ratio=o.massive_ratio, layers=[0])
        result = (await run_probe(serving, None, ids, opts, interventions, adapter=adapter)).result()
        tokens = fmt.token_list(serving.tokenizer, ids)
        out.append({"prompt_index": i, "summary": fmt.summary(result, tokens, serving.config.n_layers),
                    "compute_ms": round(result.compute_ms, 1)})
    return out
