"""An activation-patching sweep over HTTP beside the plain loop over HF transformers forward hooks on the same model.

    python -m benchmarks.patching [--model PATH] [--quantization auto|none] [--rounds 2] [--out FILE]

One run, on the default model unless --model names another:
- ours: `python -m service --model PATH --quantization Q` on loopback; one `POST /inspect/patch` of every block's
  output (30 layers on the default model) x every position of a 16-token prompt pair (480 cells), wall time from
  request to response;
- the peer: HF transformers (float32, the GGUF dequantized as our loader does, torch's threads as the server's) in
  this process, the loop TransformerLens-style code writes: one forward of the clean prompt keeping every block's
  output, then one forward of the corrupted prompt per cell with a forward hook writing the clean value; the metric
  is read from each forward's last position;
- traffic: short completions (12-token prompt, 8 new tokens, greedy), one every --gap seconds, alone and while the
  sweep runs: median latency of each, and their ratio; the sweep is timed alone and with that traffic.

Only one side computes at a time (the server idles while HF runs). The grids are compared cell by cell and the
largest difference printed: with --quantization none both sides run float32 and agree to ~1e-5; the default int4
server patches its own int4 weights, so its grid differs from float32 HF by the quantization's effect.
Results and the machine go to benchmarks/results/patching.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from benchmarks.hf_peer import load_hf
from benchmarks.load import ServedProcess
from benchmarks.machine import machine_info

RESULTS = Path(__file__).resolve().parent / "results" / "patching.json"
# 16 tokens each in SmolLM2's vocabulary: the worked example of docs/inspection.md, lengthened
CLEAN = "Tourists love the Eiffel Tower, which stands in the famous city of"
CORRUPTED = "Tourists love the Colosseum, which stands in the famous city of"
ANSWER, CONTRAST = " Paris", " Rome"
TRAFFIC = {"prompt": "The history of the printing press begins in the fifteenth century when", "max_tokens": 8,
           "temperature": 0, "ignore_eos": True}


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def hf_sweep(hf, clean: list[int], corrupted: list[int], answer: int, contrast: int) -> tuple[list[list[float]], float]:
    """The plain loop over forward hooks -> (raw grid [layer][position], seconds)."""
    layers = hf.model.layers
    t0 = time.perf_counter()
    kept: dict[int, torch.Tensor] = {}

    def run(ids: list[int]) -> float:
        with torch.inference_mode():
            lp = hf(torch.tensor([ids])).logits[0, -1].double().log_softmax(-1)
        return float(lp[answer] - lp[contrast])

    def keeper(l):
        def hook(mod, args, out):
            kept[l] = (out[0] if isinstance(out, tuple) else out)[0].clone()  # (T, D)
        return hook

    handles = [layers[l].register_forward_hook(keeper(l)) for l in range(len(layers))]
    run(clean)
    for h in handles:
        h.remove()
    run(corrupted)
    grid = []
    for l in range(len(layers)):
        row = []
        for p in range(len(clean)):
            def patch(mod, args, out, l=l, p=p):
                h = (out[0] if isinstance(out, tuple) else out).clone()
                h[0, p] = kept[l][p]
                return (h,) + tuple(out[1:]) if isinstance(out, tuple) else h
            handle = layers[l].register_forward_hook(patch)
            row.append(run(corrupted))
            handle.remove()
        grid.append(row)
    return grid, time.perf_counter() - t0


def completion_latency(url: str, n: int, gap: float, stop: threading.Event | None = None,
                       out: list[float] | None = None) -> list[float]:
    """Latencies (s) of short completions, one every `gap` s: n of them, or until `stop` is set. `out`: the list each
    latency is appended to as it is measured (another thread may watch it grow)."""
    out = [] if out is None else out
    with httpx.Client(timeout=300) as c:
        while (stop is None and len(out) < n) or (stop is not None and not stop.is_set()):
            t0 = time.perf_counter()
            r = c.post(url + "/v1/completions", json=TRAFFIC)
            r.raise_for_status()
            out.append(time.perf_counter() - t0)
            (stop or threading.Event()).wait(gap)
    return out


def our_sweep(url: str) -> tuple[dict, float]:
    body = {"clean": CLEAN, "corrupted": CORRUPTED, "answer": ANSWER, "contrast": CONTRAST, "sites": ["block_output"],
            "layers": "all", "positions": "all"}
    t0 = time.perf_counter()
    r = httpx.post(url + "/inspect/patch", json=body, timeout=3600)
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    return r.json(), elapsed


def run(args: argparse.Namespace) -> dict:
    from model.loaders.checkpoint import default_model_path

    path = Path(args.model) if args.model else default_model_path()
    log_dir = Path(tempfile.mkdtemp(prefix="patching-"))
    _progress(f"starting the server ({args.quantization}) and loading HF transformers on {path.name}")
    server = ServedProcess(["--model", str(path), "--quantization", args.quantization], log_dir / "server.log")
    try:
        hf = load_hf(path, torch.float32, "cpu")
        completion_latency(server.url, 2, 0)  # warm-up
        first, _ = our_sweep(server.url)
        ids = {k: [t["id"] for t in first[f"{k}_tokens"]] for k in ("clean", "corrupted")}
        assert len(ids["clean"]) == len(ids["corrupted"]) == 16, {k: len(v) for k, v in ids.items()}
        answer, contrast = first["answer"]["token_id"], first["contrast"]["token_id"]
        rounds = []
        for r in range(args.rounds):
            alone = completion_latency(server.url, 8, args.gap)
            stop = threading.Event()
            during: list[float] = []
            t = threading.Thread(target=lambda: during.extend(completion_latency(server.url, 0, args.gap, stop)))
            t.start()
            ours, ours_s = our_sweep(server.url)
            stop.set()
            t.join()
            quiet, quiet_s = our_sweep(server.url)  # the same sweep with no traffic
            grid, hf_s = hf_sweep(hf, ids["clean"], ids["corrupted"], answer, contrast)
            diff = max(abs(a - b) for ra, rb in zip(ours["raw"][0], grid) for a, b in zip(ra, rb))
            rounds.append({"ours_s": ours_s, "ours_quiet_s": quiet_s, "hf_loop_s": hf_s,
                           "speedup": hf_s / ours_s, "speedup_quiet": hf_s / quiet_s,
                           "completion_alone_ms": statistics.median(alone) * 1e3,
                           "completion_during_ms": statistics.median(during) * 1e3 if during else None,
                           "completions_during": len(during),
                           "latency_ratio": statistics.median(during) / statistics.median(alone) if during else None,
                           "max_raw_diff_vs_hf": diff, "baselines": ours["baselines"]})
            _progress(f"round {r + 1}: ours {ours_s:.1f} s (no traffic {quiet_s:.1f} s), HF loop {hf_s:.1f} s: "
                      f"{hf_s / ours_s:.2f}x ({hf_s / quiet_s:.2f}x); completions {rounds[-1]['completion_alone_ms']:.0f} "
                      f"ms alone, {rounds[-1]['completion_during_ms'] or float('nan'):.0f} ms during ({len(during)} sent)")
    finally:
        server.stop()
    return {"machine": machine_info("cpu", torch.get_num_threads()), "model": path.name, "quantization": args.quantization,
            "gap_s": args.gap,
            "cells": first["usage"]["cells"], "precision": first["precision"], "rounds": rounds,
            "median_speedup": statistics.median(r["speedup"] for r in rounds),
            "median_latency_ratio": statistics.median(r["latency_ratio"] for r in rounds if r["latency_ratio"])}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.patching", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--gap", type=float, default=1.0, help="seconds between the short completions")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    return write_results(run(args), args.out)


def write_results(r: dict, out: Path) -> dict:
    """The run's JSON to `out`, and the figures (the machine aside) to stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2) + "\n")
    print(json.dumps({k: v for k, v in r.items() if k != "machine"}, indent=2))
    return r


if __name__ == "__main__":
    main()
