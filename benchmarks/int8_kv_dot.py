"""The AVX2 integer dot of decode attention over an int8 KV cache: `vpmaddubsw` against the widening `vpmaddwd`, one
host, one process, the two builds alternating.

    .venv/bin/python -m benchmarks.int8_kv_dot [--contexts 8192 32768] [--rows 1] [--reps 15] [--out FILE]

An AVX2-alone build (no VNNI, AVX-512 or AMX: kernels.PORTABLE's first, `LLAMASCOPE_NATIVE_KERNELS=portable`)
scores a key of a head size of 32s as ggml's q8_0 dot does (ggml-cpu/arch/x86/quants.c `ggml_vec_dot_q8_0_q8_0`,
its AVX2 `mul_sum_i8_pairs_float`: `vpsignb` / `vpabsb`, then `vpmaddubsw` and `vpmaddwd` by ones), 32 products a
`vpmaddubsw`; the widening form it replaced sign-extends both sides to int16 and multiplies 16 pairs a `vpmaddwd`
(csrc/paged_attention.cpp `int_products8`). Here the same sources are built a second time with LS_INT8_KV_WIDEN,
which keeps the widening form for every head size, and both builds run `paged_decode_attention` on the same pools:
R decode rows of the Llama-3.2-1B attention shape (32 query heads, 8 KV heads, head size 64 by default) over C cached
positions each, block size 16, each sequence's blocks scattered. Both sides' integer scores are exact, so their
outputs must be equal (checked). Per context: each rep runs each side `--inner` calls in a row, which side first
alternating, and the medians of the calls; ratio > 1: the vpmaddubsw form is faster. The host is shared: medians of
alternating sides are what compares (the JSON keeps the load average before and after); with `--threads 1` the kernel
runs on the calling thread and the ratio is of its CPU time (`time.thread_time`), which leaves out the time other
processes held the core (wall time is kept beside it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import time
from pathlib import Path
from types import ModuleType

import torch

from benchmarks.machine import machine_info
from model import kernels
from model.kernels import extension, kv_int8

WIDEN = "-DLS_INT8_KV_WIDEN"


def widening_build() -> ModuleType:
    """The AVX2-alone build of these sources with LS_INT8_KV_WIDEN (built once into the kernels' folder, under a
    name of its own that compatible_build never matches: it writes no build.json)."""
    flags = kernels.compile_flags(True, []) + [WIDEN]
    h = kernels._with_sources(hashlib.sha256(" ".join(flags + [torch.__version__]).encode()))
    name = f"{kernels.NAME}_bench_widen_{h.hexdigest()[:12]}"
    directory = kernels.build_dir() / name
    so = directory / f"{name}.so"
    if so.is_file():
        return kernels.import_built(so)
    return extension.load(name=name, kernels=[kernels.CSRC / s for s in kernels.SOURCES],
                          bindings=kernels.CSRC / kernels.BINDINGS, entry=kernels.CSRC / kernels.ENTRY,
                          extra_cflags=flags, base_cflags=kernels.compile_flags(False), build_directory=str(directory),
                          objects=kernels.build_dir() / "objects")


def pools(rows: int, context: int, bs: int, K: int, E: int, seed: int):
    """int8 K and V pools (NB, bs, K, E + 4) holding `rows` sequences of `context` positions, each sequence's blocks
    scattered (tests/paged_pools.py does the same), and the block tables (rows, W)."""
    per = -(-context // bs)
    g = torch.Generator().manual_seed(seed)
    k = kv_int8.pack(torch.randn(rows * per, bs, K, E, generator=g))
    v = kv_int8.pack(torch.randn(rows * per, bs, K, E, generator=g))
    ids = list(range(rows * per))
    random.Random(seed).shuffle(ids)
    return k, v, torch.tensor(ids).view(rows, per)


def run(builds: dict[str, ModuleType], rows: int, context: int, H: int, K: int, E: int, reps: int, inner: int) -> dict:
    k, v, tables = pools(rows, context, 16, K, E, seed=context)
    q = torch.randn(rows, H, E, generator=torch.Generator().manual_seed(1))
    lens, which = torch.full((rows,), context), torch.arange(rows)
    outs = {side: torch.empty(rows, H, E) for side in builds}
    for side, lib in builds.items():
        lib.paged_decode_attention(q, k, v, which, tables, lens, outs[side])
    first, *others = outs.values()
    equal = all(torch.equal(first, o) for o in others)
    times: dict[str, list[float]] = {side: [] for side in builds}
    cpu: dict[str, list[float]] = {side: [] for side in builds}
    order = list(builds.items())
    for r in range(reps):
        for side, lib in (order if r % 2 == 0 else order[::-1]):
            for _ in range(inner):
                t, c = time.perf_counter(), time.thread_time()
                lib.paged_decode_attention(q, k, v, which, tables, lens, outs[side])
                cpu[side].append(time.thread_time() - c)
                times[side].append(time.perf_counter() - t)
    wall = {side: statistics.median(t) for side, t in times.items()}
    # one thread: the kernel runs on this thread alone, so its CPU time leaves out the time other processes of a
    # loaded host held the core (what the ratio is taken from); with more threads, wall time
    cpu_med = {side: statistics.median(t) for side, t in cpu.items()}
    med = cpu_med if torch.get_num_threads() == 1 else wall
    # bytes a call reads: every row's K and V rows (E quants + a 4-byte scale each) for each of its KV heads
    read = 2 * rows * context * K * (E + kv_int8.SCALE_BYTES)
    out = {"rows": rows, "context": context, "outputs_equal": equal,
           "timed": "thread CPU time" if med is cpu_med else "wall time",
           "median_ms": {s: m * 1e3 for s, m in med.items()},
           "median_wall_ms": {s: m * 1e3 for s, m in wall.items()},
           "median_cpu_ms": {s: m * 1e3 for s, m in cpu_med.items()},
           "gb_per_s": {s: read / m / 1e9 for s, m in med.items()},
           "ratio_widen_over_maddubs": med["widen (vpmaddwd)"] / med["maddubs (vpmaddubsw)"]}
    print(f"rows {rows}, {context} positions: " + ", ".join(f"{s} {m * 1e3:.3f} ms" for s, m in med.items())
          + f"; vpmaddubsw form {out['ratio_widen_over_maddubs']:.2f}x" + ("" if equal else "  OUTPUTS DIFFER"),
          flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.int8_kv_dot", description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--rows", type=int, nargs="+", default=[1])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--inner", type=int, default=5)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/int8-kv-dot-avx2.json"))
    args = p.parse_args(argv)
    if args.head_dim % 32:
        raise SystemExit("--head-dim: a multiple of 32 (the head sizes the vpmaddubsw form serves)")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    maddubs = kernels.load(vnni=[])
    if not maddubs.avx2 or maddubs.vnni:
        raise SystemExit("the AVX2-alone build needs a CPU with AVX2, FMA and F16C")
    builds = {"maddubs (vpmaddubsw)": maddubs, "widen (vpmaddwd)": widening_build()}
    result = {"machine": machine_info("cpu", args.threads), "loadavg_before": load_before,
              "builds": {"maddubs (vpmaddubsw)": kernels.compile_flags(True, []),
                         "widen (vpmaddwd)": kernels.compile_flags(True, []) + [WIDEN]},
              "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "block_size": 16},
              "reps": args.reps, "inner": args.inner, "runs": []}
    for rows in args.rows:
        for context in args.contexts:
            result["runs"].append(run(builds, rows, context, args.heads, args.kv_heads, args.head_dim, args.reps,
                                      args.inner))
    result["loadavg_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["outputs_equal"] for r in result["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
