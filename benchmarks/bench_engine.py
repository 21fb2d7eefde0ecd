"""Engine benchmark: llamascope beside Hugging Face transformers, same weights, dtype, device and threads, one run.

    .venv/bin/python -m benchmarks.bench_engine [--model PATH] [--dtype float32] [--device cpu|cuda] [--threads N]
                                                [--out results.json] [--quick] [--skip-hf]

1. single stream: one greedy request (128-token prompt, 128 new tokens): TTFT and decode tok/s;
2. concurrent: 32 requests at once (prompts 32-512 tokens, 128 new tokens each): output tok/s, TTFT p50/p99;
3. memory: peak RSS of the serving phase beside the weights and the KV pool it must hold.

The phases run one after the other in one process: ours first (its memory is measured before transformers'
model exists), then the peer. Definitions of every number: `benchmarks/measure.py` and the README there.
"""

from __future__ import annotations

import os

# Before torch and transformers import tqdm, which reads TQDM_* defaults once, at import: both loaders' progress
# bars would bury the report. HF_HUB_OFFLINE: the peer loads a local file, nothing may reach a hub.
for _var, _value in (("TQDM_DISABLE", "1"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "error")):
    os.environ.setdefault(_var, _value)

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
from model.dtypes import DTYPES

from benchmarks import ceilings, hf_peer, ours
from benchmarks.machine import MB, PeakRSS, machine_info, rss_mb
from benchmarks.measure import Clock
from benchmarks.report import compare, print_report
from benchmarks.workload import WorkloadSizes, make_workload

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_engine", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--quantization", choices=["none", "int8", "int4"], default="none",
                   help="ours: weight-only int8/int4 linear layers (CPU); the peer stays in --dtype")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads, both sides (default: all cores)")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default: benchmarks/results/<device>-<dtype>.json)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test (4 requests, 8 new tokens)")
    p.add_argument("--skip-hf", action="store_true", help="ours only")
    w = p.add_argument_group("workload (defaults: full run, or --quick's)")
    w.add_argument("--num-requests", type=int)
    w.add_argument("--min-prompt-len", type=int)
    w.add_argument("--max-prompt-len", type=int)
    w.add_argument("--max-tokens", type=int, help="new tokens per concurrent request")
    w.add_argument("--single-prompt-len", type=int)
    w.add_argument("--single-max-tokens", type=int)
    w.add_argument("--seed", type=int)
    w.add_argument("--hf-sequential-requests", type=int, default=4,
                   help="run HF one-at-a-time on this many requests and extrapolate the rest (0: all)")
    e = p.add_argument_group("engine")
    e.add_argument("--kv-cache-mb", type=int, default=1024, help="KV block pool size")
    e.add_argument("--max-num-seqs", type=int, default=32)
    e.add_argument("--max-num-batched-tokens", type=int, default=512)
    e.add_argument("--intervened-fraction", type=float, default=0.0,
                   help="also run the concurrent workload with this fraction of the requests carrying one `add` on "
                        "every block's output (each its own vector), alternating with the plain run --intervened-rounds "
                        "times on an engine without prefix caching (so neither run reuses the other's blocks)")
    e.add_argument("--intervened-rounds", type=int, default=3)
    e.add_argument("--steer-sae", metavar="PATH",
                   help="with --intervened-fraction: the intervened requests steer by a feature of this dictionary "
                        "instead (each its own feature, all positions; docs/inspection.md#steering-by-feature); "
                        "'random-jumprelu': a random 4,096-feature JumpReLU at block 15's output "
                        "(benchmarks/features_cost.py's write_sae)")
    e.add_argument("--steer-op", choices=["add", "clamp"], default="add",
                   help="with --steer-sae: add scale x the feature's decoder row, or clamp its activation")
    e.add_argument("--steer-amount", type=float, default=8.0, help="with --steer-sae: add's scale, clamp's value")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.threads is None or args.threads < 1:
        p.error("--threads must be >= 1")
    return args


def _sizes(args: argparse.Namespace) -> WorkloadSizes:
    sizes = WorkloadSizes.quick() if args.quick else WorkloadSizes()
    for name in ("num_requests", "min_prompt_len", "max_prompt_len", "max_tokens", "single_prompt_len",
                 "single_max_tokens", "seed"):
        if getattr(args, name) is not None:
            setattr(sizes, name, getattr(args, name))
    return sizes


def _progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _tokens_check(ours_tokens: list[int], peer_tokens: list[int]) -> dict:
    i = _first_mismatch(ours_tokens, peer_tokens)
    return {"equal": i is None, "first_mismatch": i}


def _same_outputs(a: list[list[int]] | None, b: list[list[int]] | None) -> int | None:
    return None if a is None or b is None else sum(x == y for x, y in zip(a, b))


def run(args: argparse.Namespace) -> dict:
    from model.engine import Engine, EngineConfig
    from model.loaders.checkpoint import load_model
    from model.engine.paged_cache import PagedKVCache
    from model.quantize import QuantLinear

    torch.set_num_threads(args.threads)
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    sizes = _sizes(args)
    mem = PeakRSS(device)
    memory: dict = {"baseline_rss_mb": rss_mb()}  # interpreter + torch (+ whatever imported us), no model yet

    # ---- ours -------------------------------------------------------------------------------------------------
    _progress(f"llamascope: loading {args.model or 'the default model'} ({args.dtype}, {device})")
    mem.reset()
    lm = load_model(args.model, dtype, device, quantization=args.quantization)
    memory["ours_load"] = mem.read()
    config = EngineConfig(kv_cache_bytes=args.kv_cache_mb * MB, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    engine = Engine(lm.model, lm.tokenizer, config)
    workload = make_workload(lm.tokenizer, lm.model.config.vocab_size, sizes)
    per_block = PagedKVCache.bytes_per_block(lm.model.config, config.block_size, lm.model.dtype)
    # Tied embeddings counted once; quantized layers hold their weights as buffers, counted as weights here.
    quantized = {id(b) for m in lm.model.modules() if isinstance(m, QuantLinear) for b in m.buffers()}
    weights = sum(p.nbytes for p in lm.model.parameters()) + sum(b.nbytes for b in lm.model.buffers() if id(b) in quantized)
    buffers = sum(b.nbytes for b in lm.model.buffers() if id(b) not in quantized)
    memory.update(
        weights_mb=weights / MB, buffers_mb=buffers / MB, kv_pool_mb=engine.cache.nbytes / MB,
        kv_pool_tokens=engine.cache.num_blocks * config.block_size, kv_bytes_per_token=per_block / config.block_size,
        ours_rss_after_engine_mb=rss_mb(),
    )
    _progress("llamascope: matmul ceilings")
    ceil = ceilings.measure(lm.model, args.max_num_batched_tokens, reps=4 if args.quick else 20)
    ceil["concurrent_workload"] = ceilings.workload_bound(
        ceil, sum(len(p) for p in workload.prompts), len(workload.prompts) * sizes.max_tokens)
    mem.reset()
    _progress("llamascope: warm-up, single stream, concurrent")
    ours.warm_up(engine, lm.model.config.vocab_size)
    clock = Clock(device)
    single = {"ours": ours.run_single(engine, workload.single_prompt, sizes.single_max_tokens, clock)}
    conc = {"ours": ours.run_concurrent(engine, workload.prompts, sizes.max_tokens, clock)}
    serve = memory["ours_serve"] = mem.read()
    intervened = _intervened_phase(args, lm, config, workload, sizes, clock) if args.intervened_fraction > 0 else None
    # What the engine holds beyond its two big allocations (on CUDA both live in GPU memory, so the decomposition
    # is of the peak allocated there): interpreter and torch on CPU, activations, sampler and bookkeeping.
    held = serve["cuda_peak_allocated_mb"] if device.type == "cuda" else serve["peak_rss_mb"]
    memory["ours_serve_overhead_mb"] = held - memory["weights_mb"] - memory["kv_pool_mb"]
    model_info = {"name": lm.name, "path": str(lm.path), "dtype": args.dtype, "quantization": args.quantization,
                  "device": str(device),
                  "num_parameters": lm.model.config.num_parameters(), "load_s": lm.load_seconds}
    model_path = lm.path
    del engine, lm  # the peer's memory is measured without ours resident
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # ---- the peer ---------------------------------------------------------------------------------------------
    if not args.skip_hf:
        _progress("transformers: loading the same checkpoint")
        memory["hf_rss_before_load_mb"] = rss_mb()
        mem.reset()
        t0 = time.perf_counter()
        hf = hf_peer.load_hf(model_path, dtype, device)
        model_info["hf_load_s"] = time.perf_counter() - t0
        memory["hf_load"] = mem.read()
        mem.reset()
        _progress("transformers: warm-up, single stream (generate, forward loop)")
        hf_peer.warm_up(hf)
        single["hf_generate"] = hf_peer.generate_single(hf, workload.single_prompt, sizes.single_max_tokens, clock)
        single["hf_forward_loop"] = hf_peer.forward_loop(hf, workload.single_prompt, sizes.single_max_tokens, clock)
        _progress("transformers: concurrent, one at a time")
        conc["hf_sequential"] = hf_peer.run_sequential(hf, workload.prompts, sizes.max_tokens, clock,
                                                       args.hf_sequential_requests or None)
        _progress("transformers: concurrent, one padded batch")
        conc["hf_batched"] = hf_peer.run_batched(hf, workload.prompts, sizes.max_tokens, clock)
        memory["hf_serve"] = mem.read()
        del hf
        gc.collect()
    mem.read()
    memory["process_peak_rss_mb"] = mem.process_peak_mb

    single_out = {k: v.summary() for k, v in single.items()}
    single_out["ours_tokens"] = single["ours"].token_ids
    single_out["tokens_match"] = {k: _tokens_check(single["ours"].token_ids, v.token_ids)
                                  for k, v in single.items() if k != "ours"}
    conc_out = {k: v.summary() for k, v in conc.items()}
    conc_out["same_tokens_as_ours"] = {k: _same_outputs(conc["ours"].token_ids, v.token_ids)
                                       for k, v in conc.items() if k != "ours"}
    return {
        "schema": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python -m benchmarks.bench_engine", *getattr(args, "argv", [])]),
        "quick": args.quick,
        "machine": machine_info(device, args.threads),
        "model": model_info,
        "engine_config": vars(config),
        "workload": workload.describe(),
        "single_stream": single_out,
        "concurrent": conc_out,
        "memory": memory,
        "ceilings": ceil,
        "ratios": compare(single_out, conc_out),
        "concurrent_intervened": intervened,
    }


def _intervened_phase(args, lm, config, workload, sizes, clock) -> dict:
    """The concurrent workload plain and with a fraction of its requests intervened, alternating, on one engine
    without prefix caching: output tok/s of each run, and the median of the per-round ratios."""
    import dataclasses
    import statistics

    from model.engine import Engine

    engine = Engine(lm.model, lm.tokenizer, dataclasses.replace(config, enable_prefix_caching=False))
    ours.warm_up(engine, lm.model.config.vocab_size)
    n = len(workload.prompts)
    every = max(1, round(1 / args.intervened_fraction))
    if args.steer_sae:
        from model.features.sae import load_dictionary

        if args.steer_sae == "random-jumprelu":
            import tempfile

            from benchmarks.features_cost import write_sae

            folder = Path(tempfile.mkdtemp()) / "random-jumprelu"
            write_sae(folder, lm.model.config.dim, 4096, "blocks.15.hook_resid_post", architecture="jumprelu")
            d = load_dictionary(folder, config=lm.model.config)
        else:
            d = load_dictionary(args.steer_sae, config=lm.model.config)
        edits = [ours.steer_by_feature(d, args.steer_op, i, args.steer_amount) if i % every == 0 else None
                 for i in range(n)]
        what = f"{args.steer_op} of one feature of {Path(args.steer_sae).name} ({args.steer_amount:g}), all positions, " \
               "each request its own feature"
    else:
        edits = [ours.add_every_layer(lm.model.config, seed=i) if i % every == 0 else None for i in range(n)]
        what = "one add on every block's output, all positions, each request its own vector"
    plain, edited, ratios = [], [], []
    for r in range(args.intervened_rounds):
        _progress(f"llamascope: concurrent plain / intervened, round {r + 1}/{args.intervened_rounds}")
        def plain_run():
            return ours.run_concurrent(engine, workload.prompts, sizes.max_tokens, clock, tag=f"p{r}").summary()

        def edited_run():
            return ours.run_concurrent(engine, workload.prompts, sizes.max_tokens, clock, tag=f"e{r}",
                                       interventions=edits).summary()

        if r % 2 == 0:  # the order alternates, so a load that drifts during a round weighs on both sides
            a, b = plain_run(), edited_run()
        else:
            b, a = edited_run(), plain_run()
        plain.append(a["throughput_tok_s"])
        edited.append(b["throughput_tok_s"])
        ratios.append(edited[-1] / plain[-1])
    return {"intervened_requests": sum(e is not None for e in edits), "requests": n,
            "intervention": what,
            "plain_tok_s_rounds": plain, "intervened_tok_s_rounds": edited, "ratio_rounds": ratios,
            "ratio_median": statistics.median(ratios), "load_avg": list(os.getloadavg())}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    results = run(args)
    quant = f"-{args.quantization}" if args.quantization != "none" else ""
    out = args.out or RESULTS_DIR / f"{args.device}-{args.dtype}{quant}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print_report(results)
    if results["concurrent_intervened"]:
        c = results["concurrent_intervened"]
        print(f"\nconcurrent, {c['intervened_requests']} of {c['requests']} requests intervened ({c['intervention']}): "
              f"{c['ratio_median']:.3f}x the plain run's output tok/s (median of {len(c['ratio_rounds'])} alternating "
              f"rounds: plain {', '.join(f'{x:.1f}' for x in c['plain_tok_s_rounds'])}, intervened "
              f"{', '.join(f'{x:.1f}' for x in c['intervened_tok_s_rounds'])}; load {c['load_avg']})")
    print(f"\nresults: {out}")
    return results


if __name__ == "__main__":
    main()
