"""Single-stream decode per dtype / weight quantization against the memory-bandwidth limit, peers in the same run.

    .venv/bin/python -m benchmarks.bench_decode [--settings float32 bfloat16 int8 int4] [--threads N] [--rounds 3]
                                                [--new-tokens 64] [--skip-hf] [--skip-llama-cpp] [--telemetry] [--quick]
                                                [--interventions]

Decode of one token reads every weight once, so `weight bytes per token / read bandwidth` bounds it. Per setting:
- decode tok/s: one greedy request (128-token prompt) through the `Engine`, as `bench_engine`'s single stream;
- matmul-only: one pass of a single row through the model's own weight matrices, nothing else
  (`ceilings.time_matmuls`): the decode step's time without attention, norms, sampling or scheduling;
- the bandwidth ceiling: weight bytes per token (what the kernels read) / the machine's read bandwidth, measured
  in every round (`ceilings.read_bandwidth`), and the percentage of it each side reaches.
With --telemetry, each llamascope setting also decodes the same request with per-token attention telemetry
(`inspect: {"stream": true}`), in the same rounds, and reports on / off.
Peers on the same GGUF: HF transformers (float32, a greedy forward loop) and llama.cpp (`llama-cpp-python`, when
installed; it reads the file's own Q4_1 blocks). All sides run in rounds, interleaved, and each figure is the
median over rounds: on a shared machine a load spike then hits one round of every side, not all of one side.
"""

from __future__ import annotations

import os

for _var, _value in (("TQDM_DISABLE", "1"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "error")):
    os.environ.setdefault(_var, _value)

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import ceilings, hf_peer, ours
from benchmarks.machine import machine_info
from benchmarks.measure import Clock, StreamResult
from benchmarks.workload import SETTINGS, WorkloadSizes, make_workload
from model.features import TelemetryOptions

RESULTS = Path(__file__).resolve().parent / "results" / "cpu-decode.json"


def _progress(msg: str) -> None:
    print(f"[decode] {msg}", file=sys.stderr, flush=True)


def _load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


class OursSide:
    def __init__(self, name: str, model_path: str | None, prompt_len: int) -> None:
        from model.engine import Engine, EngineConfig
        from model.loaders.checkpoint import load_model

        dtype, quant = SETTINGS[name]
        self.name, self.lm = name, load_model(model_path, dtype, "cpu", quantization=quant)
        self.engine = Engine(self.lm.model, self.lm.tokenizer, EngineConfig(kv_cache_bytes=64 << 20))
        self.prompt = make_workload(self.lm.tokenizer, 1, WorkloadSizes(single_prompt_len=prompt_len)).single_prompt
        self.weight_bytes = ceilings.weight_bytes_per_token(self.lm.model)
        ours.warm_up(self.engine, self.lm.model.config.vocab_size)

    def decode(self, new_tokens: int, telemetry: bool = False) -> StreamResult:
        return ours.run_single(self.engine, self.prompt, new_tokens, Clock("cpu"),
                               telemetry=TelemetryOptions() if telemetry else None)

    def matmul_s(self, reps: int) -> float:
        return ceilings.time_matmuls(self.lm.model, 1, reps)


class EditedSide:
    """`--interventions`: the same engine and prompt, the request carrying one `add` on every block's output
    (model/interventions.py), applied inside the fused native decode step."""

    def __init__(self, base: OursSide) -> None:
        self.base, self.name = base, base.name + "+add_every_layer"
        self.weight_bytes, self.prompt = base.weight_bytes, base.prompt
        self.interventions = ours.add_every_layer(base.lm.model.config, seed=0)

    def decode(self, new_tokens: int) -> StreamResult:
        return ours.run_single(self.base.engine, self.prompt, new_tokens, Clock("cpu"), self.interventions)


class HFSide:
    name = "hf_float32"

    def __init__(self, model_path: Path, prompt: list[int]) -> None:
        self.model, self.prompt = hf_peer.load_hf(model_path, torch.float32, "cpu"), prompt
        self.weight_bytes = sum(p.nbytes for n, p in self.model.named_parameters() if p.ndim == 2 and "embed" not in n)
        if self.model.config.tie_word_embeddings:  # the head reads the (shared) embedding matrix once per token
            self.weight_bytes += self.model.get_input_embeddings().weight.nbytes
        hf_peer.warm_up(self.model)

    def decode(self, new_tokens: int) -> StreamResult:
        return hf_peer.forward_loop(self.model, self.prompt, new_tokens, Clock("cpu"))


class LlamaCppSide:
    """llama.cpp through llama-cpp-python on the same GGUF file (its own Q4_1/Q8_0 kernels), greedy, EOS ignored
    (`Llama.generate` yields tokens until told to stop and never checks EOS)."""

    name = "llama_cpp"

    def __init__(self, model_path: Path, prompt: list[int], threads: int) -> None:
        from gguf import GGUFReader
        from llama_cpp import Llama

        self.llm = Llama(str(model_path), n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
        self.prompt = prompt
        reader = GGUFReader(model_path)
        names = {t.name for t in reader.tensors}
        # Matrices read per token: every 2-D block weight, and the head (output, or the tied embedding table).
        self.weight_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2)
        head = "output.weight" if "output.weight" in names else "token_embd.weight"
        self.weight_bytes += next(int(t.n_bytes) for t in reader.tensors if t.name == head)
        self.decode(4)

    def decode(self, new_tokens: int) -> StreamResult:
        clock, tokens = Clock("cpu").start(), []
        self.llm.reset()
        for tok in self.llm.generate(self.prompt, top_k=1, top_p=1.0, temp=0.0, reset=True):
            clock.mark()
            tokens.append(int(tok))
            if len(tokens) == new_tokens:
                break
        return StreamResult.from_token_times(tokens, clock.times())


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    load_before = _load_avg()
    sides: list = []
    for name in args.settings:
        _progress(f"llamascope {name}: loading, warm-up")
        sides.append(OursSide(name, args.model, args.prompt_len))
        if args.interventions:
            sides.append(EditedSide(sides[-1]))
    prompt, path = sides[0].prompt, sides[0].lm.path
    if not args.skip_hf:
        _progress("transformers float32: loading the same file")
        sides.append(HFSide(path, prompt))
    if not args.skip_llama_cpp:
        try:
            sides.append(LlamaCppSide(path, prompt, args.threads))
        except ImportError:
            _progress("llama-cpp-python is not installed: no llama.cpp peer (pip install llama-cpp-python)")
    bandwidth: list[float] = []
    per: dict[str, dict[str, list]] = {s.name: {"decode_tok_s": [], "matmul_s": [], "telemetry_tok_s": []} for s in sides}
    tokens: dict[str, list[int]] = {}
    last_paths: dict[str, dict | None] = {}
    same_with_telemetry: dict[str, bool] = {}
    for r in range(args.rounds):
        _progress(f"round {r + 1}/{args.rounds} (load {_load_avg()})")
        bandwidth.append(ceilings.read_bandwidth(mb=args.bandwidth_mb))
        for s in sides if r % 2 == 0 else sides[::-1]:  # the order alternates: a drifting load weighs on all sides
            ours_side = isinstance(s, OursSide)
            # --telemetry: the same request with per-token attention telemetry, right before or after the plain one
            # (alternating by round, so neither order is favoured by a drifting load)
            first_tel = ours_side and args.telemetry and r % 2 == 1
            if first_tel:
                tel = s.decode(args.new_tokens, telemetry=True)
            res = s.decode(args.new_tokens)
            if ours_side and args.telemetry and not first_tel:
                tel = s.decode(args.new_tokens, telemetry=True)
            if ours_side and args.telemetry:
                per[s.name]["telemetry_tok_s"].append(tel.decode_tok_s)
                same_with_telemetry[s.name] = same_with_telemetry.get(s.name, True) and tel.token_ids == res.token_ids
            per[s.name]["decode_tok_s"].append(res.decode_tok_s)
            tokens[s.name] = res.token_ids
            last_paths[s.name] = getattr(res, "steps_by_path", None)
            if ours_side:
                per[s.name]["matmul_s"].append(s.matmul_s(args.matmul_reps))
    bw = _median(bandwidth)
    out: dict = {}
    for s in sides:
        tok_s = _median(per[s.name]["decode_tok_s"])
        ceiling = bw * 1e9 / s.weight_bytes
        e = {"decode_tok_s": tok_s, "decode_tok_s_rounds": per[s.name]["decode_tok_s"],
             "weight_bytes_per_token": s.weight_bytes, "bandwidth_ceiling_tok_s": ceiling,
             "pct_of_bandwidth_ceiling": 100 * tok_s / ceiling}
        if per[s.name]["telemetry_tok_s"]:
            t = per[s.name]["telemetry_tok_s"]
            e.update(telemetry_decode_tok_s=_median(t), telemetry_decode_tok_s_rounds=t,
                     telemetry_over_plain=_median(t) / tok_s, telemetry_same_tokens=same_with_telemetry[s.name],
                     # each round's on / off pair ran back to back: their ratio sees the same load
                     telemetry_over_plain_rounds=[a / b for a, b in zip(t, per[s.name]["decode_tok_s"])],
                     # a neighbour's load only ever slows a side: the fastest rounds are the least disturbed
                     telemetry_best_over_plain_best=max(t) / max(per[s.name]["decode_tok_s"]))
        if per[s.name]["matmul_s"]:
            mm = _median(per[s.name]["matmul_s"])
            e.update(matmul_only_ms=mm * 1e3, matmul_only_tok_s=1 / mm, matmul_read_gb_s=s.weight_bytes / mm / 1e9,
                     decode_step_ms=1e3 / tok_s, step_over_matmul=(1 / tok_s) / mm)
        out[s.name] = e
    if "llama_cpp" in out:
        for name in args.settings:
            out[name]["vs_llama_cpp"] = out[name]["decode_tok_s"] / out["llama_cpp"]["decode_tok_s"]
    if "hf_float32" in out:
        for name in args.settings:
            out[name]["vs_hf_float32"] = out[name]["decode_tok_s"] / out["hf_float32"]["decode_tok_s"]
    for s in sides:
        if isinstance(s, EditedSide):  # per round (the two run back to back), then the median of the ratios
            ratios = [a / b for a, b in zip(per[s.name]["decode_tok_s"], per[s.base.name]["decode_tok_s"])]
            out[s.name]["vs_without_interventions"] = _median(ratios)
            out[s.name]["vs_without_interventions_rounds"] = ratios
            out[s.name]["steps_by_path"] = last_paths.get(s.name)
    ref = tokens.get("float32")
    return {
        "schema": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python -m benchmarks.bench_decode", *args.argv]),
        "machine": machine_info("cpu", args.threads),
        "load_avg_before": load_before,
        # OMP_WAIT_POLICY=PASSIVE: on a shared, oversubscribed machine spinning OpenMP barriers make a 2-thread
        # step take seconds; every torch side in this process runs under the same policy.
        "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")},
        "load_avg_after": _load_avg(),
        "model": str(path),
        "workload": {"prompt_tokens": len(prompt), "new_tokens": args.new_tokens, "rounds": args.rounds,
                     "decoding": "greedy, EOS ignored, one request"},
        "read_bandwidth_gb_s": bw,
        "read_bandwidth_rounds": bandwidth,
        "sides": out,
        "same_tokens_as_float32": {k: v == ref for k, v in tokens.items() if "+" not in k} if ref else None,
    }


def print_report(r: dict) -> None:
    m = r["machine"]
    print(f"\nsingle-stream decode, {r['workload']['prompt_tokens']}-token prompt + {r['workload']['new_tokens']} new, "
          f"median of {r['workload']['rounds']} rounds; {m.get('cpu_model')}, {m.get('threads')} threads, "
          f"load {r['load_avg_before']} -> {r['load_avg_after']}")
    print(f"read bandwidth {r['read_bandwidth_gb_s']:.1f} GB/s (large-tensor sum, same run)\n")
    print(f"{'side':<12} {'tok/s':>7} {'MB/token':>9} {'ceiling':>8} {'% ceil':>7} {'matmul ms':>10} "
          f"{'step ms':>8} {'step/mm':>8} {'vs llama.cpp':>12}")
    for name, e in r["sides"].items():
        mm = f"{e['matmul_only_ms']:>10.2f} {e['decode_step_ms']:>8.2f} {e['step_over_matmul']:>7.2f}x" if "matmul_only_ms" in e else f"{'':>28}"
        vs = f"{e['vs_llama_cpp']:>11.2f}x" if "vs_llama_cpp" in e else ""
        if "vs_without_interventions" in e:
            vs = f"{e['vs_without_interventions']:>11.3f}x (vs without)"
        print(f"{name:<12} {e['decode_tok_s']:>7.1f} {e['weight_bytes_per_token'] / 1e6:>9.1f} "
              f"{e['bandwidth_ceiling_tok_s']:>8.1f} {e['pct_of_bandwidth_ceiling']:>6.1f}% {mm} {vs}")
    if r.get("same_tokens_as_float32"):
        print(f"\ngreedy tokens equal to float32's: {r['same_tokens_as_float32']}")
    tel = {n: e for n, e in r["sides"].items() if "telemetry_decode_tok_s" in e}
    if tel:
        print(f"\nwith attention telemetry (inspect.stream), same rounds:\n{'side':<12} {'off tok/s':>9} {'on tok/s':>9} "
              f"{'on/off':>7} {'same tokens':>12}  per round (on / off, back to back)")
        for name, e in tel.items():
            print(f"{name:<12} {e['decode_tok_s']:>9.1f} {e['telemetry_decode_tok_s']:>9.1f} "
                  f"{e['telemetry_over_plain']:>6.3f}x {str(e['telemetry_same_tokens']):>12}  "
                  + " ".join(f"{x:.3f}" for x in e["telemetry_over_plain_rounds"])
                  + f"  (best on / best off {e['telemetry_best_over_plain_best']:.3f}x)")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_decode", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--matmul-reps", type=int, default=10)
    p.add_argument("--bandwidth-mb", type=int, default=512)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument("--interventions", action="store_true",
                   help="also decode with one `add` on every block's output, same engine, same rounds (the cost of "
                        "interventions on the native path)")
    p.add_argument("--telemetry", action="store_true",
                   help="also decode each llamascope setting with per-token attention telemetry on, in the same rounds")
    p.add_argument("--quick", action="store_true", help="1 round, 8 new tokens, 16-token prompt: a smoke test")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.rounds, args.new_tokens, args.prompt_len, args.matmul_reps, args.bandwidth_mb = 1, 8, 16, 2, 64
    results = run(args)
    out = args.out or RESULTS.with_name(f"cpu-decode{'-quick' if args.quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print_report(results)
    print(f"\nresults: {out}")
    gc.collect()
    return results


if __name__ == "__main__":
    main()
