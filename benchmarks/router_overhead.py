"""What router mode adds to one stream: the same model process asked directly and through the router's front, and
the same file served alone, in the same run.

    python -m benchmarks.router_overhead [--model PATH] [--rounds 7] [--threads 1] [--out FILE]

A router `python -m service --model PATH --model OTHER --models-max 1` (OTHER, a tiny random checkpoint, is never
loaded) and a server of the same file alone, `python -m service --model PATH`, with the same flags. Three sides:
"router" (through the front, which proxies to the model's own process), "direct" (that same process, asked on its
own loopback port: the weights, pages and threads are the router's; only the hop differs) and "alone" (the other
server: what a second process of the same file gives on this machine, for scale). One stream at a time (a 128-token
prompt of token ids, greedy, EOS ignored, 64 new tokens), read by the raw SSE client (benchmarks/sse_client.py) so the
client costs as little CPU as it can on a small machine: per request, the time to the first token, the inter-token
latency ((last token - first token) / 63) and the whole request. The sides take turns, the order rotated every round,
each side `--repeats` requests a round; medians over everything. The goal: router / direct <= 1.05. Beside the
latencies, the front's own CPU time per token it passed on (from /proc, less what it spent while the other sides
ran): on a machine whose cores are all busy, each token also waits for the front to be scheduled, which no change to
the front removes.

The idle sides cost nothing while one is measured. The figures, the machine and the ratios go to --out (default
benchmarks/results/router-overhead.json).
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
from benchmarks.sse_client import stream_raw
from benchmarks.tiny_checkpoint import write_tiny_checkpoint

RESULTS = Path(__file__).resolve().parent / "results" / "router-overhead.json"
PROMPT, NEW_TOKENS = 128, 64


def _progress(msg: str) -> None:
    print(f"[router_overhead] {msg}", file=sys.stderr, flush=True)


def one_request(url: str, prompt: list[int]) -> dict:
    t0 = time.perf_counter()
    r = asyncio.run(stream_raw(url, prompt, NEW_TOKENS))
    end = time.perf_counter()
    marks = r["marks"]
    return {"ttft": marks[0] - t0, "itl": (marks[-1] - marks[0]) / (len(marks) - 1), "e2e": end - t0,
            "text": r["text"]}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat utime, stime; clock ticks of 1/100 s)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.router_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeats", type=int, default=3, help="requests per side per round")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each model's process")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    from model.loaders import default_model_path

    model = a.model or str(default_model_path())
    common = ["--threads", str(a.threads), "--kv-cache-bytes", str(64 << 20)]
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 20000) for _ in range(PROMPT)]
    with tempfile.TemporaryDirectory() as tmp:
        other = write_tiny_checkpoint(Path(tmp) / "never-loaded", seed=1)
        _progress("starting the model alone and behind a router")
        alone = ServedProcess(["--model", model, *common], Path(tmp) / "alone.log")
        routed = ServedProcess(["--model", model, "--model", str(other), "--models-max", "1", *common],
                               Path(tmp) / "router.log")
        try:
            name = Path(model).name.removesuffix(".gguf")
            for _ in range(600):  # the router answers /health at once; its model loads behind it
                states = {m["id"]: m["status"]["value"] for m in httpx.get(routed.url + "/v1/models").json()["data"]}
                if states.get(name) == "loaded":
                    break
                time.sleep(0.2)
            models = {m["id"]: m for m in httpx.get(routed.url + "/v1/models").json()["data"]}
            sides = {"router": routed.url, "direct": f"http://127.0.0.1:{models[name]['status']['port']}",
                     "alone": alone.url}
            for url in sides.values():  # warm every side (kernels, first-request costs)
                one_request(url, prompt)
            runs: dict[str, list[dict]] = {side: [] for side in sides}
            front_cpu = {side: 0.0 for side in sides}  # the front process's CPU time while each side was asked
            names = list(sides)
            for rnd in range(a.rounds):
                for side in names[rnd % 3:] + names[:rnd % 3]:
                    front = cpu_seconds(routed.proc.pid)
                    for _ in range(a.repeats):
                        runs[side].append(one_request(sides[side], prompt))
                    front_cpu[side] += cpu_seconds(routed.proc.pid) - front
                _progress(f"round {rnd + 1}/{a.rounds}: e2e medians " + ", ".join(
                    f"{side} {statistics.median(r['e2e'] for r in rs) * 1e3:.1f} ms" for side, rs in runs.items()))
        finally:
            alone.stop(10)
            routed.stop(10)
    texts = {r["text"] for side in runs.values() for r in side}
    assert len(texts) == 1, "the router's greedy answer differs from the model's alone"
    keys = ("ttft", "itl", "e2e")
    med = {side: {k: statistics.median(r[k] for r in rs) * 1e3 for k in keys} for side, rs in runs.items()}
    ratios = {f"router_over_{base}": {k: med["router"][k] / med[base][k] for k in keys} for base in ("direct", "alone")}
    result = {"benchmark": "router_overhead", "machine": machine_info("cpu", a.threads), "model": Path(model).name,
              "prompt_tokens": PROMPT, "new_tokens": NEW_TOKENS, "rounds": a.rounds, "repeats": a.repeats,
              "median_ms": med, **ratios, "goal": "router / direct <= 1.05 (e2e)",
              # what the hop itself costs, whatever the machine's load: the front's CPU per token it passed on
              "front_cpu_ms_per_token": (front_cpu["router"] - front_cpu["direct"]) * 1e3
              / (len(runs["router"]) * NEW_TOKENS)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"median_ms": med, **ratios, "front_cpu_ms_per_token": result["front_cpu_ms_per_token"]},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
