"""What an int8 encoder (`--sae-encoder int8`, the default) changes in the features a request reads, against the
float32 encode of the same activations: the default model's own activations over real text, each dictionary's
features both ways.

    .venv/bin/python -m benchmarks.sae_encoder_error [--sae PATH ...] [--d-sae 16384] [--top-k 8]
        [--out benchmarks/results/sae-encoder-error.json]

Dictionaries: the shipped SAE (model/features/sae/shipped/) and, unless --d-sae 0, the random 16,384-feature TopK
(k 32) of benchmarks/features_cost.py at the same site. Text: benchmarks/data/public_domain.txt, 128-token rows.
Activations: the dictionary's site (block L's output) of the default model as served (`--quantization auto`), read
by the forward of benchmarks/train_sae.py (`block_output`). Each position but each row's first (the attention sink,
left out of the shipped SAE's training: benchmarks/train_sae.py) is encoded by the served read path
(model/features/sae/feature.py `Served.encode_top`) with the float32 encoder and with the int8 one. Reported per
dictionary, over those positions:

    pre_error_of_largest   max |pre_int8 - pre_fp32| (the encoder's outputs before the activation, every feature) /
                           the largest float32 activation: the rounding itself
    p99_pre_error          99th percentile of that ratio over every feature and position
    p99_relative_error     99th percentile of |v_int8 - v_fp32| / v_fp32 over the float32 top-k features' values
    top_k_same_set         share of positions whose top-k ids are the same set both ways
    top_k_overlap          mean |top-k ids in both| / k
    top1_same              share of positions with the same largest feature
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.features_cost import write_sae
from benchmarks.machine import machine_info
from benchmarks.train_sae import block_output
from model.features.sae import load_dictionary
from model.features.sae.feature import Served
from model.loaders import load_model

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "model" / "features" / "sae" / "shipped" / "smollm2-135m-instruct-l15-resid-post-topk4k"
TEXT = ROOT / "benchmarks" / "data" / "public_domain.txt"


def compare(d, x: torch.Tensor, k: int) -> dict:
    """x (T, D_in) at d's site -> the figures above for d's int8 read path against its float32 one."""
    cpu = torch.device("cpu")
    d.encoder = "float32"
    exact = Served(d, cpu)
    d.encoder = "int8"
    rounded = Served(d, cpu)
    assert rounded.precision == "int8", "the int8 encoder needs the native kernels (model/kernels)"
    f32, v32, i32 = exact.encode_top(x, k, dense=True)  # (T, F), (T, k) x 2
    f8, v8, i8 = rounded.encode_top(x, k, dense=True)
    largest = f32.abs().max()
    pre_err = (rounded._pre(x) - exact._pre(x)).abs() / largest  # (T, F)
    active = v32 > 0
    rel = ((torch.gather(f8, 1, i32) - v32).abs() / v32.clamp_min(1e-12))[active]
    same = [set(a) == set(b) for a, b in zip(i32.tolist(), i8.tolist())]
    overlap = [len(set(a) & set(b)) / k for a, b in zip(i32.tolist(), i8.tolist())]
    return {"positions": x.shape[0], "d_sae": d.d_sae, "activation": d.activation, "k": d.k,
            "float32_encoder_bytes": d.W_enc.numel() * 4,
            "int8_encoder_bytes": sum(t.nbytes for t in rounded.q_enc.native_buffers()),
            "pre_error_of_largest": pre_err.max().item(),
            "p99_pre_error": torch.quantile(pre_err.flatten()[:: max(1, pre_err.numel() // 1_000_000)], 0.99).item(),
            "p99_relative_error": torch.quantile(rel.float(), 0.99).item() if rel.numel() else None,
            "top_k_same_set": sum(same) / len(same), "top_k_overlap": sum(overlap) / len(overlap),
            "top1_same": (i32[:, 0] == i8[:, 0]).float().mean().item()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sae_encoder_error", description=__doc__.split("\n\n")[0])
    p.add_argument("--sae", nargs="*", default=[str(SHIPPED)], help="dictionary folders (default: the shipped SAE)")
    p.add_argument("--d-sae", type=int, default=16384, help="the random TopK dictionary's width (0: none)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    loaded = load_model(None, quantization="auto")
    model, tok = loaded.model, loaded.tokenizer
    ids = tok.encode(TEXT.read_text())
    n = len(ids) // args.ctx
    tokens = torch.tensor(ids[: n * args.ctx]).view(n, args.ctx)  # (B, T)
    results, acts = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = [Path(s) for s in args.sae]
        if args.d_sae:
            folders.append(Path(tmp) / f"random-topk-{args.d_sae}")
            write_sae(folders[-1], model.config.dim, args.d_sae, "blocks.15.hook_resid_post")
        for folder in folders:
            d = load_dictionary(folder, config=model.config)
            layer = d.hook_in.layer
            if d.hook_in.site != "block_output":
                raise SystemExit(f"{folder}: reads {d.hook_in.site}; this benchmark reads block outputs")
            if layer not in acts:
                acts[layer] = block_output(model, tokens, layer)[:, 1:].reshape(-1, model.config.dim).float()
            results[folder.name] = compare(d, acts[layer], args.top_k)
            print(f"{folder.name}: {json.dumps(results[folder.name])}", file=sys.stderr)
    report = {"machine": machine_info("cpu", os.cpu_count() or 1), "model": loaded.name, "text": TEXT.name,
              "rows": n, "ctx": args.ctx, "top_k": args.top_k, "dictionaries": results}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
