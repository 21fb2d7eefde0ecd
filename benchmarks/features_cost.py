"""What reading a dictionary's features with every token costs a server: streamed greedy completions on the default
model, each returning the top 8 features per token of a 16,384-feature SAE at one layer, against the same
workload without features, at 32 concurrent streams and at one (issue 69: >= 0.85x at 32, >= 0.8x single).

    .venv/bin/python -m benchmarks.features_cost                        # 32 streams and 1, 3 rounds each
    .venv/bin/python -m benchmarks.features_cost --concurrency 32 --rounds 5 --out benchmarks/results/x.json

The dictionary is random, written in SAELens' format (cfg.json + sae_weights.safetensors) to a temporary folder
and served with `--sae`: TopK (k 32) at `--hook` (block 15's output, where the shipped SAE reads), its per-token
reads encoding with `--sae-encoder` (the server's default, int8, unless given; what it served is recorded from
GET /v1/saes; the int8 encoder's error against float32: benchmarks/sae_encoder_error.py). One server serves both workloads, alternating by round (features, then plain, then
plain, then features, ...); output tok/s = every streamed token / the wall time from the first request to the last
token; medians over the rounds. The client (httpx, in this process) shares the machine's cores with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from benchmarks.machine import machine_info
from benchmarks.serve_throughput import ROOT, Server

WORDS = "the of and to in is was for on that with as by at from it an be this are".split()


def write_sae(folder: Path, d_in: int, d_sae: int, hook: str, k: int = 32, architecture: str = "topk") -> None:
    """A random dictionary in SAELens' format: TopK (k) or JumpReLU (thresholds uniform in [0, 1))."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    tensors = {"W_enc": torch.randn(d_in, d_sae, generator=g) / d_in**0.5, "b_enc": torch.zeros(d_sae),
               "W_dec": torch.randn(d_sae, d_in, generator=g) / d_sae**0.5, "b_dec": torch.zeros(d_in)}
    if architecture == "jumprelu":
        tensors["threshold"] = torch.rand(d_sae, generator=g)
    save_file(tensors, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps({
        "architecture": architecture, "d_in": d_in, "d_sae": d_sae, "k": k, "dtype": "float32",
        "apply_b_dec_to_input": False, "normalize_activations": "none",
        "metadata": {"hook_name": hook, "sae_lens_version": "6.54.12"}}))


async def streams(url: str, concurrency: int, max_tokens: int, prompt_len: int, features: dict | None,
                  seed: int) -> dict:
    """`concurrency` streamed completions at once; -> tokens, seconds, tok/s."""
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(prompt_len)) for _ in range(concurrency)]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as c:
        async def one(prompt: str) -> int:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            if features is not None:
                body["features"] = features
            tokens = 0
            async with c.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):  # the last chunk: the completion's tokens
                            tokens = chunk["usage"]["completion_tokens"]
            return tokens

        await one(prompts[0])  # warm the connection and the server's caches
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - start
    return {"tokens": sum(counts), "seconds": seconds, "tok_s": sum(counts) / seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.features_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the default model's GGUF)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 1])
    p.add_argument("--d-sae", type=int, default=16384)
    p.add_argument("--hook", default="blocks.15.hook_resid_post")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sae-encoder", choices=["int8", "float32"], default=None,
                   help="the server's --sae-encoder (default: its own default)")
    p.add_argument("--server-args", default="")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.model is None:
        from model.loaders.checkpoint import default_model_path

        args.model = str(default_model_path())
    from benchmarks.lora_throughput import model_config

    d_in = model_config(args.model).dim
    runs: dict[str, dict[str, list[dict]]] = {str(c): {"plain": [], "features": []} for c in args.concurrency}
    features = {"sae": "bench", "top_k": args.top_k}
    with tempfile.TemporaryDirectory() as tmp:
        write_sae(Path(tmp) / "bench", d_in, args.d_sae, args.hook)
        sae_args = f"{args.server_args} --sae bench={Path(tmp) / 'bench'}"
        if args.sae_encoder:
            sae_args += f" --sae-encoder {args.sae_encoder}"
        with Server(ROOT, args.model, sae_args, sys.executable) as server:
            served = httpx.get(server.url + "/v1/saes").json()["data"][0]
            for c in args.concurrency:
                for r in range(args.rounds):
                    for side in (("features", "plain") if r % 2 == 0 else ("plain", "features")):
                        print(f"[features_cost] {c} streams, round {r + 1}: {side}", file=sys.stderr, flush=True)
                        run = asyncio.run(streams(server.url, c, args.max_tokens, args.prompt_len,
                                                  features if side == "features" else None, seed=r))
                        runs[str(c)][side].append(run)
                        print(f"[features_cost] {run['tok_s']:.2f} tok/s", file=sys.stderr, flush=True)
    summary = {}
    for c, sides in runs.items():
        plain = statistics.median(x["tok_s"] for x in sides["plain"])
        feat = statistics.median(x["tok_s"] for x in sides["features"])
        summary[c] = {"plain_tok_s": plain, "features_tok_s": feat, "ratio": feat / plain}
        print(f"{c} streams: plain {plain:.1f} tok/s, with features {feat:.1f} tok/s: {feat / plain:.2f}x",
              file=sys.stderr)
    report = {"machine": machine_info("cpu", os.cpu_count() or 1), "workload": {**vars(args), "out": None},
              "served": {k: served[k] for k in ("d_sae", "activation", "k", "encoder", "bytes")},
              "summary": summary, "runs": runs}
    print(json.dumps(report, indent=1, default=str))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
