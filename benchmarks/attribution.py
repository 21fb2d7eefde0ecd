"""Attribution patching against exact activation patching, over HTTP on one server, in the same run.

    python -m benchmarks.attribution [--model PATH] [--quantization auto|none] [--rounds 3] [--skip-cost | --skip-agreement]
                                     [--server-args "--threads 1"] [--out FILE]

On the default model unless --model names another (`python -m service --model PATH --quantization Q` on loopback):

- agreement, on three prompt pairs (factual recall: the Eiffel Tower / the Colosseum, " Paris" against " Rome";
  indirect object: "When Mary and John went to the store, John gave a drink to" / "..., Mary gave ...", " Mary"
  against " John"; greater-than: "The war lasted from the year 1732 to the year 17" / "... 1701 ...", "3" against
  "1"): `POST /inspect/attribute` (attribution_patching) and `POST /inspect/patch` for the same
  block_output and head_output cells (every layer, position and head); per site, the Pearson correlation of the two
  normalised grids and how many of the exact grid's 10 largest |cells| are among the estimate's 10 largest;
- cost, on the first pair: a full attribution sweep (all seven sites, every layer, position and head) against the
  exact /inspect/patch grid of the same cells, wall time from request to response, the attribution taken as the
  median of --rounds (and the two grids compared per site, head_q and head_k also without the QK fix); and short
  completions (benchmarks/patching.py's: 12-token prompt, 8 new tokens, greedy), one after another, alone and
  while attribution sweeps run back to back: median latency of each and their ratio.

Only one request computes at a time, except the completions beside the sweeps. Results and the machine go to
benchmarks/results/attribution.json (the agreement figures are those docs/inspection.md quotes).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from benchmarks.load import ServedProcess
from benchmarks.machine import machine_info
from benchmarks.patching import completion_latency, write_results

RESULTS = Path(__file__).resolve().parent / "results" / "attribution.json"
PAIRS = {
    "factual recall": {"clean": "The Eiffel Tower is in the city of", "corrupted": "The Colosseum is in the city of",
                       "answer": " Paris", "contrast": " Rome"},
    "indirect object": {"clean": "When Mary and John went to the store, John gave a drink to",
                        "corrupted": "When Mary and John went to the store, Mary gave a drink to",
                        "answer": " Mary", "contrast": " John"},
    "greater-than": {"clean": "The war lasted from the year 1732 to the year 17",
                     "corrupted": "The war lasted from the year 1701 to the year 17", "answer": "3", "contrast": "1"},
}
AGREEMENT_SITES = ["block_output", "head_output"]
ALL_SITES = ["block_output", "attention_output", "mlp_output", "head_q", "head_k", "head_v", "head_output"]
TOP = 10


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _post(url: str, path: str, body: dict) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = httpx.post(url + path, json=body, timeout=7200)
    elapsed = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{path}: {r.status_code} {r.text[:400]}")
    return r.json(), elapsed


def _flat(grid) -> list[float]:
    out = []
    for x in grid:
        out.extend(_flat(x) if isinstance(x, list) else [x])
    return out


def compare(estimated: list[float], exact: list[float]) -> dict:
    """Pearson correlation, and how many of the exact grid's TOP largest |cells| the estimate also ranks there."""
    a, b = torch.tensor(estimated, dtype=torch.float64), torch.tensor(exact, dtype=torch.float64)
    k = min(TOP, len(a))
    top_a, top_b = set(a.abs().topk(k).indices.tolist()), set(b.abs().topk(k).indices.tolist())
    return {"cells": len(a), "correlation": float(torch.corrcoef(torch.stack([a, b]))[0, 1]),
            f"top{TOP}_overlap": len(top_a & top_b), "max_abs_error": float((a - b).abs().max()),
            "largest_exact": float(b.abs().max())}


def agreement(url: str, name: str, pair: dict) -> dict:
    body = {**pair, "sites": AGREEMENT_SITES, "layers": "all", "positions": "all"}
    est, est_s = _post(url, "/inspect/attribute", {"method": "attribution_patching", **body})
    exact, exact_s = _post(url, "/inspect/patch", body)
    out = {"tokens": len(exact["clean_tokens"]), "baselines": exact["baselines"], "attribution_s": est_s,
           "patching_s": exact_s, "sites": {}}
    for s, site in enumerate(AGREEMENT_SITES):
        out["sites"][site] = compare(_flat(est["normalized"][s]), _flat(exact["normalized"][s]))
    both = compare(_flat(est["normalized"]), _flat(exact["normalized"]))
    out["all_cells"] = both
    _progress(f"{name}: {out['tokens']} tokens; " + "; ".join(
        f"{site} r={v['correlation']:.3f} top-{TOP} {v[f'top{TOP}_overlap']}/{TOP}" for site, v in out["sites"].items())
        + f"; attribution {est_s:.1f} s, exact {exact_s:.1f} s")
    return out


def cost(url: str, rounds: int) -> dict:
    pair = PAIRS["factual recall"]
    body = {**pair, "sites": ALL_SITES, "layers": "all", "positions": "all"}
    times = []
    for _ in range(rounds):
        est, t = _post(url, "/inspect/attribute", {"method": "attribution_patching", **body})
        times.append(t)
    _progress(f"full attribution sweep: {est['usage']['cells']} cells, {statistics.median(times):.2f} s (median of "
              f"{rounds}); now the exact grid of the same cells")
    plain, _ = _post(url, "/inspect/attribute", {"method": "attribution_patching", "qk_fix": False, **body})
    exact, exact_s = _post(url, "/inspect/patch", body)
    assert exact["usage"]["cells"] == est["usage"]["cells"]
    alone = completion_latency(url, 8, 0.0)
    stop = threading.Event()
    during: list[float] = []
    # (appended as measured: the loop below waits for 8 of them)
    t = threading.Thread(target=completion_latency, args=(url, 0, 0.0, stop, during))
    t.start()
    sweeps = 0
    while sweeps < 3 or len(during) < 8:
        _post(url, "/inspect/attribute", {"method": "attribution_patching", **body})
        sweeps += 1
    stop.set()
    t.join()
    ratio = statistics.median(during) / statistics.median(alone)
    out = {"cells": est["usage"]["cells"], "attribution_s": times, "attribution_median_s": statistics.median(times),
           "patching_s": exact_s, "fraction_of_patching": statistics.median(times) / exact_s,
           "completion_alone_ms": statistics.median(alone) * 1e3, "completion_during_ms": statistics.median(during) * 1e3,
           "completions_during": len(during), "sweeps_during": sweeps, "latency_ratio": ratio,
           "all_cells": compare(_flat(est["normalized"]), _flat(exact["normalized"])),
           "sites": {site: compare(_flat(est["normalized"][s]), _flat(exact["normalized"][s]))
                     for s, site in enumerate(ALL_SITES)},
           "sites_without_qk_fix": {site: compare(_flat(plain["normalized"][s]), _flat(exact["normalized"][s]))
                                    for s, site in enumerate(ALL_SITES) if site in ("head_q", "head_k")},
           "gradient_precision": est["gradient_precision"]}
    _progress(f"cost: attribution {out['attribution_median_s']:.2f} s against exact patching {exact_s:.1f} s "
              f"(1/{exact_s / out['attribution_median_s']:.0f}); completions {out['completion_alone_ms']:.0f} ms alone, "
              f"{out['completion_during_ms']:.0f} ms during ({ratio:.2f}x)")
    return out


def run(args: argparse.Namespace) -> dict:
    from model.loaders.checkpoint import default_model_path

    path = Path(args.model) if args.model else default_model_path()
    log_dir = Path(tempfile.mkdtemp(prefix="attribution-"))
    _progress(f"starting the server ({args.quantization}) on {path.name}")
    server = ServedProcess(["--model", str(path), "--quantization", args.quantization, "--max-patch-cells", "20000",
                            "--max-inspect-response-bytes", str(256 << 20), *shlex.split(args.server_args)],
                           log_dir / "server.log")
    try:
        completion_latency(server.url, 2, 0.0)  # warm-up
        info = httpx.get(server.url + "/v1/models").json()["data"][0]
        pairs = {} if args.skip_agreement else {name: agreement(server.url, name, pair) for name, pair in PAIRS.items()}
        costs = None if args.skip_cost else cost(server.url, args.rounds)
    finally:
        server.stop()
    return {"machine": machine_info("cpu", torch.get_num_threads()), "model": path.name,
            "quantization": args.quantization, "server_args": args.server_args, "served": {k: info.get(k) for k in ("quantization", "dtype")},
            "pairs": {name: {**PAIRS[name], **r} for name, r in pairs.items()}, "cost": costs}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attribution", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    p.add_argument("--rounds", type=int, default=3, help="attribution sweeps timed for the cost figure")
    p.add_argument("--skip-cost", action="store_true", help="the agreement figures only (no full exact grid)")
    p.add_argument("--skip-agreement", action="store_true", help="the cost figures only")
    p.add_argument("--server-args", default="", help='more flags for the server, e.g. "--threads 1"')
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    return write_results(run(args), args.out)


if __name__ == "__main__":
    main()
