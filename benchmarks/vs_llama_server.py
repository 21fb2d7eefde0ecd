"""Our server against llama.cpp's `llama-server` over HTTP, on the same GGUF, in the same run, with each side's
default settings: the comparison a CPU user serving a model would make.

    python -m benchmarks.vs_llama_server [--model PATH] [--llama-server PATH] [--rounds 3] [--float32] [--out FILE]

Not part of CI: `llama-server` is optional (benchmarks/README.md says how it was built from the llama.cpp that
llama-cpp-python's sdist vendors). Both servers are started by this command and stay up for the whole run (an idle
server costs nothing measurable); each workload then runs on every server in turn, the order flipping each round,
so a neighbour's load on a shared machine falls on both. Medians over the rounds are reported.

- ours: `python -m service --model PATH` with nothing else (a Q4_0/Q4_1 file runs as int4, `--quantization auto`);
- peer: `llama-server -m PATH -np 32 -c 32*640 -t THREADS` (32 slots of continuous batching, each slot holding a
  prompt of up to 512 tokens plus the new ones).

Workloads, both over `/v1/completions` with streaming, prompts as token ids (no tokenizer differences), greedy,
EOS ignored, `max_tokens` 64 (every answer must end with finish_reason "length": exactly 64 tokens):
- single stream: one request with a 128-token prompt; decode tok/s = 63 / (last token chunk - first token chunk);
  3 such requests per side and round, the sides interleaved, the round's figure their median;
- 32 concurrent: 32 requests with prompts of 8-140 random tokens sent at once; throughput = 32 * 64 tokens over the
  wall time from the first send to the last answer's end.
- prefill: one request with a 512-token prompt and 1 new token; prompt tok/s = 512 / (first token chunk - send).
The prompts are random token ids from a seed that changes every round, so neither side's prompt cache serves one.
The client (benchmarks/sse_client.py, `--client`) is the same for every server: by default raw asyncio sockets that
parse only each event's JSON, since on a 2-core machine the client's CPU time is the servers'; `--client httpx`
reads through httpx instead.

`--float32` adds a third server, ours with `--quantization none` (the dequantized float32 model), on the same
workloads: what serving the file at its own precision buys (the goal: int4 >= 2x float32 at 32 streams).
`--invariance` adds the batch-invariance check over HTTP on ours (issue 18): 24 greedy requests (48 tokens each, with
logprobs) sent one at a time, then all together; every answer's text and logprob floats must be identical.
`--invariance-peer` runs it on llama-server too, for comparison (llama.cpp makes no such promise).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks import sse_client
from benchmarks.load import ServedProcess
from benchmarks.machine import machine_info

NEW_TOKENS = 64
SINGLE_PROMPT = 128
SINGLE_REPEATS = 3  # single-stream measurements per side per round (each ~0.4 s on ours), interleaved
CONCURRENT, MIN_PROMPT, MAX_PROMPT = 32, 8, 140
PREFILL_PROMPT = 512
SLOT_CONTEXT = 640  # llama-server's context per slot (-c is split evenly across the -np slots): the prefill prompt + 1
INVARIANCE_REQUESTS, INVARIANCE_TOKENS = 24, 48
LOW_ID = 1000  # random prompt ids from here up: clear of the special and byte tokens at the start of the vocab


class LlamaServer(ServedProcess):
    """`llama-server` on a free loopback port; ready when /health answers 200 (it answers 503 while loading)."""

    def __init__(self, binary: Path, model: Path, threads: int, log_path: Path) -> None:
        self.port = self.free_port()
        self.start([str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                    "-np", str(CONCURRENT), "-c", str(CONCURRENT * SLOT_CONTEXT), "-t", str(threads)], log_path,
                   timeout=300)


@contextlib.asynccontextmanager
async def _client(kind: str, connections: int = 4):
    """The benchmark's client (benchmarks/sse_client.py): None for the raw one, else an httpx client."""
    if kind == "raw":
        yield None
    else:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=connections + 4)) as c:
            yield c


async def _stream(client: httpx.AsyncClient | None, url: str, prompt: list[int], max_tokens: int,
                  logprobs: bool = False) -> dict:
    """One streamed greedy completion that must end with finish_reason "length" (exactly max_tokens tokens)."""
    out = await sse_client.stream(client, url, prompt, max_tokens, logprobs)
    if out["finish"] != "length":
        raise RuntimeError(f"{url}: finish_reason {out['finish']!r}, expected 'length' ({max_tokens} tokens)")
    return out


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(min(LOW_ID, vocab // 2), vocab) for _ in range(n)]


def single_stream(url: str, vocab: int, seed: int, client: str = "raw") -> dict:
    async def go():
        async with _client(client) as c:
            return await _stream(c, url, _prompt(random.Random(seed), SINGLE_PROMPT, vocab), NEW_TOKENS)

    out = asyncio.run(go())
    m = out["marks"]
    # the first text chunk to the last: NEW_TOKENS - 1 tokens (a chunk held back for an incomplete character
    # moves a mark, never the count: finish_reason "length" says NEW_TOKENS were generated)
    return {"decode_tok_s": (NEW_TOKENS - 1) / (m[-1] - m[0])}


def concurrent(url: str, vocab: int, seed: int, client: str = "raw") -> dict:
    rng = random.Random(seed)
    prompts = [_prompt(rng, rng.randint(MIN_PROMPT, MAX_PROMPT), vocab) for _ in range(CONCURRENT)]

    async def go():
        async with _client(client, CONCURRENT) as c:
            t0 = time.perf_counter()
            await asyncio.gather(*(_stream(c, url, p, NEW_TOKENS) for p in prompts))
            return time.perf_counter() - t0

    wall = asyncio.run(go())
    return {"throughput_tok_s": CONCURRENT * NEW_TOKENS / wall, "wall_s": wall}


def prefill(url: str, vocab: int, seed: int, tokens: int = PREFILL_PROMPT, client: str = "raw") -> dict:
    """One 512-token prompt, one new token: prompt tok/s = 512 / (first token's arrival - send)."""
    async def go():
        async with _client(client) as c:
            t0 = time.perf_counter()
            out = await _stream(c, url, _prompt(random.Random(seed), tokens, vocab), 1)
            return out["marks"][0] - t0

    return {"prefill_tok_s": tokens / asyncio.run(go())}


def invariance(url: str, vocab: int, seed: int = 7, client: str = "raw") -> dict:
    """24 greedy requests alone, one after another, then all together: how many answers differ in text or in any
    logprob float."""
    rng = random.Random(seed)
    prompts = [_prompt(rng, rng.randint(MIN_PROMPT, MAX_PROMPT), vocab) for _ in range(INVARIANCE_REQUESTS)]

    async def go():
        async with _client(client, INVARIANCE_REQUESTS) as c:
            alone = [await _stream(c, url, p, INVARIANCE_TOKENS, logprobs=True) for p in prompts]
            together = await asyncio.gather(*(_stream(c, url, p, INVARIANCE_TOKENS, logprobs=True) for p in prompts))
            return alone, together

    alone, together = asyncio.run(go())
    texts = sum(a["text"] != t["text"] for a, t in zip(alone, together))
    lps = sum(a["logprobs"] != t["logprobs"] for a, t in zip(alone, together))
    return {"requests": INVARIANCE_REQUESTS, "texts_differ": texts, "logprobs_differ": lps,
            "logprobs_returned": all(len(a["logprobs"]) == INVARIANCE_TOKENS for a in alone)}


def _vocab(url: str) -> int:
    """Ours reports its vocabulary in /v1/models (`vocab_size`); the default model's 49152 otherwise."""
    try:
        for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]:
            if m.get("vocab_size"):
                return int(m["vocab_size"])
    except (httpx.HTTPError, KeyError, ValueError):
        pass
    return 49152


def run(args: argparse.Namespace) -> dict:
    from model.loaders.checkpoint import default_model_path

    model = args.model or default_model_path()
    logs = Path(tempfile.mkdtemp(prefix="vs-llama-server-"))  # both servers' logs, kept for a look afterwards
    print(f"server logs in {logs}", flush=True)
    ours = ServedProcess(["--model", str(model), *args.ours_args.split()], logs / "vs_llama_server.ours.log")
    peer = LlamaServer(args.llama_server, model, args.threads, logs / "vs_llama_server.peer.log")
    sides = {"ours": ours.url, "llama-server": peer.url}
    if args.float32:  # ours dequantized, as `--quantization none` serves it: what the int4 default buys
        f32 = ServedProcess(["--model", str(model), "--quantization", "none", *args.ours_args.split()],
                            logs / "vs_llama_server.ours-float32.log")
        sides["ours float32"] = f32.url
    info = httpx.get(ours.url + "/v1/models", timeout=10).json()["data"][0]
    vocab = _vocab(ours.url)
    result = {"machine": machine_info("cpu", args.threads), "model": str(model), "ours_model_card": info,
              "ours_cmd": ["python", "-m", "service", "--model", str(model), *args.ours_args.split()],
              "peer_cmd": peer.cmd, "llama_server_version": _version(args.llama_server),
              "client": args.client,
              "workload": {"new_tokens": NEW_TOKENS, "single_prompt": SINGLE_PROMPT, "concurrent": CONCURRENT,
                           "prompt_lengths": [MIN_PROMPT, MAX_PROMPT]},
              "load_average_before": os.getloadavg(), "rounds": []}
    try:
        for name, url in sides.items():  # warm-up: one short request each, outside the figures
            single_stream(url, vocab, seed=10_000, client=args.client)
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            rnd: dict = {"order": order, **{name: {} for name in order}}
            # workload by workload, every side in turn: a side's figure and its peer's are seconds apart, so a
            # shared host's bandwidth, which moves by tens of percent over minutes, falls on both alike
            for i in range(SINGLE_REPEATS):  # a short measurement (63 tokens): repeated, sides interleaved, median
                for name in order:
                    rnd[name].setdefault("decode_tok_s_repeats", []).append(
                        single_stream(sides[name], vocab, seed=SINGLE_REPEATS * r + i, client=args.client)["decode_tok_s"])
            for name in order:
                rnd[name]["decode_tok_s"] = statistics.median(rnd[name]["decode_tok_s_repeats"])
            for workload, seed in ((concurrent, 100 + r), (prefill, 200 + r)):
                for name in order:
                    rnd[name].update(workload(sides[name], vocab, seed=seed, client=args.client))
            for name in order:
                print(f"round {r + 1} {name:>12}: single {rnd[name]['decode_tok_s']:7.1f} tok/s   "
                      f"32-concurrent {rnd[name]['throughput_tok_s']:7.1f} tok/s   "
                      f"prefill {rnd[name]['prefill_tok_s']:7.1f} tok/s", flush=True)
            result["rounds"].append(rnd)
        for key in ("decode_tok_s", "throughput_tok_s", "prefill_tok_s"):
            med = {n: statistics.median(rd[n][key] for rd in result["rounds"]) for n in sides}
            result[key] = {**med, "ratio": med["ours"] / med["llama-server"],
                           "round_ratios": [rd["ours"][key] / rd["llama-server"][key] for rd in result["rounds"]]}
            if "ours float32" in sides:
                result[key]["ours_over_float32"] = med["ours"] / med["ours float32"]
        if args.invariance:
            result["invariance"] = {n: invariance(u, vocab, client=args.client) for n, u in sides.items()
                                    if n == "ours" or args.invariance_peer}
    finally:
        result["load_average_after"] = os.getloadavg()
        result["ours_exit"] = ours.stop()
        if args.float32:
            result["ours_float32_exit"] = f32.stop()
        result["peer_exit"] = peer.stop(grace=0)
    return result


def _version(binary: Path) -> str:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        return next(line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version"))
    except (OSError, subprocess.SubprocessError, StopIteration):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vs_llama_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: the default model)")
    p.add_argument("--llama-server", type=Path, default=Path(shutil.which("llama-server") or "/work/peers/llama-server"))
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server -t (ours: its default, all cores)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ours-args", default="", help="extra `python -m service` arguments (default: none, our defaults)")
    p.add_argument("--float32", action="store_true", help="also ours with --quantization none (a third server)")
    p.add_argument("--invariance", action="store_true", help="also run the 24-request batch-invariance check")
    p.add_argument("--invariance-peer", action="store_true", help="... and on llama-server")
    p.add_argument("--client", choices=("raw", "httpx"), default="raw",
                   help="the benchmark's HTTP client (benchmarks/sse_client.py): raw sockets (default), or httpx")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/vs-llama-server.json"))
    args = p.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not args.llama_server.is_file():
        print(f"llama-server not found at {args.llama_server} (optional peer; see benchmarks/README.md)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # this process only sends requests
    result = run(args)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for key, label in (("decode_tok_s", "single stream decode"), ("throughput_tok_s", "32-concurrent throughput"),
                       ("prefill_tok_s", f"{PREFILL_PROMPT}-token prefill")):
        d = result[key]
        f32 = f"; ours float32 {d['ours float32']:.1f}, ours / float32 {d['ours_over_float32']:.2f}x" if "ours float32" in d else ""
        print(f"{label}: ours {d['ours']:.1f} tok/s, llama-server {d['llama-server']:.1f} tok/s, "
              f"ratio {d['ratio']:.2f}x (rounds: {', '.join(f'{x:.2f}' for x in d['round_ratios'])}){f32}")
    for name, inv in result.get("invariance", {}).items():
        print(f"invariance {name}: {inv['texts_differ']}/{inv['requests']} texts and {inv['logprobs_differ']} "
              f"logprob lists differ, alone vs all together")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
