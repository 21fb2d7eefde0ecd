"""Two builds of the native kernels in one process on a real file's layers: A/B for a kernel change on a noisy host.

    .venv/bin/python -m benchmarks.kernel_ab --base-so <base build>.so --rows 1 32 512 --model <file.gguf> ...

The base build's path, printed in the base checkout (which builds it if needed):
`.venv/bin/python -c "from model import kernels; kernels.native(); print(kernels.build_dir() / kernels.module_name())"`
then `/<that name>.so` appended. `benchmarks.ab` alternates whole processes; on a shared VM their speeds move 10-20%
from one minute to the next, more than a kernel change. Here both builds (the base's and this checkout's, built if
needed) are loaded side by side (pybind11 modules of different names) and called on the same buffers: every linear
layer of the file (its table and head left out) as the server loads it (`--quantization auto`), random activations
of R rows. Per kind of layer (Int4 symmetric / Q4_K scales / Int6 / Int8) the sum over layers of each call's median
of `--reps` runs of `max(1, 64 // R)` calls a side, which side first alternating, as GMAC/s; and one pass of R rows
through all the layers in turn (one row: weights from memory, as a decode step reads them), medians of the passes,
alternating likewise. Ratios > 1: this checkout faster. A line says where the two builds' outputs differ.

`--types Q4_K Q6_K Q8_0 Q4_0`: only the layers a file's tensors of those GGUF types become (TYPE_KINDS: Q4_K ->
Int4Linear-kq, Q4_0 -> Int4Linear-sym, Q6_K -> Int6Linear, Q8_0 and what is requantized to int8 -> Int8Linear),
e.g. each type of a Q4_K_M file alone; `--rows` any row counts (1 16 32 512). `--json FILE`: the figures, each row
count's and kind's, with the host and both builds' instruction sets, written there. To A/B the AVX2-only build on a
host with more, run with `LLAMASCOPE_NATIVE_KERNELS=portable` and a base .so of the same kind (kernels.module_name's
name with the flags `[]`: `kernels.build_dir() / kernels.module_name([])`).

`--step`: instead, whole steps of `step_layers` (csrc/step_layers.cpp: every block of the file in one call, as
the engine's native step runs it), R decode rows each over `--context` cached positions of a float16 pool, the two
builds alternating, medians of `--reps` x `max(1, 16 // R)` calls a side.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from pathlib import Path
from types import ModuleType

import torch

from benchmarks.machine import machine_info
from model import kernels
from model.loaders.checkpoint import load_model
from model.quantize import QuantLinear


# a GGUF type -> the kind of layer (kind()) the server loads its tensors as (model/loaders/gguf_blocks.py)
TYPE_KINDS = {"Q4_K": "Int4Linear-kq", "Q4_0": "Int4Linear-sym", "Q6_K": "Int6Linear", "Q8_0": "Int8Linear"}


def built_for(lib: ModuleType) -> str:
    """A loaded build's instruction set (kernels.instruction_set), from the build.json beside its .so."""
    try:
        return kernels.instruction_set(json.loads((Path(lib.__file__).parent / "build.json").read_text())["flags"])
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"


def kind(m: QuantLinear) -> str:
    layout = "-kq" if getattr(m, "k_scales", False) else "-sym" if getattr(m, "symmetric", False) else ""
    return type(m).__name__ + layout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-so", type=Path, required=True)
    p.add_argument("--model", type=Path, nargs="+", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 512])
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--types", nargs="+", choices=sorted(TYPE_KINDS), default=None,
                   help="only the layers of these GGUF types (default: every quantized layer)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--step", action="store_true", help="whole step_layers steps instead of the linear layers")
    p.add_argument("--context", type=int, default=512, help="with --step: cached positions each row attends over")
    args = p.parse_args()
    base, new = kernels.import_built(args.base_so), kernels.native()
    if new is None:
        raise SystemExit("this checkout's native kernels are off or failed to build")
    torch.manual_seed(0)
    wanted = None if args.types is None else {TYPE_KINDS[t] for t in args.types}
    report = {"machine": machine_info("cpu", torch.get_num_threads()), "loadavg_before": os.getloadavg(),
              "setting": os.environ.get(kernels.ENV_VAR, "1"),
              "builds": {"base": {"so": str(args.base_so), "built_for": built_for(base)},
                         "new": {"so": str(new.__file__), "built_for": built_for(new)}}, "runs": []}
    print(f"base built for {report['builds']['base']['built_for']}, new for {report['builds']['new']['built_for']}",
          flush=True)
    for path in args.model:
        lm = load_model(str(path), quantization="auto")
        if args.step:
            for rows in args.rows:
                step_ab(path.name, lm.model, base, new, rows, args.context, args.reps)
            continue
        layers = [m for n, m in lm.model.named_modules() if isinstance(m, QuantLinear)
                  and m.native_buffers() is not None and "embed" not in n and "head" not in n
                  and (wanted is None or kind(m) in wanted)]
        for rows in args.rows:
            calls = [(kind(m), m.in_features * m.out_features * rows, m.native_op, m.native_buffers(),
                      torch.randn(rows, m.in_features)) for m in layers]
            differ = 0
            inner = max(1, 64 // rows)  # a call of one row is tens of microseconds: many of them
            med = {side: collections.defaultdict(float) for side in ("base", "new")}
            macs: dict[str, float] = collections.defaultdict(float)
            for k, mac, op, bufs, x in calls:
                fa, fb = getattr(base, op), getattr(new, op)
                if not torch.equal(fa(x, *bufs), fb(x, *bufs)):
                    print(f"  {path.name} {op} rows {rows}: the builds' outputs differ")
                    differ += 1
                times: dict[str, list[float]] = {"base": [], "new": []}
                for r in range(args.reps):  # each side `inner` calls in a row, which side first alternating
                    for side, f in ((("base", fa), ("new", fb)) if r % 2 == 0 else (("new", fb), ("base", fa))):
                        for _ in range(inner):
                            t = time.perf_counter(); f(x, *bufs); times[side].append(time.perf_counter() - t)
                for side in med:
                    med[side][k] += statistics.median(times[side])
                macs[k] += mac

            def one_pass(lib: ModuleType) -> float:
                t = time.perf_counter()
                for _, _, op, bufs, x in calls:
                    getattr(lib, op)(x, *bufs)
                return time.perf_counter() - t

            passes: dict[str, list[float]] = {"base": [], "new": []}
            for r in range(args.reps):
                for side, lib in ((("base", base), ("new", new)) if r % 2 == 0 else (("new", new), ("base", base))):
                    passes[side].append(one_pass(lib))
            pa, pb = statistics.median(passes["base"]), statistics.median(passes["new"])
            gmacs = {side: {k: macs[k] / med[side][k] / 1e9 for k in macs} for side in med}
            by_kind = "  ".join(f"{k} {gmacs['base'][k]:.1f} -> {gmacs['new'][k]:.1f} GMAC/s"
                                f" ({med['base'][k] / med['new'][k]:.2f}x)" for k in macs)
            print(f"{path.name} rows {rows}: {by_kind}  | a pass {pa * 1e3:.1f} -> {pb * 1e3:.1f} ms ({pa / pb:.2f}x)",
                  flush=True)
            report["runs"].append({"model": path.name, "rows": rows, "outputs_differ": differ,
                                   "gmac_s": gmacs, "ratio": {k: med["base"][k] / med["new"][k] for k in macs},
                                   "pass_ms": {"base": pa * 1e3, "new": pb * 1e3}, "pass_ratio": pa / pb})
    report["loadavg_after"] = os.getloadavg()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")


def step_ab(name: str, model, base: ModuleType, new: ModuleType, rows: int, context: int, reps: int) -> None:
    """One decode step of `rows` rows over `context` positions each, every block in one step_layers call, on both
    builds (the base's takes the arguments of a LLaMA step: no family switches), alternating."""
    from model.engine.native_step import NativeStep
    from model.engine.paged_cache import PagedKVCache
    from model.transformer import rotary_tables

    nd = NativeStep.for_model(model)
    c, bs = model.config, 16
    per_row = -(-(context + 1) // bs)
    cache = PagedKVCache.for_model(model, rows * per_row, bs, torch.float16)
    cache.k.normal_(), cache.v.normal_()
    tables = torch.arange(rows * per_row).view(rows, per_row)
    lens = torch.full((rows,), context + 1)
    slots = tables[:, context // bs] * bs + context % bs
    cos, sin = rotary_tables(*model.rope(lens[None] - 1), model.dtype)
    h = torch.randn(rows, c.dim)
    args = (h, nd.layers, nd.eps, cos.view(-1, c.head_dim), sin.view(-1, c.head_dim), cache.k, cache.v, slots,
            torch.arange(rows), tables, lens, nd.H, nd.K, nd.E, [], [])
    outs = {side: lib.step_layers(*args) for side, lib in (("base", base), ("new", new))}
    if not torch.equal(outs["base"], outs["new"]):
        print(f"  {name} step of {rows} rows: the builds' outputs differ")
    inner = max(1, 16 // rows)
    times: dict[str, list[float]] = {"base": [], "new": []}
    for r in range(reps):
        for side, lib in ((("base", base), ("new", new)) if r % 2 == 0 else (("new", new), ("base", base))):
            for _ in range(inner):
                t = time.perf_counter(); lib.step_layers(*args); times[side].append(time.perf_counter() - t)
    tb, tn = statistics.median(times["base"]), statistics.median(times["new"])
    print(f"{name} step_layers, {rows} rows x {context} positions: {tb * 1e3:.2f} -> {tn * 1e3:.2f} ms a step "
          f"({tb / tn:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
