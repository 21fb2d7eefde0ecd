"""One prefill chunk's attention through the native kernel alone, at the end of a long prompt: where a long prompt's
prefill time goes, and A/B for an attention change on a noisy host.

    .venv/bin/python -m benchmarks.prefill_attention [--shapes 1b] [--lengths 4096 16384] [--base-so <build>.so]

A chunk of `--rows` rows (the engine's default prefill chunk, 512) whose last row is position L - 1 attends over its
sequence's first L positions in one layer's float16 pool (the cache `benchmarks.long_prompts` serves with) of the
shape (`benchmarks.attention_memory`'s SHAPES, on 2 MB pages as the engine places it): one `paged_decode_attention`
call, as the fused step makes it for a chunk (every row one block table; the kernel runs them in tiles of rows).
Reported: ms per call (median of `--reps`) and GFLOP/s of its scores and weighted values (4 H E flops per row and
position). `--base-so` names another build of the kernels (`benchmarks/kernel_ab.py` says how to get its path): it
runs on the same buffers in the same process, the sides alternating, with the ratio (> 1: this checkout faster) and
whether the two builds' outputs are bitwise the same. Random keys and queries: the cost does not depend on them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.attention_memory import BLOCK, SHAPES, kv_pool
from benchmarks.machine import machine_info
from model import kernels


def chunk_inputs(heads: int, kv_heads: int, dim: int, length: int, rows: int) -> tuple[torch.Tensor, ...]:
    """(q, k_pool, v_pool, rows, tables, lens, out) of a `rows`-row chunk ending at position length - 1."""
    torch.manual_seed(0)
    blocks = -(-length // BLOCK)
    k_pool, v_pool = kv_pool(blocks, kv_heads, dim), kv_pool(blocks, kv_heads, dim)
    q = torch.randn(rows, heads, dim)  # (rows, heads, dim)
    tables = (torch.arange(blocks) + 1).view(1, blocks).expand(rows, blocks).contiguous()  # (rows, blocks)
    lens = torch.arange(length - rows + 1, length + 1)  # row i: position length - rows + i
    return q, k_pool, v_pool, torch.arange(rows), tables, lens, torch.empty_like(q)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["1b"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--base-so", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    new = kernels.native()
    if new is None:
        raise SystemExit("this checkout's native kernels are off or failed to build")
    sides = {"new": new} | ({"base": kernels.import_built(args.base_so)} if args.base_so else {})
    results = {"machine": machine_info("cpu", torch.get_num_threads()), "rows": args.rows, "runs": []}
    for name in args.shapes:
        heads, kv_heads, dim, _ = SHAPES[name]
        for length in args.lengths:
            q, k_pool, v_pool, rows, tables, lens, out = chunk_inputs(heads, kv_heads, dim, length, args.rows)
            outs = {}
            for side, lib in sides.items():  # a warm-up call each, and its output
                lib.paged_decode_attention(q, k_pool, v_pool, rows, tables, lens, out)
                outs[side] = out.clone()
            times: dict[str, list[float]] = {side: [] for side in sides}
            for r in range(args.reps):  # which side first alternating
                for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                    t = time.perf_counter()
                    sides[side].paged_decode_attention(q, k_pool, v_pool, rows, tables, lens, out)
                    times[side].append(time.perf_counter() - t)
            flops = 4 * heads * dim * lens.double().sum().item()
            run = {"shape": name, "positions": length}
            median = {side: statistics.median(ts) for side, ts in times.items()}
            for side, s in median.items():
                run[side] = {"ms": round(s * 1e3, 3), "gflops": round(flops / s / 1e9, 1)}
            line = (f"{name:8s} {length:6d} positions, {args.rows} rows: {run['new']['ms']:9.3f} ms"
                    f" {run['new']['gflops']:6.1f} GFLOP/s")
            if "base" in sides:
                # from the unrounded medians: a short chunk's milliseconds round to zero
                run["ratio"] = round(median["base"] / median["new"], 3)
                run["bitwise_equal"] = torch.equal(outs["base"], outs["new"])
                line += (f"  | base {run['base']['ms']:9.3f} ms {run['base']['gflops']:6.1f} GFLOP/s: {run['ratio']:.2f}x,"
                         f" outputs {'the same' if run['bitwise_equal'] else 'DIFFER'}")
            results["runs"].append(run)
            print(line, flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
