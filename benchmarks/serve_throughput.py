"""A server's output rate over HTTP: closed-loop concurrency, and continuous arrivals with latency percentiles.

    .venv/bin/python -m benchmarks.serve_throughput --tiny --concurrency 1 256          # a tiny random LLaMA
    .venv/bin/python -m benchmarks.serve_throughput --tiny --ab ../base --rounds 3      # against another checkout
    .venv/bin/python -m benchmarks.serve_throughput --model m.gguf --arrivals 4 --duration 60
    .venv/bin/python -m benchmarks.serve_throughput --tiny --tracing --rounds 5         # request traces on vs off

The server is started for the run (`python -m service`, in the measured checkout, with `--server-args`), and the
client runs in this process (asyncio, httpx, one connection per concurrent request):

- closed loop (`--concurrency C ...`): C clients each send `--requests-per-client` non-streaming greedy
  completions back to back (EOS ignored, `--max-tokens` each, prompts of `--prompt-len` random words); output
  tok/s = every completion token / the wall time from the first request to the last answer. `--clients`: through
  httpx (what a Python user writes; its HTTP/1.1 parser is pure Python) and / or `raw` (one asyncio socket per
  client, keep-alive, the response's JSON read by its Content-Length: the least client work a request). On a
  machine whose cores the server shares with its client, httpx's CPU time is taken from the server's: at 256 tiny
  requests in flight on 2 cores it was about a quarter of the machine.
- continuous arrivals (`--arrivals RATE`): streamed requests arrive as a Poisson process of RATE a second for
  `--duration` seconds, prompt lengths uniform in 16..4x`--prompt-len` words and output lengths uniform in
  8..2x`--max-tokens`; throughput, and TTFT and inter-token latency percentiles (p50, p90, p99) as the client sees
  them (an SSE chunk carrying text is a token).

`--tiny` serves a tiny random LLaMA (2 layers, width 64) with the default model's tokenizer and vocabulary
(benchmarks/tiny_checkpoint.py): a step's cost is then mostly the server's host work, which is what this measures.
`--ab DIR` runs the same workload against a server started from another checkout, alternating, in one run.
`--tracing` runs it against this checkout twice, alternating: without request traces ("off") and with
`--otlp-traces-endpoint` ("on") pointed at an OTLP/HTTP sink in its own process (benchmarks/otlp_sink.py), which
counts the spans it received.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.arrivals import percentile
from benchmarks.machine import machine_info

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the light of a harbour keeper in the storm and the ship that came at night to the stone pier in winter "
         "with spray from the west and a rhythm of the town at every hour").split()


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_throughput", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="checkpoint to serve (GGUF file or HF directory)")
    where.add_argument("--tiny", action="store_true", help="a tiny random LLaMA with the default vocabulary")
    p.add_argument("--server-args", default="", help="more `python -m service` flags, the same for every side")
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 256])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--clients", nargs="+", choices=["httpx", "raw"], default=["httpx"],
                   help="the closed loop's HTTP clients, each measured")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32, help="words per prompt (closed loop)")
    p.add_argument("--arrivals", type=float, default=None, help="requests a second, Poisson (continuous arrivals)")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--ab", type=Path, default=None, help="another checkout to serve the same workload")
    p.add_argument("--tracing", action="store_true", help="this checkout without and with --otlp-traces-endpoint")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--python", default=sys.executable, help="the interpreter the servers run under")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


class Server:
    """`python -m service --model M ARGS` in `root` on a free port, until stopped (SIGTERM)."""

    def __init__(self, root: Path, model: str, args: str, python: str) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(root)}
        cmd = [python, "-m", "service", "--model", model, "--port", str(self.port), *args.split()]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Server":
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited: {self.log.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    time.sleep(2.0)  # the KV pool's pages are made resident in the background right after ready
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server not ready")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def closed_loop(url: str, model: str | list[str], concurrency: int, per_client: int, max_tokens: int,
                      prompt_len: int, seed: int = 0, client: str = "httpx") -> dict:
    """Each of `concurrency` clients sends its `per_client` requests one after another, through httpx or over a raw
    keep-alive socket (the same prompts and requests, the least client work). Several models (a base and its LoRA
    adapters): the requests name them in turn."""
    rng = random.Random(seed)
    prompts = [[_prompt(rng, prompt_len) for _ in range(per_client)] for _ in range(concurrency)]
    warm = _prompt(rng, prompt_len)
    models, sent = ([model] if isinstance(model, str) else list(model)), itertools.count()

    def body(text: str) -> dict:
        return {"model": models[next(sent) % len(models)], "prompt": text, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}

    if client == "raw":
        return await _timed(_raw_client(url, body), warm, prompts, client)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as c:
        async def one(texts: list[str]) -> int:
            tokens = 0
            for text in texts:
                r = await c.post("/v1/completions", json=body(text))
                r.raise_for_status()
                tokens += r.json()["usage"]["completion_tokens"]
            return tokens

        return await _timed(one, warm, prompts, client)


def _raw_client(url: str, body):
    """A client's requests over one keep-alive socket, each response's JSON read by its Content-Length."""
    host, port = url.removeprefix("http://").split(":")

    async def one(texts: list[str]) -> int:
        tokens = 0
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for text in texts:
                data = json.dumps(body(text)).encode()
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % (host.encode(), len(data)) + data)
                status, length = await reader.readline(), None
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if b" 200 " not in status or length is None:
                    raise RuntimeError(f"{url}: {status!r}")
                tokens += json.loads(await reader.readexactly(length))["usage"]["completion_tokens"]
        finally:
            writer.close()
        return tokens

    return one


async def _timed(one, warm: str, prompts: list[list[str]], client: str) -> dict:
    """A warm-up request (not counted), then every client at once: output tok/s over the wall time."""
    await one([warm])
    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    wall = time.perf_counter() - t0
    return {"concurrency": len(prompts), "requests": sum(map(len, prompts)), "output_tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "client": client}


async def arrivals(url: str, model: str, rate: float, duration: float, max_tokens: int, prompt_len: int,
                   seed: int = 0) -> dict:
    rng = random.Random(seed)
    ttft, itl, tokens, done = [], [], 0, 0
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=1000), timeout=600) as client:
        async def one(text: str, n: int):
            nonlocal tokens, done
            t0 = time.perf_counter()
            last = None
            body = {"model": model, "prompt": text, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if not chunk["choices"] or not chunk["choices"][0].get("text"):
                        continue
                    now = time.perf_counter()
                    if last is None:
                        ttft.append(now - t0)
                    else:
                        itl.append(now - last)
                    last = now
                    tokens += 1
            done += 1

        tasks = []
        t_start = time.perf_counter()
        t = 0.0
        while t < duration:
            t += rng.expovariate(rate)
            delay = t_start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            text = _prompt(rng, rng.randint(16, 4 * prompt_len))
            tasks.append(asyncio.create_task(one(text, rng.randint(8, 2 * max_tokens))))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t_start
    return {"rate": rate, "requests": done, "output_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "ttft_ms": {f"p{q}": percentile(ttft, q) * 1e3 for q in (50, 90, 99)},
            "itl_ms": {f"p{q}": percentile(itl, q) * 1e3 for q in (50, 90, 99)}}


def _key(concurrency: int, client: str) -> str:
    """A closed loop's name in the results: its concurrency, and the client where it is not httpx."""
    return str(concurrency) if client == "httpx" else f"{concurrency}_{client}"


def measure(root: Path, model: str, args, extra: str = "") -> dict:
    out = {"root": str(root), "closed_loop": {}}
    with Server(root, model, f"{args.server_args} {extra}", args.python) as server:
        name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        for c in args.concurrency:
            for client in args.clients:
                print(f"[serve_throughput] {root.name}: {c} concurrent ({client})", file=sys.stderr, flush=True)
                out["closed_loop"][_key(c, client)] = asyncio.run(closed_loop(
                    server.url, name, c, args.requests_per_client, args.max_tokens, args.prompt_len, client=client))
        if args.arrivals:
            print(f"[serve_throughput] {root.name}: arrivals at {args.arrivals}/s", file=sys.stderr, flush=True)
            out["arrivals"] = asyncio.run(arrivals(server.url, name, args.arrivals, args.duration, args.max_tokens,
                                                   args.prompt_len))
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.tiny:
            from benchmarks.tiny_checkpoint import write_tiny_checkpoint

            model = str(write_tiny_checkpoint(Path(tmp) / "tiny", default_vocab=True))
        # side -> (checkout, more server flags); a ratio is the second side's over the first's
        sides = {"this": (ROOT, "")} if args.ab is None else {"base": (args.ab.resolve(), ""), "this": (ROOT, "")}
        sink = None
        if args.tracing:
            from benchmarks.otlp_sink import Sink

            sink = Sink(args.python)
            sides = {"off": (ROOT, ""), "on": (ROOT, f"--otlp-traces-endpoint {sink.url}")}
        runs: dict[str, list[dict]] = {s: [] for s in sides}
        try:
            for r in range(args.rounds):
                for side in (list(sides) if r % 2 == 0 else list(reversed(sides))):
                    spans = sink.spans() if sink is not None else 0
                    runs[side].append(measure(sides[side][0], model, args, sides[side][1]))
                    if sink is not None:  # (the server's shutdown exported what it still held)
                        runs[side][-1]["spans_exported"] = sink.spans() - spans
        finally:
            if sink is not None:
                sink.close()
    summary = {}
    first, second = list(sides)[0], list(sides)[-1]
    for c in args.concurrency:
        for client in args.clients:
            row = {s: statistics.median(x["closed_loop"][_key(c, client)]["tok_s"] for x in runs[s]) for s in sides}
            if first != second:
                row["ratio"] = row[second] / row[first]
            summary[f"closed_loop_{_key(c, client)}_tok_s"] = row
    results = {"machine": machine_info("cpu", os.cpu_count() or 1),
               "workload": {k: v for k, v in vars(args).items() if k not in ("out", "ab", "python")},
               "summary": summary, "runs": runs}
    text = json.dumps(results, indent=1, default=str)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
