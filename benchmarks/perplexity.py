"""The quality cost of each dtype / weight quantization: perplexity on a fixed text shipped in the repository.

    .venv/bin/python -m benchmarks.perplexity [--model PATH] [--settings auto float32 bfloat16 int8 int4] [--threads N]
        [--kv-cache-dtypes auto float16 bfloat16 int8] [--text FILE --max-tokens N]
    .venv/bin/python -m benchmarks.perplexity --model FILE.gguf --llama-perplexity PATH/llama-perplexity [--ctx 256]

Perplexity = exp(mean negative log-likelihood of every token given all before it), one causal forward over the
whole text (`benchmarks/data/public_domain.txt`, about 1,000 tokens with the default model's tokenizer).
`auto` is what the server runs by default (`--quantization auto`: a Q4_0/Q4_1 GGUF as int4, Q8_0 as int8, the
file's own blocks); `resolved` says which. With the native kernels a quantized setting computes every row, prompt
or generated, with the same int8/int4 kernel (batch invariance, issue 18), so one score per setting is the cost a
served request sees. float32 is the reference; `ratio` is each perplexity over float32's.

With `--kv-cache-dtypes`, each setting is also scored through the engine, as the server computes a prompt: chunked
prefill over the paged KV cache in each of those dtypes (`--kv-cache-dtype`), the text's prompt logprobs; `kv` in the
results holds those perplexities and each one's ratio to the same setting's float32-cache score (else "auto"'s, else
the first listed's).
The int8 cache against the 16-bit one at 4k tokens, on a longer text (Debian's GPL-3, as benchmarks/streaming.py):

    .venv/bin/python -m benchmarks.perplexity --settings auto --kv-cache-dtypes float16 int8 \
        --text /usr/share/common-licenses/GPL-3 --max-tokens 4096 --out benchmarks/results/perplexity-kv-int8.json

With `--llama-perplexity`, the served model (`--quantization auto`: the file's own precision, e.g. a Q4_K_M's Q4_K
as int4 and its Q6_K as int8) is scored the way llama.cpp's `llama-perplexity` scores it (tools/perplexity/
perplexity.cpp, `perplexity()`): the text tokenized with BOS where the file asks for one, cut into `--ctx`-token
chunks (whole ones only), the first token of each replaced by BOS where the file adds one, and only the second half
of each chunk scored (positions ctx/2 .. ctx-1, each given the chunk before it); then `llama-perplexity -f TEXT -c
CTX -b CTX` runs on the same file and text, and its "Final estimate" is set beside ours.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.machine import machine_info
from benchmarks.workload import SETTINGS
from model.loaders.checkpoint import default_model_path, load_model

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


@torch.inference_mode()
def chunked_perplexity(model: torch.nn.Module, tokenizer, ids: list[int], ctx: int) -> tuple[float, int]:
    """-> (perplexity, tokens scored) as llama-perplexity computes it (module doc): chunks of `ctx` tokens, each
    starting with BOS where the tokenizer adds one, the second half of each scored."""
    first, total, count = ctx // 2, 0.0, 0
    for start in range(0, len(ids) // ctx * ctx, ctx):
        chunk = list(ids[start : start + ctx])
        if tokenizer.add_bos:
            chunk[0] = tokenizer.bos_id
        tokens = torch.tensor([chunk], device=model.device)  # (1, ctx)
        logits = model(tokens)[0, first : ctx - 1].float()  # (ctx - 1 - first, V): position t predicts t + 1
        total += F.cross_entropy(logits, tokens[0, first + 1 :], reduction="sum").item()
        count += ctx - 1 - first
    return math.exp(total / count), count


def llama_perplexity(binary: Path, model_path: str, text: Path, ctx: int, threads: int) -> float:
    """llama.cpp's own figure: the "Final estimate: PPL = X" of `llama-perplexity` on the same file and text."""
    out = subprocess.run([str(binary), "-m", model_path, "-f", str(text), "-c", str(ctx), "-b", str(ctx),
                          "-t", str(threads)], capture_output=True, text=True, timeout=3600)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if out.returncode or not found:
        raise RuntimeError(f"llama-perplexity failed ({out.returncode}):\n{(out.stdout + out.stderr)[-2000:]}")
    return float(found.group(1))


def against_llama(model_path: str, binary: Path, text: Path, ctx: int, threads: int) -> dict:
    lm = load_model(model_path, torch.float32, "cpu", quantization="auto")
    ids = lm.tokenizer.encode(text.read_text())
    ours, scored = chunked_perplexity(lm.model, lm.tokenizer, ids, ctx)
    print(f"[ppl] ours ({lm.quantization}): {ours:.4f} over {scored} tokens", file=sys.stderr, flush=True)
    peer = llama_perplexity(binary, model_path, text, ctx, threads)
    return {"model": model_path, "text": os.path.relpath(text.resolve(), TEXT.parents[2]), "ctx": ctx, "num_tokens": len(ids), "scored_tokens": scored,
            "ours": {"resolved": lm.quantization, "weight_mix": getattr(lm.model, "weight_mix", None),
                     "perplexity": ours}, "llama_perplexity": peer,
            "ratio": ours / peer}


def run(model_path: str | None, settings: list[str], text: str, kv_dtypes: list[str] = (), max_tokens: int = 0) -> dict:
    """`max_tokens`: score the text's first that many tokens (0: all of it)."""
    results: dict = {}
    ids: list[int] | None = None
    for name in settings:
        dtype, quant = SETTINGS.get(name, (torch.float32, name))  # "auto": the server's default
        t0 = time.perf_counter()
        lm = load_model(model_path, dtype, "cpu", quantization=quant)
        ids = ids or lm.tokenizer.encode(text)[: max_tokens or None]
        nll, ppl = perplexity(lm.model, ids)
        entry = {"dtype": str(dtype).removeprefix("torch."), "quantization": quant, "resolved": lm.quantization,
                 "nll": nll, "perplexity": ppl, "seconds": time.perf_counter() - t0}
        results[name] = entry
        print(f"[ppl] {name} ({lm.quantization}): {ppl:.4f}", file=sys.stderr, flush=True)
        if kv_dtypes:
            entry["kv"] = {kv: engine_perplexity(lm, ids, kv)[1] for kv in kv_dtypes}
            base = entry["kv"].get("float32", entry["kv"].get("auto", entry["kv"][kv_dtypes[0]]))
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
    p.add_argument("--max-tokens", type=int, default=0, help="score the text's first N tokens only (0: all)")
    p.add_argument("--kv-cache-dtypes", nargs="*", default=[], choices=["auto", "float32", "float16", "bfloat16", "int8"],
                   help="also score through the engine over a KV cache of each dtype (the server's prompt path)")
    p.add_argument("--llama-perplexity", type=Path, default=None,
                   help="compare the served model (--quantization auto) with llama.cpp's llama-perplexity (module doc)")
    p.add_argument("--ctx", type=int, default=256, help="with --llama-perplexity: the chunk length (its -c)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.llama_perplexity:
        model = args.model or str(default_model_path())
        out = against_llama(model, args.llama_perplexity, args.text, args.ctx, args.threads)
        out["machine"] = machine_info("cpu", args.threads)
        path = args.out if args.out != RESULTS else RESULTS.with_name("perplexity-vs-llama.json")
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(f"{out['model']}, {out['scored_tokens']} tokens scored in {args.ctx}-token chunks: ours "
              f"({out['ours']['resolved']}) {out['ours']['perplexity']:.4f}, llama-perplexity "
              f"{out['llama_perplexity']:.4f}, ratio {out['ratio']:.5f}")
        return out
    out = run(args.model, args.settings, args.text.read_text(), args.kv_cache_dtypes, args.max_tokens)
    out["model"] = args.model or "default (SmolLM2-135M-Instruct Q4_1)"
    out["machine"] = machine_info("cpu", args.threads)
    if args.text != TEXT:  # (run names the shipped text)
        out["text"] = str(args.text)
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
