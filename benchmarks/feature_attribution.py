"""Attribution patching over the shipped SAE's features against exact feature patching, over HTTP on one server.

    python -m benchmarks.feature_attribution [--model PATH] [--quantization auto|none] [--sae PATH] [--verify 20]
                                             [--server-args "--threads 1"] [--out FILE]

On the default model unless --model names another, with the shipped SAE
(model/features/sae/shipped/smollm2-135m-instruct-l15-resid-post-topk4k, block 15's output) served as `l15`:
for three prompt pairs whose prompts differ in one token, `POST /inspect/attribute` with `features` (Marks et al.
2024's linear estimate of patching each feature's activation from the corrupted run into the clean one, at every
position) and `verify` (the --verify largest estimates, each patched exactly through the engine's forward); the
Pearson correlation of estimate and exact over those features, how many of them agree in sign, and the direct logit
split of the clean prompt (features + b_dec + error against the site's own contribution). Results and the machine
go to benchmarks/results/feature_attribution.json (the figures docs/inspection.md quotes).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.load import ServedProcess
from benchmarks.machine import machine_info
from benchmarks.patching import write_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "feature_attribution.json"
SHIPPED = ROOT / "model" / "features" / "sae" / "shipped" / "smollm2-135m-instruct-l15-resid-post-topk4k"
PAIRS = {  # one token changed between clean and corrupted
    "capital of France": {"clean": "The capital of France is", "corrupted": "The capital of Italy is",
                          "answer": " Paris", "contrast": " Rome"},
    "capital of Japan": {"clean": "The capital of Japan is", "corrupted": "The capital of China is",
                         "answer": " Tokyo", "contrast": " Beijing"},
    "indirect object": {"clean": "When Mary and John went to the store, John gave a drink to",
                        "corrupted": "When Mary and John went to the store, Mary gave a drink to",
                        "answer": " Mary", "contrast": " John"},
}


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _post(url: str, body: dict) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = httpx.post(url + "/inspect/attribute", json=body, timeout=7200)
    elapsed = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"/inspect/attribute: {r.status_code} {r.text[:400]}")
    return r.json(), elapsed


def pair_figures(url: str, name: str, pair: dict, verify: int) -> dict:
    est, seconds = _post(url, {"method": "attribution_patching", **pair, "features": {"sae": "l15", "top": verify},
                               "verify": verify})
    f = est["features"]
    nodes = f["verified"]["nodes"]
    a = torch.tensor([n["estimate"] for n in nodes], dtype=torch.float64)
    b = torch.tensor([n["exact"] for n in nodes], dtype=torch.float64)
    dla, _ = _post(url, {"method": "direct_logit", "prompt": pair["clean"], "answer": pair["answer"],
                         "contrast": pair["contrast"], "features": {"sae": "l15", "top": 5}})
    d = dla["features"]
    out = {"tokens": len(est["clean_tokens"]), "baselines": est["baselines"], "nodes": f["nodes"],
           "verified": len(nodes), "correlation": f["verified"]["correlation"],
           "sign_agreement": int(((a > 0) == (b > 0)).sum()), "largest_exact": float(b.abs().max()),
           "largest_estimate": float(a.abs().max()), "site_estimate": sum(f["site"]), "error_estimate": sum(f["error"]),
           "top": nodes, "seconds": seconds,
           "direct_logit": {"site_contribution": d["site_contribution"], "features_sum": d["features_sum"],
                            "bias": d["bias"], "error": d["error"], "sum": d["sum"],
                            "split_error": abs(d["sum"] - d["site_contribution"]), "active": d["active"],
                            "top": d["top"], "logit_diff": dla["logit_diff"]}}
    _progress(f"{name}: {out['tokens']} tokens, {f['nodes']} feature nodes; top {len(nodes)}: r = "
              f"{out['correlation']:.3f}, sign agrees {out['sign_agreement']}/{len(nodes)}; direct split |sum - site| "
              f"{out['direct_logit']['split_error']:.1e}; {seconds:.1f} s")
    return out


def run(args: argparse.Namespace) -> dict:
    from model.loaders.checkpoint import default_model_path

    path = Path(args.model) if args.model else default_model_path()
    log_dir = Path(tempfile.mkdtemp(prefix="feature-attribution-"))
    _progress(f"starting the server ({args.quantization}) on {path.name} with {Path(args.sae).name}")
    server = ServedProcess(["--model", str(path), "--quantization", args.quantization, "--sae", f"l15={args.sae}",
                            "--max-patch-cells", "20000", *shlex.split(args.server_args)], log_dir / "server.log")
    try:
        info = httpx.get(server.url + "/v1/models").json()["data"][0]
        pairs = {name: pair_figures(server.url, name, pair, args.verify) for name, pair in PAIRS.items()}
    finally:
        server.stop()
    return {"machine": machine_info("cpu", torch.get_num_threads()), "model": path.name, "sae": Path(args.sae).name,
            "quantization": args.quantization, "served": {k: info.get(k) for k in ("quantization", "dtype")},
            "server_args": args.server_args, "verify": args.verify,
            "pairs": {name: {**PAIRS[name], **r} for name, r in pairs.items()}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.feature_attribution", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    p.add_argument("--sae", default=str(SHIPPED), help="the dictionary (default: the shipped SAE)")
    p.add_argument("--verify", type=int, default=20, help="the largest estimates patched exactly, per pair")
    p.add_argument("--server-args", default="", help='more flags for the server, e.g. "--threads 1"')
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    return write_results(run(args), args.out)


if __name__ == "__main__":
    main()
