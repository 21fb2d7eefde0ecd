"""The quality cost of each dtype / weight quantization: perplexity on a fixed text shipped in the repository.

    .venv/bin/python -m benchmarks.perplexity [--model PATH] [--settings auto float32 bfloat16 int8 int4] [--threads N]
        [--kv-cache-dtypes auto float16 bfloat16]

Perplexity = exp(mean negative log-likelihood of every token given all before it), one causal forward over the
whole text (`benchmarks/data/public_domain.txt`, about 1,000 tokens with the default model's tokenizer).
`auto` is what the server runs by default (`--quantization auto`: a Q4_0/Q4_1 GGUF as int4, Q8_0 as int8, the
file's own blocks); `resolved` says which. With the native kernels a quantized setting computes every row, prompt
or generated, with the same int8/int4 kernel (batch invariance, issue 18), so one score per setting is the cost a
served request sees. float32 is the reference; `ratio` is each perplexity over float32's.

With `--kv-cache-dtypes`, each setting is also scored through the engine, as the server computes a prompt: chunked
prefill over the paged KV cache in each of those dtypes (`--kv-cache-dtype`), the text's prompt logprobs; `kv` in the
results holds those perplexities and each one's ratio to the same setting's float32-cache score (else "auto"'s).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.workload import SETTINGS
from model.loaders.checkpoint import load_model

TEXT = Path(__file__).resolve().parent / "data" / "public_domain.txt"
RESULTS = Path(__file__).resolve().parent / "results" / "perplexity.json"


@torch.inference_mode()
def perplexity(model: torch.nn.Module, ids: list[int]) -> tuple[float, float]:
    """-> (mean NLL in nats, perplexity) of ids[1:] given their prefixes."""
    tokens = torch.tensor([ids], device=model.device)  # (1, T)
    logits = model(tokens)[0, :-1].float()  # (T-1, V): position t predicts token t+1
    nll = F.cross_entropy(logits, tokens[0, 1:]).item()
    return nll, math.exp(nll)


@torch.inference_mode()
def engine_perplexity(lm, ids: list[int], kv_cache_dtype: str) -> tuple[float, float]:
    """-> (mean NLL, perplexity) of ids[1:] as the engine scores a prompt: its prompt logprobs over a paged cache of
    `kv_cache_dtype`, the prompt prefilled in the engine's default 512-token chunks."""
    from model.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(lm.model, lm.tokenizer, EngineConfig(kv_cache_dtype=kv_cache_dtype, kv_cache_bytes=1 << 28,
                                                         max_model_len=len(ids) + 8))
    engine.add_request("ppl", ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    scored: list = []
    while engine.has_unfinished():
        for o in engine.step():
            scored += o.prompt_logprobs or []
    nll = -sum(lp.logprob for lp in scored[1:]) / (len(ids) - 1)
    return nll, math.exp(nll)


def run(model_path: str | None, settings: list[str], text: str, kv_dtypes: list[str] = ()) -> dict:
    results: dict = {}
    ids: list[int] | None = None
    for name in settings:
        dtype, quant = SETTINGS.get(name, (torch.float32, name))  # "auto": the server's default
        t0 = time.perf_counter()
        lm = load_model(model_path, dtype, "cpu", quantization=quant)
        ids = ids or lm.tokenizer.encode(text)
        nll, ppl = perplexity(lm.model, ids)
        entry = {"dtype": str(dtype).removeprefix("torch."), "quantization": quant, "resolved": lm.quantization,
                 "nll": nll, "perplexity": ppl, "seconds": time.perf_counter() - t0}
        results[name] = entry
        print(f"[ppl] {name} ({lm.quantization}): {ppl:.4f}", file=sys.stderr, flush=True)
        if kv_dtypes:
            entry["kv"] = {kv: engine_perplexity(lm, ids, kv)[1] for kv in kv_dtypes}
            base = entry["kv"].get("float32", entry["kv"].get("auto"))
            entry["kv_ratio"] = {kv: p / base for kv, p in entry["kv"].items()} if base else {}
            print(f"[ppl] {name} through the engine, by KV cache dtype: {entry['kv']}", file=sys.stderr, flush=True)
        del lm
    ref = results.get("float32", {}).get("perplexity")
    for entry in results.values():
        if ref:
            entry["ratio"] = entry["perplexity"] / ref
    return {"text": str(TEXT.relative_to(TEXT.parents[2])), "num_tokens": len(ids or []), "settings": results}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.perplexity", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--settings", nargs="+", choices=["auto", *SETTINGS], default=["auto", *SETTINGS])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--kv-cache-dtypes", nargs="*", default=[], choices=["auto", "float32", "float16", "bfloat16"],
                   help="also score through the engine over a KV cache of each dtype (the server's prompt path)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = run(args.model, args.settings, args.text.read_text(), args.kv_cache_dtypes)
    out["model"] = args.model or "default (SmolLM2-135M-Instruct Q4_1)"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"perplexity on {out['text']} ({out['num_tokens']} tokens), {out['model']}:")
    print(f"{'setting':<10} {'runs as':<34} {'perplexity':>11} {'vs float32':>11}")
    for name, e in out["settings"].items():
        print(f"{name:<10} {e['resolved']:<34} {e['perplexity']:>11.4f} {e.get('ratio', float('nan')):>10.4f}x")
        for kv, ppl in e.get("kv", {}).items():
            print(f"  through the engine, KV cache {kv:<9} {ppl:>11.4f}  {e['kv_ratio'].get(kv, float('nan')):.5f}x")
    return out


if __name__ == "__main__":
    main()
