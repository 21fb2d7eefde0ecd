"""The decode attention kernel alone, reading a long context's keys and values from memory as a decode step does.

    .venv/bin/python -m benchmarks.attention_memory                 # default model and 1B shapes, 4k and 8k
    .venv/bin/python -m benchmarks.attention_memory --shapes 8b --lengths 2048 --out /tmp/a.json

One decode row (one new token) of each shape attends over `--lengths` positions in every layer, through the native
kernel every CPU decode step runs (model/kernels/csrc/paged_attention.cpp, `ops.decode_attention`): one KV pool per
layer, float16 (the cache `benchmarks.long_prompts` and `benchmarks.shapes` serve with, llama.cpp's default), on
2 MB pages as the engine places it (model/huge_pages.py), its block table in the order a fresh pool hands blocks
out. The pools of all the layers together are many times the last-level cache, so each step reads every key and
value from memory once, as a real step does. Reported: ms per step (all layers) and GB/s of keys and values read,
medians of `--reps` steps, beside the plain read bandwidth (a sum over a large tensor) of the same run. Random keys
and queries: the kernel's cost does not depend on the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.ceilings import read_bandwidth
from benchmarks.machine import machine_info
from model import huge_pages
from model.kernels import ops

# name -> (query heads, KV heads, head dim, layers): SmolLM2-135M (the default model), Llama-3.2-1B, Llama-3.1-8B
SHAPES = {"default": (9, 3, 64, 30), "1b": (32, 8, 64, 16), "8b": (32, 8, 128, 32)}
BLOCK = 16  # the engine's default block size (positions per block)


def kv_pool(blocks: int, kv_heads: int, dim: int) -> torch.Tensor:
    """A float16 pool of random keys (or values) on 2 MB pages: (blocks + 1, BLOCK, kv_heads, dim), block 0 left
    unused, as the engine's."""
    pool = huge_pages.empty((blocks + 1, BLOCK, kv_heads, dim), torch.float16)
    pool.copy_(torch.randn(pool.shape))
    return pool


def step_time(heads: int, kv_heads: int, dim: int, layers: int, length: int, reps: int) -> float:
    """Median seconds of one decode row's attention over `length` positions in each of `layers` pools."""
    torch.manual_seed(0)
    blocks = -(-length // BLOCK)
    pools = [[kv_pool(blocks, kv_heads, dim) for _ in range(2)] for _ in range(layers)]  # each layer's keys, values
    q = torch.randn(1, heads, dim)  # (rows, heads, dim)
    out = torch.empty_like(q)
    tables = (torch.arange(blocks) + 1).view(1, blocks)  # (rows, blocks)
    lens, rows = torch.tensor([length]), torch.arange(1)

    def step() -> None:
        for k_pool, v_pool in pools:
            ops.decode_attention(q, k_pool, v_pool, rows, tables, lens, out)

    step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["default", "1b"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {"machine": machine_info("cpu", args.threads), "read_bandwidth_gbs": round(read_bandwidth(), 1),
               "kv_dtype": "float16", "runs": []}
    print(f"plain read bandwidth {results['read_bandwidth_gbs']} GB/s, {args.threads} threads")
    for name in args.shapes:
        heads, kv_heads, dim, layers = SHAPES[name]
        for length in args.lengths:
            s = step_time(heads, kv_heads, dim, layers, length, args.reps)
            gbs = layers * length * kv_heads * dim * 2 * 2 / s / 1e9  # keys and values, 2 bytes each
            results["runs"].append({"shape": name, "positions": length, "layers": layers, "ms_per_step": round(s * 1e3, 2),
                                    "gbs": round(gbs, 3)})
            print(f"{name:8s} {length:6d} positions x {layers} layers: {s * 1e3:7.2f} ms/step  {gbs:5.1f} GB/s", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
