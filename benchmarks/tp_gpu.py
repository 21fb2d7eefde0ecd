"""Tensor parallelism, measured: decode tok/s of TP=1 and TP=N on the same checkpoint, the same batch of greedy
requests and the same engine configuration, one after the other in one run; greedy tokens are checked equal.

Like with like: the headline pair runs both sides eagerly (`decode_graphs="off"`), since a TP=N engine has no
decode graphs (model/engine/cuda_graphs.py turns them off for tensor-parallel models) and TP=1 with graphs against TP=N
without would credit the graphs to TP=1. A second pair with graphs on both sides runs where both engines got them;
otherwise the JSON says why it was skipped and still records TP=1 with graphs on its own.

    python -m benchmarks.tp_gpu --tp 2                              # CUDA, NCCL, bfloat16, a random ~1B LLaMA
    python -m benchmarks.tp_gpu --tp 2 --model /path/to/hf-or-gguf  # a real checkpoint
    python -m benchmarks.tp_gpu --tp 2 --tiny --device cpu          # gloo on CPU: a smoke test, not a result

Without --model a random checkpoint (safetensors + a byte-level tokenizer) is written to a temporary directory:
--tiny a 2-layer toy, else a TinyLlama-1.1B-shaped model (22 layers, d=2048, 32 heads, 4 KV heads, F=5632).
Decode tok/s = the tokens generated after every request's first one, over the time from the last first token to
the end (all requests are added at t=0 with equal prompt lengths, so that span is decode steps only).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.agreement import FIRST_TOKENS, TOLERANCE, TOP_K, compare
from benchmarks.measure import Clock
from benchmarks.ours import logprob_steps, run_concurrent, warm_up
from model.engine import Engine, EngineConfig
from model.loaders.checkpoint import load_model
from model.parallel.plan import parameter_bytes

TINY = dict(vocab_size=258, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
TINYLLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4)


def write_random_checkpoint(directory: Path, shape: dict, dtype: torch.dtype, seed: int = 0) -> Path:
    """An HF LLaMA directory with N(0, 0.02) weights (norm gains 1: sane activations at 1B scale, unlike
    tiny_checkpoint's spread-out toy weights) and tiny_checkpoint's byte-level tokenizer."""
    from safetensors.torch import save_file

    from benchmarks.tiny_checkpoint import byte_backend

    directory.mkdir(parents=True, exist_ok=True)
    V, D, F, L = shape["vocab_size"], shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    H, K = shape["num_attention_heads"], shape["num_key_value_heads"]
    E = D // H
    g = torch.Generator().manual_seed(seed)

    def w(*s):
        return (torch.randn(*s, generator=g) * 0.02).to(dtype)

    t = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": torch.ones(D, dtype=dtype), "lm_head.weight": w(V, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": torch.ones(D, dtype=dtype),
              p + "post_attention_layernorm.weight": torch.ones(D, dtype=dtype),
              p + "self_attn.q_proj.weight": w(H * E, D), p + "self_attn.k_proj.weight": w(K * E, D),
              p + "self_attn.v_proj.weight": w(K * E, D), p + "self_attn.o_proj.weight": w(D, H * E),
              p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D), p + "mlp.down_proj.weight": w(D, F)}
    save_file(t, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}))
    byte_backend().save(str(directory / "tokenizer.json"))  # the byte-level tokenizer the tests serve with
    return directory


def measure(loaded, args: argparse.Namespace, graphs: bool) -> dict | None:
    """Decode tok/s of the batch on an engine with (graphs) or without decode graphs; None where graphs were asked
    for and this model's engine has none."""
    gc.collect()  # the previous engine's pool goes before this one's is allocated
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    model = loaded.model
    config = EngineConfig(kv_cache_bytes=args.kv_cache_mb << 20, max_num_seqs=args.batch,
                          max_num_batched_tokens=max(512, args.batch * args.prompt_len),
                          decode_graphs="auto" if graphs else "off")
    engine = Engine(model, loaded.tokenizer, config)
    if graphs and engine.runner.graphs is None:
        return None
    V = min(model.config.vocab_size, 256)  # byte ids: valid in every vocabulary this script builds
    warm_up(engine, V)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, V, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    r = run_concurrent(engine, prompts, args.max_tokens, Clock(model.device), tag="bench")
    t0 = max(r.ttft_s)
    decode_tokens = r.num_output_tokens - args.batch
    shard = getattr(model, "shard", model)
    return {"decode_tok_s": decode_tokens / (r.wall_s - t0), "wall_s": r.wall_s, "ttft_max_s": t0,
            "rank0_parameter_mb": parameter_bytes(shard) / 2**20, "kv_cache_mb_per_rank": engine.cache.nbytes / 2**20,
            "decode_graphs": engine.runner.graphs is not None, "token_ids": r.token_ids,
            "logprob_steps": logprob_steps(engine, prompts[0], min(16, args.max_tokens), TOP_K)}


def _pair(r1: dict | None, rn: dict | None, tp: int, dtype: torch.dtype) -> dict:
    """TP=1 vs TP=N measured the same way: speedup, greedy tokens, and the logprob agreement of one request."""
    if r1 is None or rn is None:
        side = "TP=1" if r1 is None else f"TP={tp}"
        return {"skipped": f"{side} has no decode graphs here (model/engine/cuda_graphs.py: CUDA with Triton, and not "
                           "for tensor-parallel models)",
                **({"tp1": _strip(r1)} if r1 is not None else {})}
    agreement = compare(r1["logprob_steps"], rn["logprob_steps"], TOLERANCE[dtype], FIRST_TOKENS)
    same = r1["token_ids"] == rn["token_ids"]
    return {"tp1": _strip(r1), f"tp{tp}": _strip(rn), "speedup": rn["decode_tok_s"] / r1["decode_tok_s"],
            "greedy_tokens_equal": same, "agreement": agreement}


def _strip(r: dict) -> dict:
    return {k: v for k, v in r.items() if k not in ("token_ids", "logprob_steps")}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tp_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size N compared with 1")
    p.add_argument("--model", help="HF directory or GGUF file (default: a random checkpoint)")
    p.add_argument("--tiny", action="store_true", help="a toy random model (with --device cpu: the gloo smoke test)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-cache-mb", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results JSON here")
    args = p.parse_args(argv)
    from model.dtypes import DTYPES
    from model.parallel.rank0 import launch

    dtype = DTYPES[args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")]
    if args.device.startswith("cuda") and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"TP={args.tp} needs {args.tp} GPUs; this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else write_random_checkpoint(
            Path(tmp) / "random", TINY if args.tiny else TINYLLAMA, dtype)
        one = load_model(path, dtype, args.device)
        r1, r1_graphs = measure(one, args, graphs=False), measure(one, args, graphs=True)
        del one
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        n = launch(path, args.tp, dtype, args.device)
        launch_s = time.perf_counter() - t0
        try:
            rn, rn_graphs = measure(n, args, graphs=False), measure(n, args, graphs=True)
        finally:
            n.model.close()
    eager, graphs = _pair(r1, rn, args.tp, dtype), _pair(r1_graphs, rn_graphs, args.tp, dtype)
    result = {"device": args.device, "dtype": str(dtype), "tp": args.tp, "batch": args.batch, "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
              "launch_s": launch_s, "mode": "eager (decode_graphs off) on both sides", **eager, "graphs": graphs}
    agree = "agree" if eager["agreement"]["agree"] else "DISAGREE"
    result["summary"] = (f"eager: TP=1 {eager['tp1']['decode_tok_s']:.1f} tok/s, TP={args.tp} "
                         f"{eager[f'tp{args.tp}']['decode_tok_s']:.1f} tok/s ({eager['speedup']:.2f}x), logprobs {agree}; "
                         + (f"graphs: {graphs['speedup']:.2f}x" if "speedup" in graphs else f"graphs: {graphs['skipped']}"))
    for name, pair in (("eager", eager), ("graphs", graphs)):
        if "speedup" not in pair:
            print(f"{name:<7} skipped: {pair['skipped']}")
            continue
        r1, rn = pair["tp1"], pair[f"tp{args.tp}"]
        print(f"{name:<7} TP=1        decode {r1['decode_tok_s']:9.1f} tok/s   rank-0 weights {r1['rank0_parameter_mb']:8.1f} MB")
        print(f"{name:<7} TP={args.tp:<8d} decode {rn['decode_tok_s']:9.1f} tok/s   rank-0 weights "
              f"{rn['rank0_parameter_mb']:8.1f} MB   ({pair['speedup']:.2f}x; greedy tokens "
              f"{'equal' if pair['greedy_tokens_equal'] else 'differ'}; logprobs "
              f"{'agree' if pair['agreement']['agree'] else 'DISAGREE'})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
