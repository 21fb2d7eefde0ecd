"""Is an inspection fair to traffic? Short completions answered beside a long `/inspect`, against the same
completions with nothing beside them, in the same run.

    python -m benchmarks.inspect_fairness [--model PATH] [--rounds 3] [--prompt-tokens 3211] [--sae NAME=PATH]

One server (the default model unless --model). Each round has two phases, in turns: "alone", where `--clients`
clients send short completions (a 24-token prompt, 16 tokens, greedy) back to back for as long as the other phase
took last; and "beside", where the same clients do the same while one `/inspect` of a `--prompt-tokens`-token
prompt runs with its attention summaries (`include` attention, massive, norms, logit_lens; the mode the server picks
for that length) and, with --sae, the feature x token grid of that dictionary. An inspection runs on the engine
thread between serving steps in slices of about a serving step's time (model/probes/run.py), so a completion beside
it should wait for at most a slice per step. Reported per phase: the completions' worst, 95th percentile and median
latency, how many were answered, and the inspection's own time; medians over rounds. The issue's goal: worst <= 1.0 s
on a 2-core host. JSON to --out (default benchmarks/results/inspect-fairness.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.load import ServedProcess
from benchmarks.machine import machine_info

RESULTS = Path(__file__).resolve().parent / "results" / "inspect-fairness.json"
SHORT_PROMPT, SHORT_TOKENS = 24, 16


def _progress(msg: str) -> None:
    print(f"[inspect_fairness] {msg}", file=sys.stderr, flush=True)


async def _completions(client: httpx.AsyncClient, url: str, prompt: list[int], stop: asyncio.Event,
                       into: list[float]) -> None:
    body = {"prompt": prompt, "max_tokens": SHORT_TOKENS, "temperature": 0, "ignore_eos": True}
    while not stop.is_set():
        t0 = time.perf_counter()
        r = await client.post(url + "/v1/completions", json=body)
        r.raise_for_status()
        into.append(time.perf_counter() - t0)


async def _phase(url: str, clients: int, inspect_body: dict | None, seconds: float) -> dict:
    rng = random.Random(clients)
    latencies: list[float] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=3600) as client:
        workers = [asyncio.create_task(_completions(client, url, [rng.randrange(1000, 20000) for _ in range(SHORT_PROMPT)],
                                                    stop, latencies)) for _ in range(clients)]
        t0 = time.perf_counter()
        if inspect_body is not None:
            r = await client.post(url + "/inspect", json=inspect_body)
            if r.status_code != 200:
                raise RuntimeError(f"/inspect answered {r.status_code}: {r.text[:500]}")
        else:
            await asyncio.sleep(seconds)
        took = time.perf_counter() - t0
        stop.set()
        await asyncio.gather(*workers)
    latencies.sort()
    return {"seconds": took, "answered": len(latencies), "worst_s": latencies[-1],
            "p95_s": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))],
            "median_s": statistics.median(latencies)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.inspect_fairness", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=2, help="clients sending short completions back to back")
    p.add_argument("--prompt-tokens", type=int, default=3211, help="the inspected prompt's length")
    p.add_argument("--sae", default=None, help="NAME=PATH: serve this dictionary and ask /inspect for its grid")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    from model.loaders import default_model_path

    model = a.model or str(default_model_path())
    args = ["--model", model] + (["--threads", str(a.threads)] if a.threads else []) + (["--sae", a.sae] if a.sae else [])
    rng = random.Random(0)
    inspect_body = {"input_ids": [rng.randrange(1000, 20000) for _ in range(a.prompt_tokens)],
                    "include": ["attention", "massive", "norms", "logit_lens"]}
    if a.sae:
        inspect_body["features"] = {"sae": a.sae.split("=", 1)[0]}
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = ServedProcess(args, Path(tmp) / "server.log")
        try:
            asyncio.run(_phase(server.url, a.clients, None, 2.0))  # warm: kernels, first-request costs
            for rnd in range(a.rounds):
                beside = asyncio.run(_phase(server.url, a.clients, inspect_body, 0))
                alone = asyncio.run(_phase(server.url, a.clients, None, beside["seconds"]))
                rounds.append({"beside": beside, "alone": alone})
                _progress(f"round {rnd + 1}/{a.rounds}: worst beside {beside['worst_s']:.3f} s, alone "
                          f"{alone['worst_s']:.3f} s; median {beside['median_s']:.3f} / {alone['median_s']:.3f} s; "
                          f"the inspection took {beside['seconds']:.1f} s")
        finally:
            server.stop(10)
    med = {phase: {k: statistics.median(r[phase][k] for r in rounds) for k in rounds[0][phase]}
           for phase in ("beside", "alone")}
    result = {"benchmark": "inspect_fairness", "machine": machine_info("cpu", a.threads or 0), "model": Path(model).name,
              "prompt_tokens": a.prompt_tokens, "clients": a.clients, "sae": a.sae, "rounds": rounds, "median": med,
              "goal": "beside.worst_s <= 1.0 on a 2-core host"}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(med, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
