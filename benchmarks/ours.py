"""llamascope's side: the `Engine` driven in-process, one `step()` at a time, as the service's engine thread does.

No AsyncEngine and no HTTP: the thread hop and the event loop are the service's cost, not the engine's, and they
would blur the comparison with transformers' in-process `generate`. The engine still does everything it does
when serving (scheduling, paged KV, the batched sampler, incremental detokenization of every token).
"""

from __future__ import annotations

import torch

from benchmarks.agreement import StepLogprobs
from benchmarks.measure import Clock, ConcurrentResult, StreamResult
from model.engine import Engine, RequestOptions, RequestOutput
from model.features import TelemetryOptions
from model.engine.sampling_params import SamplingParams
from model.interventions import Intervention

WARM_UP_PROMPT_LENS = (24, 40)  # `warm_up`'s requests (benchmarks/gpu_sizing.py sizes engines for them too)
WARM_UP_NEW_TOKENS = 4


def greedy(max_tokens: int) -> SamplingParams:
    # ignore_eos: every request generates exactly max_tokens, so every side does the same amount of work.
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _check(out: RequestOutput) -> None:
    if out.error:
        raise RuntimeError(f"request {out.request_id} failed in the engine: {out.error}")


def run_single(engine: Engine, prompt: list[int], max_tokens: int, clock: Clock,
               interventions: list[Intervention] | None = None,
               telemetry: TelemetryOptions | None = None) -> StreamResult:
    """One request alone (with `interventions`, if any); a mark per step that produced its token (a partial
    prefill chunk produces none). `telemetry`: the request also asks for per-token attention telemetry
    (model/features/telemetry/)."""
    tokens: list[int] = []
    before = engine.stats().steps_by_path
    options = RequestOptions(interventions=interventions, telemetry=telemetry)
    clock.start()
    engine.add_request("single", prompt, greedy(max_tokens), options)
    while engine.has_unfinished():
        outs = engine.step()
        for out in outs:
            _check(out)
            tokens += out.token_ids
        if any(out.token_ids for out in outs):
            clock.mark()
    return StreamResult.from_token_times(tokens, clock.times(), _paths(before, engine.stats().steps_by_path))


def _paths(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Engine steps per execution path between two stats snapshots (model/engine/model_runner.py's choice)."""
    return {path: n - before.get(path, 0) for path, n in after.items()}


def run_concurrent(engine: Engine, prompts: list[list[int]], max_tokens: int, clock: Clock,
                   tag: str = "req", interventions: list[list[Intervention] | None] | None = None) -> ConcurrentResult:
    """All requests added at t = 0 (request i with interventions[i], if given), then `step()` until every one has
    finished; a mark after every step."""
    n = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(n)]
    first_step: list[int | None] = [None] * n
    last_step: list[int | None] = [None] * n
    before = engine.stats()
    peak_kv_usage, num_steps = 0.0, 0
    clock.start()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, greedy(max_tokens),
                           RequestOptions(interventions=interventions[i] if interventions else None))
    while engine.has_unfinished():
        outs = engine.step()
        clock.mark()
        for out in outs:
            _check(out)
            i = int(out.request_id.rsplit("-", 1)[1])
            tokens[i] += out.token_ids
            if first_step[i] is None and out.token_ids:
                first_step[i] = num_steps
            if out.finished:
                last_step[i] = num_steps
        peak_kv_usage = max(peak_kv_usage, engine.stats().kv_usage)
        num_steps += 1
    times = clock.times()
    after = engine.stats()
    return ConcurrentResult(
        ttft_s=[times[s] for s in first_step],
        latency_s=[times[s] for s in last_step],
        num_output_tokens=sum(len(t) for t in tokens),
        wall_s=times[-1],
        token_ids=tokens,
        notes={
            "method": "Engine.step() loop in-process, all requests added at t=0",
            "engine_steps": num_steps,
            "preemptions": after.num_preemptions - before.num_preemptions,
            "prefix_cache_hit_tokens": after.prefix_cache_hits - before.prefix_cache_hits,
            "peak_kv_usage": peak_kv_usage,
            "steps_by_path": _paths(before.steps_by_path, after.steps_by_path),
        },
    )


def run_decode_only(engine: Engine, prompts: list[list[int]], max_tokens: int, clock: Clock, tag: str = "dec") -> float:
    """Output tok/s of decode steps alone, counted as a static decoder's (batch x tokens after the first, over their
    time): every request added and stepped until each has its first token (admission and prefill untimed), then
    the steps until all have finished, timed."""
    n = len(prompts)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, greedy(max_tokens))
    started: set[str] = set()
    while len(started) < n:
        started |= {o.request_id for o in engine.step() if o.token_ids}
    count = 0
    clock.start()
    while engine.has_unfinished():
        count += sum(len(o.token_ids) for o in engine.step())
        clock.mark()
    return count / clock.times()[-1]


def warm_up(engine: Engine, vocab_size: int) -> None:
    """A short batched prefill + decode, so one-time costs (thread pools, kernel selection, first allocations)
    stay out of the timings (the KV pool's pages, faulted in by a background thread, and the weights' move onto 2
    MB pages, another, among them). Random ids that no timed prompt shares, so the prefix cache gains nothing."""
    engine.cache.wait_resident()
    if getattr(engine.model, "collapsing", None) is not None:  # (model/loaders/checkpoint.py)
        engine.model.collapsing.join()
    g = torch.Generator().manual_seed(12345)
    prompts = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in WARM_UP_PROMPT_LENS]
    run_concurrent(engine, prompts, WARM_UP_NEW_TOKENS, Clock(engine.model.device), tag="warmup")


def logprob_steps(engine: Engine, prompt: list[int], max_tokens: int, k: int) -> list[StepLogprobs]:
    """One greedy request, untimed, with the top-k log-probabilities of every generated token (what
    benchmarks/agreement.py compares across decode paths)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=k)
    engine.add_request("logprobs", prompt, params)
    steps: list[StepLogprobs] = []
    while engine.has_unfinished():
        for out in engine.step():
            _check(out)
            steps += [StepLogprobs(lp.token_id, dict(lp.top)) for lp in out.logprobs or []]
    return steps


def steer_by_feature(d, op: str, seed: int, amount: float) -> list[Intervention]:
    """A request steering by one feature of dictionary `d` (feature `seed * 97 mod d_sae`): `add` of amount x its
    decoder row where the dictionary writes, or `clamp` of its activation to amount (service/microscope/
    edit_fields.py resolves the API's feature items the same way)."""
    from model.features.sae import FeatureClamp

    F, h = seed * 97 % d.d_sae, d.hook_out
    if op == "add":
        return [Intervention(h.layer, h.site, "add", "all", d.decoder_direction(F).float().clone(), scale=amount)]
    return [Intervention(h.layer, h.site, "clamp", "all", clamp=FeatureClamp(d, F, amount))]


def add_every_layer(config, seed: int, norm: float = 1.0) -> list[Intervention]:
    """One `add` at every block's output, all positions (a steering vector at every layer: the cost benchmarks'
    intervention), a random direction of the given norm."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(config.n_layers):
        v = torch.randn(config.dim, generator=g)
        out.append(Intervention(layer, "block_output", "add", "all", v / v.norm() * norm))
    return out
