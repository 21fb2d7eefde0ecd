"""LoRA adapters served beside the base: output tok/s at C concurrent requests spread over the base and N adapters,
against the same server's base alone, in one run (issue: throughput with 4 adapters mixed >= 0.8x the base alone).

    .venv/bin/python -m benchmarks.lora_throughput             # the default model (Q4_1: int4), 4 x rank 16 on q, v
    .venv/bin/python -m benchmarks.lora_throughput --targets all --rank 64 --rounds 3 --out results.json

The adapters are random, written in PEFT's format (adapter_config.json + adapter_model.safetensors) for the model's
shape, targeting `--targets` of every block (default q_proj and v_proj, PEFT's default for LLaMA; `all`: the seven
projections); the server loads them with `--lora-modules`. One server
serves both workloads, alternating by round: a closed loop of C clients (benchmarks/serve_throughput.py's, raw
sockets) whose requests all name the base, then one whose requests cycle through the base and every adapter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from benchmarks.machine import machine_info
from benchmarks.serve_throughput import ROOT, Server, closed_loop
from model.config import ModelConfig
from model.features.lora import hf_module, target

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_config(path: str) -> ModelConfig:
    if path.endswith(".gguf"):
        from model.loaders.config_keys import config_from_gguf
        from model.loaders.gguf_file import open_gguf, read_metadata

        return config_from_gguf(read_metadata(open_gguf(path)), source=path)
    from model.loaders.hf import read_hf_config

    return read_hf_config(Path(path))


def write_adapter(folder: Path, config: ModelConfig, rank: int, seed: int, targets=TARGETS) -> None:
    """A random PEFT LoRA adapter on `targets` of every block for a model of `config`."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.n_layers):
        for t in targets:
            _, start, stop, fan_in = target(config, t)
            key = f"base_model.model.{hf_module(layer, t)}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(stop - start, rank, generator=g) * 0.01
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), "bias": "none"}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora_throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the default model's GGUF)")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", nargs="+", default=["q_proj", "v_proj"], help=f"of {' '.join(TARGETS)}, or all")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--server-args", default="")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.model is None:
        from model.loaders.checkpoint import default_model_path

        args.model = str(default_model_path())
    config = model_config(args.model)
    targets = TARGETS if args.targets == ["all"] else tuple(args.targets)
    runs: dict[str, list[dict]] = {"base": [], "mixed": []}
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"lora{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            write_adapter(Path(tmp) / name, config, args.rank, seed=i, targets=targets)
        modules = " ".join(f"{n}={Path(tmp) / n}" for n in names)
        server_args = f"{args.server_args} --max-lora-rank {max(64, args.rank)} --lora-modules {modules}"
        with Server(ROOT, args.model, server_args, sys.executable) as server:
            base = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
            for r in range(args.rounds):
                for side in (("base", "mixed") if r % 2 == 0 else ("mixed", "base")):
                    models = [base] if side == "base" else [base, *names]
                    print(f"[lora_throughput] round {r + 1}: {side}", file=sys.stderr, flush=True)
                    runs[side].append(asyncio.run(closed_loop(
                        server.url, models, args.concurrency, args.requests_per_client, args.max_tokens,
                        args.prompt_len, client="raw")))
    summary = {s: statistics.median(x["tok_s"] for x in runs[s]) for s in runs}
    summary["ratio"] = summary["mixed"] / summary["base"]
    report = {"machine": machine_info("cpu", os.cpu_count() or 1), "workload": {**vars(args), "out": None}, "summary": summary, "runs": runs}
    print(json.dumps(report, indent=1, default=str))
    print(f"base alone {summary['base']:.1f} tok/s, base + {args.adapters} adapters mixed {summary['mixed']:.1f} "
          f"tok/s: {summary['ratio']:.2f}x", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
