"""The native linear kernels alone: GMAC/s of int4, int8 and float32 on the default model's block shapes, by rows.

    .venv/bin/python -m benchmarks.gemm                       # 1, 32, 128 and 512 rows, all cores
    .venv/bin/python -m benchmarks.gemm --threads 1 --rows 128
    .venv/bin/python -m benchmarks.gemm --stream-mb 0       # skip the from-memory measurement

One block's four matrices (fused q/k/v 960 x 576, wo 576 x 576, fused gate/up 3072 x 576, w2 576 x 1536) from random
weights, through the kernels every CPU step runs (model/kernels/csrc/quant_linear.cpp, float_linear.cpp): the
activation rounding included for the quantized ones, nothing else around them (no module call). The matrices fit in
the caches, so one row measures the kernels' arithmetic, not the memory a real decode step streams from
(`benchmarks.bench_decode` measures that). Sides alternate within each round; medians of the rounds.

From memory (`--stream-mb`, default 256): one row through many copies of the block's four matrices, about that many
MB of each precision's weights in all, several times the last-level cache, in a layer's order: each matrix is read
from memory once, as in a decode step. Twice: the copies on 4 KB pages (a plain allocation) and on 2 MB pages (as
the loader places a model's weights, model/huge_pages.py). Reported as GB/s of weights read, beside the plain read
bandwidth (a sum over a large tensor) measured in the same round. `--stream-rows R` does the same with R rows a call,
as a step of R streams reads its weights.

A narrow model's float32 LM head (`--head V K`, e.g. `--head 49152 64`: the served tiny model's; 0: skip): our
`float_linear` against PyTorch's GEMM (`F.linear`, MKL / oneDNN) on the same weights, by rows, alternating; the
rows from 16 up take its packed tiles where K <= 256 (model/kernels/csrc/float_linear.cpp).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.ceilings import read_bandwidth
from benchmarks.machine import machine_info
from model import huge_pages, kernels
from model.quantize import Int4Linear, Int8Linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of the default model's block matrices


def _sides(native) -> dict[str, list]:
    """Per precision, one callable per shape: x (M, in) -> (M, out) through that precision's native kernel."""
    torch.manual_seed(0)
    sides: dict[str, list] = {"int4": [], "int8": [], "float32": []}
    for n, k in SHAPES:
        w = torch.randn(n, k) * 0.05
        for name, layer in (("int4", Int4Linear.from_float(w)), ("int8", Int8Linear.from_float(w))):
            op, buffers = getattr(native, layer.native_op), layer.native_buffers()
            sides[name].append((k, lambda x, op=op, buffers=buffers: op(x, *buffers)))
        sides["float32"].append((k, lambda x, w=w: native.float_linear(x, w)))
    return sides


def _copies(native, total_mb: int) -> dict[str, list]:
    """Per precision, (weight bytes, one-row callables over copies of the block's four matrices totalling about
    total_mb MB): every call reads its matrix from memory."""
    torch.manual_seed(1)
    out: dict[str, list] = {}
    mats = [torch.randn(n, k) * 0.05 for n, k in SHAPES]
    for name in ("int4", "int8", "float32"):
        if name == "float32":
            one = [(k, [w], native.float_linear) for (n, k), w in zip(SHAPES, mats)]
        else:
            cls = Int4Linear if name == "int4" else Int8Linear
            one = [(k, cls.from_float(w).native_buffers(), getattr(native, cls.native_op)) for (n, k), w in zip(SHAPES, mats)]
        block = sum(b.nbytes for _, bufs, _ in one for b in bufs)
        copies = max(1, total_mb * 2**20 // block)
        calls = [(k, op, [b.clone() for b in bufs]) for _ in range(copies) for k, bufs, op in one]
        out[name] = [block * copies, calls]
    return out


def _on_huge_pages(calls: list) -> list:
    """The same calls with their weight buffers copied into one arena on 2 MB pages (model/huge_pages.py)."""
    sizes = [-(-b.nbytes // 64) * 64 for _, _, bufs in calls for b in bufs]
    base, offset, out = huge_pages.arena(sum(sizes)), 0, []
    for k, op, bufs in calls:
        moved = []
        for b in bufs:
            moved.append(base[offset : offset + b.nbytes].view(b.dtype).view(b.shape).copy_(b))
            offset += -(-b.nbytes // 64) * 64
        out.append((k, op, moved))
    return out


def measure_stream(total_mb: int, rounds: int, rows: int = 1) -> dict:
    """`rows` rows (1: a decode step's) from memory: GB/s of weights read per precision, on 4 KB pages (as a plain
    allocation gets them) and on 2 MB pages (as the loader places the weights), and the plain read bandwidth; medians
    of rounds."""
    native = kernels.native()
    sides = _copies(native, total_mb)
    for name in list(sides):
        sides[name + " huge pages"] = [sides[name][0], _on_huge_pages(sides[name][1])]
    xs = {k: torch.randn(rows, k) for _, k in SHAPES}
    per: dict[str, list[float]] = {name: [] for name in [*sides, "read"]}
    for _ in range(rounds):
        for name, (nbytes, calls) in sides.items():
            for k, op, bufs in calls:  # warm: the first pass faults the pages in
                op(xs[k], *bufs)
            t = time.perf_counter()
            for k, op, bufs in calls:
                op(xs[k], *bufs)
            per[name].append(nbytes / (time.perf_counter() - t) / 1e9)
        per["read"].append(read_bandwidth("cpu", mb=total_mb))
    gbs = {name: statistics.median(v) for name, v in per.items()}
    return {"mb": total_mb, "rows": rows, "gb_s": gbs, "rounds": per,
            "of_read": {name: gbs[name] / gbs["read"] for name in sides},
            "huge_pages_over_4k": {name: gbs[name + " huge pages"] / gbs[name] for name in ("int4", "int8", "float32")}}


def measure(rows: list[int], rounds: int, min_seconds: float = 0.2) -> dict:
    native = kernels.native()
    if native is None:
        raise SystemExit(f"native kernels unavailable: {kernels.status()}")
    sides, macs = _sides(native), sum(n * k for n, k in SHAPES)
    out: dict[str, dict] = {}
    for m in rows:
        xs = {k: torch.randn(m, k) for _, k in SHAPES}
        reps = max(3, int(min_seconds * 50e9 / (macs * m)))  # about min_seconds a side at 50 GMAC/s
        per: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(rounds):
            for name, calls in sides.items():
                for k, f in calls:
                    f(xs[k])  # warm
                t = time.perf_counter()
                for _ in range(reps):
                    for k, f in calls:
                        f(xs[k])
                per[name].append(macs * m * reps / (time.perf_counter() - t) / 1e9)
        gmac = {name: statistics.median(v) for name, v in per.items()}
        out[str(m)] = {"gmac_s": gmac, "rounds": per, "int4_over_float32": gmac["int4"] / gmac["float32"],
                       "int8_over_float32": gmac["int8"] / gmac["float32"]}
    return out


def measure_head(vocab: int, k: int, rows: list[int], rounds: int, min_seconds: float = 0.2) -> dict:
    """An LM head (vocab, k) float32: GMAC/s of `float_linear` and of F.linear by rows, medians of rounds."""
    native = kernels.native()
    torch.manual_seed(2)
    w = torch.randn(vocab, k) * 0.05
    out: dict[str, dict] = {}
    for m in rows:
        x = torch.randn(m, k)
        sides = {"ours": lambda: native.float_linear(x, w), "torch": lambda: F.linear(x, w)}
        reps = max(3, int(min_seconds * 20e9 / (vocab * k * m)))
        per: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(rounds):
            for name, f in sides.items():
                f()
                t = time.perf_counter()
                for _ in range(reps):
                    f()
                per[name].append(vocab * k * m * reps / (time.perf_counter() - t) / 1e9)
        gmac = {name: statistics.median(v) for name, v in per.items()}
        out[str(m)] = {"gmac_s": gmac, "rounds": per, "ours_over_torch": gmac["ours"] / gmac["torch"]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128, 512])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stream-mb", type=int, default=256, help="one row from memory over this many MB a precision (0: skip)")
    p.add_argument("--stream-rows", type=int, default=1, help="rows a call in the from-memory measurement (R: a "
                   "decode step of R streams)")
    p.add_argument("--head", type=int, nargs=2, default=[49152, 64], metavar=("V", "K"),
                   help="a float32 LM head's shape, ours against F.linear (0 0: skip)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu-gemm.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = measure(args.rows, args.rounds)
    print(f"native linear kernels, default model's block shapes, {torch.get_num_threads()} threads; GMAC/s, median of {args.rounds}")
    print(f"{'rows':>6} {'int4':>8} {'int8':>8} {'float32':>8} {'int4/f32':>9} {'int8/f32':>9}")
    for m, r in results.items():
        g = r["gmac_s"]
        print(f"{m:>6} {g['int4']:8.1f} {g['int8']:8.1f} {g['float32']:8.1f} {r['int4_over_float32']:8.2f}x {r['int8_over_float32']:8.2f}x")
    report = {"machine": machine_info("cpu", torch.get_num_threads()), "shapes": SHAPES, "rows": results}
    if args.head[0]:
        report["head"] = {"shape": args.head, "rows": measure_head(*args.head, args.rows, args.rounds)}
        for m, r in report["head"]["rows"].items():
            g = r["gmac_s"]
            print(f"LM head {args.head[0]} x {args.head[1]}, {m} rows: ours {g['ours']:.1f}, F.linear {g['torch']:.1f} "
                  f"GMAC/s ({r['ours_over_torch']:.2f}x)")
    if args.stream_mb:
        report["stream"] = st = measure_stream(args.stream_mb, args.rounds, args.stream_rows)
        g = st["gb_s"]
        for pages in ("", " huge pages"):
            print(f"{args.stream_rows} row(s) from memory ({args.stream_mb} MB a precision), GB/s of weights read on "
                  f"{'2 MB' if pages else '4 KB'} pages: int4 {g['int4' + pages]:.1f}, int8 {g['int8' + pages]:.1f}, "
                  f"float32 {g['float32' + pages]:.1f}")
        print(f"a plain read: {g['read']:.1f} GB/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
