"""The decode attention kernel alone, reading a long context's keys and values from memory as a decode step does.

    .venv/bin/python -m benchmarks.attention_memory                 # default model and 1B shapes, 4k and 8k
    .venv/bin/python -m benchmarks.attention_memory --shapes 8b --lengths 2048 --out /tmp/a.json
    .venv/bin/python -m benchmarks.attention_memory --kv-cache-dtypes float16 int8   # both caches, steps alternating

One decode row (one new token) of each shape attends over `--lengths` positions in every layer, through the native
kernel every CPU decode step runs (model/kernels/csrc/paged_attention.cpp, `ops.decode_attention`): one KV pool per
layer, float16 (the cache `benchmarks.long_prompts` and `benchmarks.shapes` serve with, llama.cpp's default), on
2 MB pages as the engine places it (model/huge_pages.py), its block table in the order a fresh pool hands blocks
out. The pools of all the layers together are many times the last-level cache, so each step reads every key and
value from memory once, as a real step does. Reported: ms per step (all layers) and GB/s of keys and values read,
medians of `--reps` steps, beside the plain read bandwidth (a sum over a large tensor) of the same run. Random keys
and queries: the kernel's cost does not depend on the numbers. With `--kv-cache-dtypes float16 int8` the same step
over an int8 pool (rows of E quants and a 4-byte scale, model/kernels/kv_int8.py) runs too, the two caches' steps
alternating so that a busy spell of the host falls on both; `vs_first` is each one's speed over the first's.
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
from model.kernels import kv_int8, ops

# name -> (query heads, KV heads, head dim, layers): SmolLM2-135M (the default model), Llama-3.2-1B, Llama-3.1-8B
SHAPES = {"default": (9, 3, 64, 30), "1b": (32, 8, 64, 16), "8b": (32, 8, 128, 32)}
BLOCK = 16  # the engine's default block size (positions per block)


def kv_pool(blocks: int, kv_heads: int, dim: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """A pool of random keys (or values) on 2 MB pages: (blocks + 1, BLOCK, kv_heads, dim) (dim + 4 int8 for an int8
    cache), block 0 left unused, as the engine's."""
    pool = huge_pages.empty((blocks + 1, BLOCK, kv_heads, kv_int8.row_width(dim, dtype)), dtype)
    x = torch.randn(blocks + 1, BLOCK, kv_heads, dim)
    pool.copy_(kv_int8.pack(x) if dtype == torch.int8 else x)
    return pool


def step_times(heads: int, kv_heads: int, dim: int, layers: int, length: int, reps: int,
               dtypes: list[torch.dtype]) -> list[float]:
    """Median seconds of one decode row's attention over `length` positions in each of `layers` pools, per cache
    dtype, their steps alternating."""
    torch.manual_seed(0)
    blocks = -(-length // BLOCK)
    # per dtype, each layer's keys and values
    pools = [[[kv_pool(blocks, kv_heads, dim, t) for _ in range(2)] for _ in range(layers)] for t in dtypes]
    q = torch.randn(1, heads, dim)  # (rows, heads, dim)
    out = torch.empty_like(q)
    tables = (torch.arange(blocks) + 1).view(1, blocks)  # (rows, blocks)
    lens, rows = torch.tensor([length]), torch.arange(1)

    def step(i: int) -> None:
        for k_pool, v_pool in pools[i]:
            ops.decode_attention(q, k_pool, v_pool, rows, tables, lens, out)

    times: list[list[float]] = [[] for _ in dtypes]
    for i in range(len(dtypes)):
        step(i)
    for _ in range(reps):
        for i in range(len(dtypes)):
            t0 = time.perf_counter()
            step(i)
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["default", "1b"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--kv-cache-dtypes", nargs="+", choices=["float16", "bfloat16", "int8"], default=["float16"])
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d) for d in args.kv_cache_dtypes]
    results = {"machine": machine_info("cpu", args.threads), "read_bandwidth_gbs": round(read_bandwidth(), 1),
               "kv_dtype": args.kv_cache_dtypes[0], "kv_dtypes": args.kv_cache_dtypes, "runs": []}
    print(f"plain read bandwidth {results['read_bandwidth_gbs']} GB/s, {args.threads} threads")
    for name in args.shapes:
        heads, kv_heads, dim, layers = SHAPES[name]
        for length in args.lengths:
            secs = step_times(heads, kv_heads, dim, layers, length, args.reps, dtypes)
            for t, s in zip(dtypes, secs):
                row = kv_int8.row_width(dim, t) * torch.empty((), dtype=t).element_size()  # bytes of a head's row
                gbs = layers * length * kv_heads * row * 2 / s / 1e9  # keys and values
                results["runs"].append({"shape": name, "positions": length, "layers": layers,
                                        "kv_dtype": str(t).removeprefix("torch."), "ms_per_step": round(s * 1e3, 2),
                                        "gbs": round(gbs, 3), "vs_first": round(secs[0] / s, 3)})
                print(f"{name:8s} {length:6d} positions x {layers} layers, {str(t).removeprefix('torch.'):8s}: "
                      f"{s * 1e3:7.2f} ms/step  {gbs:5.1f} GB/s  {secs[0] / s:.2f}x the first", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
