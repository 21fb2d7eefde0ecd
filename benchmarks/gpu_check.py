"""The GPU path's one device check: every check a first contact with a CUDA machine needs, within eight minutes on
one H100 or H200, a verdict line each, and one JSON.

    .venv/bin/python -m benchmarks.gpu_check              # on the CUDA machine (a CUDA build of the pinned torch)
    .venv/bin/python -m benchmarks.gpu_check --dry-run    # every check's CPU-side set-up, on CPU (the test suite runs it)

The checks, in order (a verdict line each: PASS, FAIL, or DRY where --dry-run ran its set-up only):
- versions: torch (the Dockerfile's TORCH_VERSION pin), its CUDA, Triton, the device and its driver;
- triton_kernels: tests/triton_interpret_check.py compiled for the device: decode and prefill kernels against SDPA
  in float32, bfloat16 and float16, over an int8 cache, the telemetry variant, split-KV at 8k and 32k positions,
  and the engine on the Triton path against the gather path (dry run: one case of each, in Triton's interpreter);
- gpu_tests: the tests marked `gpu` (dry run: collected);
- sync_free_decode: steady decode steps under `torch.cuda.set_sync_debug_mode("error")`: no step synchronizes
  with the device except through its one event (dry run: the same steps on a simulated device);
- overlap_equals_serial: the overlapped step's tokens equal the serial step's, greedy and seeded sampling;
- graphs_equal_eager: decode steps replayed as CUDA graphs give the eager steps' tokens;
- lora_interventions_graphs: rows under a LoRA adapter and rows with interventions, on the graphs, give the eager
  engine's tokens;
- long_context_decode: the Triton decode kernel alone, one stream at 8k and 32k positions (the 7B's attention
  shape), split-KV against the one-program loop (target: >= 2x at 32k), outputs equal;
- decode_benchmark: benchmarks/gpu.py's decode-only run (1, 32 and 128 streams, the engine against the static
  decoder, the HBM fraction single stream) on the default model's shape and a Llama-2-7B shape (random bfloat16
  weights); targets: engine >= 0.9x the static decoder at each level on the 7B, >= 60% of the HBM roofline.

The JSON (benchmarks/results/gpu-check.json; --out) is rewritten after each check. A check that would start after
the time budget is spent is recorded as not run and fails the run: nothing is skipped silently. Exit status 0 only
when every check passed (or, with --dry-run, ran its set-up).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu-check.json"
BUDGET_S = 480  # eight minutes for the whole script
# HBM spec bandwidth by device name (TB/s): NVIDIA's data sheets (H100 SXM5 3.35, H100 PCIe 2.0, H200 4.8)
HBM_TB_S = {"H200": 4.8, "H100 PCIe": 2.0, "H100": 3.35, "A100": 2.0}
TARGETS = {"engine_vs_static": 0.9, "hbm_fraction": 0.6, "split_kv_speedup_32k": 2.0}


def _progress(msg: str) -> None:
    print(f"[gpu_check] {msg}", file=sys.stderr, flush=True)


class Context:
    def __init__(self, dry_run: bool, device: torch.device) -> None:
        self.dry_run, self.device = dry_run, device
        self.dtype = torch.float32 if dry_run else torch.bfloat16


def torch_pin() -> str | None:
    """The Dockerfile's TORCH_VERSION (the project's one torch pin)."""
    dockerfile = ROOT / "Dockerfile"
    m = re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile.read_text(), re.M) if dockerfile.exists() else None
    return m.group(1) if m else None


def check_versions(ctx: Context) -> dict:
    import triton

    out = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "triton": triton.__version__,
           "pin": torch_pin()}
    if ctx.device.type == "cuda":
        p = torch.cuda.get_device_properties(ctx.device)
        out.update(device=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                   driver=_driver())
    ok = out["torch"].split("+")[0] == out["pin"] and (ctx.dry_run or out["torch_cuda"] is not None)
    return {"ok": ok, **out}


def _driver() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    tail = (r.stdout + r.stderr).strip().splitlines()[-12:]
    return {"ok": r.returncode == 0, "returncode": r.returncode, "tail": tail}


def check_triton_kernels(ctx: Context) -> dict:
    script = str(ROOT / "tests" / "triton_interpret_check.py")
    if ctx.dry_run:
        return _run([sys.executable, script, "--quick"], 600, {"TRITON_INTERPRET": "1"})
    return _run([sys.executable, script, "--cuda"], 240)


def check_gpu_tests(ctx: Context) -> dict:
    files = sorted({str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                    if "mark.gpu" in p.read_text()})
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    r = _run(cmd + (["--collect-only"] if ctx.dry_run else []), 600 if ctx.dry_run else 150)
    return {**r, "files": files}


def _tiny(ctx: Context, seed: int = 0):
    from model.config import ModelConfig
    from model.transformer import Transformer

    torch.manual_seed(seed)
    model = Transformer(ModelConfig(vocab_size=258, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256,
                                    max_seq_len=512))
    with torch.no_grad():  # spread-out logits: greedy choices are not near-ties
        for p in model.parameters():
            p.normal_(0, 0.3 if p.ndim > 1 else 1.0)
        model.tie_weights()
    model = model.to(ctx.device, ctx.dtype).eval().requires_grad_(False)
    if ctx.dry_run:  # a device that runs beside the host, simulated: the engine's device path on the CPU
        from benchmarks.simulated_device import SimulatedStream

        model.stream = SimulatedStream()
    return model


def _engine(ctx: Context, model, graphs: bool = True, **kw):
    from benchmarks.gpu_sizing import stand_in_tokenizer
    from model.engine import Engine, EngineConfig

    mode = ("eager" if ctx.dry_run else "auto") if graphs else "off"
    cfg = dict(num_blocks=256, block_size=16, max_num_seqs=8, max_num_batched_tokens=256, decode_graphs=mode)
    cfg.update(kw)
    return Engine(model, stand_in_tokenizer(model.config.vocab_size), EngineConfig(**cfg))


def _serve(engine, jobs: list[tuple], steps_hook=None) -> dict[str, list[int]]:
    """jobs: (request id, prompt, SamplingParams, RequestOptions or None) -> each request's tokens."""
    from model.engine import RequestOptions

    for rid, prompt, params, options in jobs:
        engine.add_request(rid, prompt, params, options or RequestOptions())
    out: dict[str, list[int]] = {rid: [] for rid, *_ in jobs}
    while engine.has_unfinished():
        for o in (steps_hook(engine) if steps_hook else engine.step()):
            out[o.request_id] += o.token_ids
    return out


def _jobs(n: int = 4, tokens: int = 16, seeded: bool = True) -> list[tuple]:
    from model.engine import SamplingParams

    g = torch.Generator().manual_seed(1)
    jobs = []
    for i in range(n):
        prompt = torch.randint(0, 256, (5 + 7 * i,), generator=g).tolist()
        params = (SamplingParams(max_tokens=tokens, temperature=0.8, top_p=0.9, seed=10 + i, ignore_eos=True)
                  if seeded and i % 2 else SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        jobs.append((str(i), prompt, params, None))
    return jobs


def check_sync_free_decode(ctx: Context) -> dict:
    from model.engine import SamplingParams

    engine = _engine(ctx, _tiny(ctx))
    g = torch.Generator().manual_seed(2)
    for i in range(4):
        engine.add_request(str(i), torch.randint(0, 256, (9 + i,), generator=g).tolist(),
                           SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    for _ in range(8):  # prefill, and the decode steps' first launches (graphs replay from the first)
        engine.step()
    steady = 32
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steady):
            engine.step()
    finally:
        if ctx.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    while engine.has_unfinished():
        engine.step()
    return {"ok": True, "steady_steps": steady, "async_scheduling": engine.async_scheduling,
            "sync_debug_mode": "error" if ctx.device.type == "cuda" else "needs CUDA (dry run: the steps only)"}


def check_overlap_equals_serial(ctx: Context) -> dict:
    model = _tiny(ctx)
    overlapped = _serve(_engine(ctx, model, async_scheduling=True), _jobs())
    serial = _serve(_engine(ctx, model, async_scheduling=False), _jobs())
    return {"ok": overlapped == serial, "requests": len(serial), "tokens": sum(map(len, serial.values()))}


def check_graphs_equal_eager(ctx: Context) -> dict:
    model = _tiny(ctx)
    engine = _engine(ctx, model)
    graphs = _serve(engine, _jobs())
    eager = _serve(_engine(ctx, model, graphs=False), _jobs())
    used = engine.runner.path_counts["cuda_graph"]
    return {"ok": graphs == eager and used > 0, "graph_steps": used, "execution": engine.decode_graphs,
            "fallbacks": engine.stats().fallbacks}


def check_lora_interventions_graphs(ctx: Context) -> dict:
    from model.engine import RequestOptions
    from model.interventions import Intervention
    from model.features.lora import LoRAAdapter, LoRAPart, target

    model = _tiny(ctx)
    c = model.config

    def adapter() -> LoRAAdapter:
        g = torch.Generator().manual_seed(3)
        a = LoRAAdapter("a", "a", 4)
        for layer in range(c.n_layers):
            for module in ("q_proj", "v_proj", "down_proj"):
                site, start, stop, fan_in = target(c, module)
                a.parts.setdefault((layer, site), []).append(LoRAPart(
                    start, stop, torch.randn(4, fan_in, generator=g) * 0.3, torch.randn(4, stop - start, generator=g) * 0.3,
                    0.5))
        return a

    steer = torch.randn(c.dim, generator=torch.Generator().manual_seed(4)) * 2
    options = [RequestOptions(lora="a"), RequestOptions(interventions=[Intervention(1, "block_output", "add", "all",
                                                                                    steer)]), None]
    jobs = [(rid, p, params, options[i % 3]) for i, (rid, p, params, _) in enumerate(_jobs(seeded=False))]
    runs = {}
    for graphs in (True, False):
        engine = _engine(ctx, model, graphs=graphs)
        engine.feature("lora").add(adapter())
        runs[graphs] = (_serve(engine, jobs), engine)
    engine = runs[True][1]
    keys = sorted(engine.runner.graphs.graphs) if engine.runner.graphs is not None else []
    used = engine.runner.path_counts["cuda_graph"]
    ok = runs[True][0] == runs[False][0] and used > 0
    if not ctx.dry_run:  # captured: the adapted graphs are there (the dry run's static step captures nothing)
        ok = ok and any(k[2] for k in keys)
    return {"ok": ok, "graph_steps": used, "adapted_graphs": sum(k[2] for k in keys)}


def hbm_tb_s(name: str | None) -> float | None:
    return next((v for k, v in HBM_TB_S.items() if name and k in name), None)


def check_decode_benchmark(ctx: Context, out_dir: Path) -> dict:
    from benchmarks import gpu

    path = out_dir / ("gpu-check-decode-dry-run.json" if ctx.dry_run else "gpu-check-decode.json")
    argv = ["--skip-hf", "--arrival-rate", "0", "--out", str(path)]
    argv += ["--dry-run", "--device", "cpu"] if ctx.dry_run else ["--random-weights", "--concurrency", "1", "32", "128"]
    r = gpu.main(argv)
    name = next(n for n in r["models"] if n.startswith("llama-2-7b"))
    m = r["models"][name]
    spec = hbm_tb_s(r["machine"].get("device_name"))
    single = m.get("engine_single_tok_s")
    fraction = single * m["weight_bytes_per_token"] / (spec * 1e12) if spec and single else None
    ratios = {int(b): v for b, v in m.get("engine_decode_only_vs_static", {}).items()}
    out = {"model": name, "engine_vs_static": ratios, "hbm_fraction_single": fraction, "hbm_spec_tb_s": spec,
           "engine_single_tok_s": single, "errors": gpu.errors(r), "results": str(path.relative_to(ROOT))
           if path.is_relative_to(ROOT) else str(path)}
    if ctx.dry_run:  # the figures of tiny models on CPU say nothing: the run and its reading are what is checked
        return {"ok": not out["errors"] and bool(ratios), **out}
    ok = (not out["errors"] and all(ratios.get(b, 0) >= TARGETS["engine_vs_static"] for b in (1, 32, 128))
          and fraction is not None and fraction >= TARGETS["hbm_fraction"])
    return {"ok": ok, **out}


def check_long_context_decode(ctx: Context) -> dict:
    """One stream's decode attention at 8k and 32k positions: the split-KV launch against the one-program loop
    (model/kernels/triton_attention.py), the 7B's attention shape (32 query and 32 KV heads of 128), blocks of 16."""
    H, K, E, bs = (32, 32, 128, 16) if not ctx.dry_run else (4, 2, 32, 16)
    lengths = (8192, 32768) if not ctx.dry_run else (256, 1024)
    out = {"ok": True}
    for n in lengths:
        nb = n // bs
        g = torch.Generator().manual_seed(n)
        k_pool = torch.randn(nb, bs, K, E, generator=g).to(ctx.device, ctx.dtype)
        v_pool = torch.randn(nb, bs, K, E, generator=g).to(ctx.device, ctx.dtype)
        tables = torch.randperm(nb, generator=g)[None].to(ctx.device)  # (1, W): scattered blocks
        q = torch.randn(1, H, E, generator=g).to(ctx.device, ctx.dtype)
        rows, lens = torch.zeros(1, dtype=torch.long, device=ctx.device), torch.tensor([n], device=ctx.device)
        outs = {s: torch.empty(1, H, E, dtype=ctx.dtype, device=ctx.device) for s in (True, False)}

        def attend(split: bool):
            if ctx.dry_run:  # no Triton on the CPU outside its interpreter: the reference, through the same harness
                from model.kernels import ops

                ops.decode_attention(q, k_pool, v_pool, rows, tables, lens, outs[split])
            else:
                from model.kernels import triton_attention

                triton_attention.paged_decode_attention(q, k_pool, v_pool, rows, tables, lens, outs[split],
                                                        split=split)

        timing = {}
        for split in (True, False):
            attend(split)  # compile
            timing[split] = _best_of(ctx.device, lambda: attend(split), 20 if not ctx.dry_run else 2)
        speedup = timing[False] / timing[True]
        same = torch.equal(outs[True], outs[False])
        out[str(n)] = {"split_us": timing[True] * 1e6, "unsplit_us": timing[False] * 1e6, "speedup": speedup,
                       "equal": same}
        out["ok"] = out["ok"] and same
        del k_pool, v_pool
    if not ctx.dry_run:
        out["ok"] = out["ok"] and out[str(lengths[-1])]["speedup"] >= TARGETS["split_kv_speedup_32k"]
    return out


def _best_of(device: torch.device, fn, n: int) -> float:
    from benchmarks.static_decode import sync

    best = float("inf")
    for _ in range(n):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


# (name, function, seconds it may take on the device: a check is not started with less than that left)
CHECKS = [
    ("versions", check_versions, 5),
    ("triton_kernels", check_triton_kernels, 120),
    ("gpu_tests", check_gpu_tests, 60),
    ("sync_free_decode", check_sync_free_decode, 20),
    ("overlap_equals_serial", check_overlap_equals_serial, 20),
    ("graphs_equal_eager", check_graphs_equal_eager, 20),
    ("lora_interventions_graphs", check_lora_interventions_graphs, 30),
    ("long_context_decode", check_long_context_decode, 20),
    ("decode_benchmark", check_decode_benchmark, 150),  # last: the longest, and what a short budget gives up first
]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="each check's CPU-side set-up, on CPU")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--budget-s", type=float, default=BUDGET_S)
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device here: run it on the GPU machine, or with --dry-run")
    device = torch.device("cpu" if args.dry_run else "cuda")
    ctx = Context(args.dry_run, device)
    out_path = args.out or RESULTS.with_name("gpu-check-dry-run.json" if args.dry_run else RESULTS.name)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    from benchmarks.machine import machine_info

    report = {"command": " ".join(["python -m benchmarks.gpu_check", *(sys.argv[1:] if argv is None else argv)]),
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "dry_run": args.dry_run,
              "machine": machine_info(device, torch.get_num_threads()), "targets": TARGETS, "checks": {}}
    start = time.perf_counter()
    for name, fn, needs in CHECKS:
        left = args.budget_s - (time.perf_counter() - start)
        t0 = time.perf_counter()
        if not args.dry_run and left < needs:
            result = {"ok": False, "not_run": f"{left:.0f}s of the budget left, the check needs {needs}s"}
        else:
            _progress(f"{name} ...")
            try:
                result = fn(ctx, out_path.parent) if name == "decode_benchmark" else fn(ctx)
            except Exception as e:  # a check that raises fails, the others still run
                result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        result["seconds"] = round(time.perf_counter() - t0, 1)
        verdict = ("DRY" if args.dry_run else "PASS") if result["ok"] else "FAIL"
        result["verdict"] = verdict
        report["checks"][name] = result
        out_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"{verdict:<4} {name}: {_summary(result)}", flush=True)
    report["seconds"] = round(time.perf_counter() - start, 1)
    out_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"results: {out_path}")
    return report


def _summary(result: dict) -> str:
    keys = [k for k in result if k not in ("ok", "verdict", "tail", "files")]
    text = ", ".join(f"{k}={result[k]}" for k in keys)
    if not result["ok"] and result.get("tail"):
        text += " | " + " / ".join(result["tail"][-3:])
    return text[:600]


if __name__ == "__main__":
    sys.exit(0 if all(c["ok"] for c in main()["checks"].values()) else 1)
