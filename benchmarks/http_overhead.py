"""What HTTP adds to a streamed token: inter-token latency over HTTP against the very same engine in-process.

    python -m benchmarks.http_overhead [--model PATH] [--rounds 3] [--out FILE]

One run, two sides, on the same file with the service's defaults:
- in-process: `ServerState(Settings(model=...)).start()` builds the engine exactly as the server does (same
  settings, same EngineConfig), and requests go straight to its `AsyncEngine` (no HTTP, no JSON, no SSE);
- HTTP: `python -m service --model PATH` on loopback, streamed `/v1/completions` read by httpx as a client would.

Workloads (the prompts are token ids, greedy, EOS ignored, 64 new tokens each, the same prompts on both sides):
one stream with a 128-token prompt, and 32 concurrent streams with prompts of 8-140 tokens. Inter-token latency of a
stream = (arrival of its last token - arrival of its first) / 63, measured where the consumer sees the tokens (the
in-process consumer is an asyncio task on the benchmark's event loop, as the service's route is); per workload the
mean over its streams. The sides alternate round by round (order flipped each round); medians over rounds. Only one
side runs at a time: the idle one waits on an event and costs nothing.

The goal: HTTP within 5% of in-process at 1 and 32 streams. Results, the machine and the HTTP stack in use
(uvicorn's event loop and HTTP parser: uvloop / httptools when installed) go to benchmarks/results/http-overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.load import ServedProcess
from benchmarks.machine import machine_info
from benchmarks.sse_client import stream_httpx, stream_raw
from benchmarks.vs_llama_server import CONCURRENT, MAX_PROMPT, MIN_PROMPT, NEW_TOKENS, SINGLE_PROMPT, _prompt

RESULTS = Path(__file__).resolve().parent / "results" / "http-overhead.json"


def _progress(msg: str) -> None:
    print(f"[http_overhead] {msg}", file=sys.stderr, flush=True)


def _itl(marks: list[float]) -> float:
    return (marks[-1] - marks[0]) / (len(marks) - 1)


class InProcess:
    """The server's engine, built by the server's own start-up code, driven without HTTP."""

    def __init__(self, model: str | None) -> None:
        from service.config import Settings
        from service.common.state import ServerState

        self.state = ServerState(Settings(model=model))
        # On a thread that then ends, as the service does (service/main.py): a thread that ran parallel regions
        # keeps its OpenMP team while it lives, and with more OpenMP threads than cores libgomp stops spinning
        # between regions (`gomp_throttled_spin_count_var`): loading on this (main) thread made every decode step
        # here 2.9x slower (13.1 ms vs 4.5 ms a token, this machine) than the same engine in the server.
        loader = threading.Thread(target=self.state.start, name="llamascope-load")
        loader.start()
        loader.join()
        if self.state.engine is None:
            raise RuntimeError(f"in-process engine failed to start: {self.state.load_error}")
        self.vocab = self.state.loaded.model.config.vocab_size

    async def stream(self, prompt: list[int]) -> list[float]:
        from model.engine import SamplingParams

        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        marks = []
        async for out in self.state.engine.generate(prompt, params):
            if out.token_ids:
                marks.append(time.perf_counter())
        if len(marks) != NEW_TOKENS:
            raise RuntimeError(f"in-process: {len(marks)} tokens, expected {NEW_TOKENS}")
        return marks

    def close(self) -> None:
        self.state.engine.stop()


class OverHttp:
    """client "httpx" or "raw" (benchmarks/sse_client.py). On a 2-core machine the client's own CPU time is taken
    from the server's cores: the raw client shows what the server adds."""

    def __init__(self, url: str, client: str) -> None:
        self.url, self.client = url, client

    async def stream(self, prompt: list[int], client: httpx.AsyncClient | None) -> list[float]:
        if self.client == "raw":
            out = await stream_raw(self.url, prompt, NEW_TOKENS)
        else:
            out = await stream_httpx(client, self.url, prompt, NEW_TOKENS)
        if out["finish"] != "length":
            raise RuntimeError(f"{self.url}: finish_reason {out['finish']!r}, expected 'length'")
        marks = out["marks"]
        # a chunk held back for an incomplete character carries two tokens: count tokens, not chunks
        return [marks[0]] * (NEW_TOKENS - len(marks)) + marks


def workloads(vocab: int, seed: int) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    return {"1 stream": [_prompt(rng, SINGLE_PROMPT, vocab)],
            f"{CONCURRENT} streams": [_prompt(rng, rng.randint(MIN_PROMPT, MAX_PROMPT), vocab) for _ in range(CONCURRENT)]}


async def _run_side(side, prompts: list[list[int]]) -> float:
    if isinstance(side, OverHttp) and side.client == "httpx":
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=CONCURRENT + 4)) as c:
            marks = await asyncio.gather(*(side.stream(p, c) for p in prompts))
    else:
        marks = await asyncio.gather(*(side.stream(p) if isinstance(side, InProcess) else side.stream(p, None)
                                       for p in prompts))
    return statistics.mean(_itl(m) for m in marks)


def http_stack() -> dict:
    have = {name: importlib.util.find_spec(name) is not None for name in ("uvloop", "httptools")}
    return {"loop": "uvloop" if have["uvloop"] else "asyncio", "http": "httptools" if have["httptools"] else "h11"}


def run(args: argparse.Namespace) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix="http-overhead-"))
    _progress("starting the server and the in-process engine")
    server = ServedProcess(["--model", args.model] if args.model else [], log_dir / "server.log")
    ours = InProcess(args.model)
    sides = {"in-process": ours, "http": OverHttp(server.url, "raw"), "http (httpx client)": OverHttp(server.url, "httpx")}
    itl: dict[str, dict[str, list[float]]] = {}
    try:
        for name, prompts in workloads(ours.vocab, 0).items():  # warm-up: every path once on both sides
            for side in sides.values():
                asyncio.run(_run_side(side, prompts[:2]))
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name, prompts in workloads(ours.vocab, 100 + r).items():
                for s in order:
                    itl.setdefault(name, {}).setdefault(s, []).append(asyncio.run(_run_side(sides[s], prompts)))
            _progress(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {v['http'][-1] / v['in-process'][-1]:.3f}x (httpx {v['http (httpx client)'][-1] / v['in-process'][-1]:.3f}x)"
                for n, v in itl.items()))
    finally:
        server.stop()
        ours.close()
    rows = {}
    for name, v in itl.items():
        a, b, c = (statistics.median(v[s]) for s in ("in-process", "http", "http (httpx client)"))
        rows[name] = {"in_process_itl_ms": a * 1e3, "http_itl_ms": b * 1e3, "http_over_in_process": b / a,
                      "http_httpx_itl_ms": c * 1e3, "http_httpx_over_in_process": c / a,
                      "rounds_ms": {s: [x * 1e3 for x in xs] for s, xs in v.items()}}
    import torch

    return {"machine": machine_info("cpu", torch.get_num_threads()), "http_stack": http_stack(), "rounds": args.rounds,
            "new_tokens": NEW_TOKENS, "workloads": rows}


def print_report(r: dict) -> None:
    s = r["http_stack"]
    print(f"\nstreamed inter-token latency, median of {r['rounds']} rounds; {r['machine'].get('cpu_model', '')}; "
          f"uvicorn loop {s['loop']}, http {s['http']}")
    print(f"{'workload':<12} {'in-process ms':>14} {'HTTP ms':>9} {'HTTP / in-process':>18} {'httpx client ms':>16} {'ratio':>7}")
    for name, w in r["workloads"].items():
        print(f"{name:<12} {w['in_process_itl_ms']:>14.2f} {w['http_itl_ms']:>9.2f} {w['http_over_in_process']:>17.3f}x "
              f"{w['http_httpx_itl_ms']:>16.2f} {w['http_httpx_over_in_process']:>6.3f}x")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.http_overhead", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    r = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=2) + "\n")
    print_report(r)
    return r


if __name__ == "__main__":
    main()
