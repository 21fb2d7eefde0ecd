"""Prefill and decode-after-the-prompt speed by prompt length, in-process (the engine driven as the service's thread
does), one stream: where long prompts' time goes, without HTTP or a peer. `benchmarks.ab` runs it on two checkouts.

    python -m benchmarks.prefill_lengths [--lengths 1024 2048 4096] [--model PATH] [--out FILE]

Per length: one request with a prompt of random token ids (no prefix-cache reuse: a fresh seed per length),
16 greedy new tokens, EOS ignored. prefill tok/s = length / time to the first token; decode tok/s = 15 / (last
token's step - first's). The KV pool and max_model_len are sized for the longest prompt.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from benchmarks.machine import machine_info
from benchmarks.ours import greedy
from model.engine import Engine, EngineConfig
from model.loaders import load_model

NEW_TOKENS = 16


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefill_lengths", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--quantization", default="auto")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/prefill-lengths.json"))
    args = p.parse_args(argv)
    lm = load_model(args.model, torch.float32, "cpu", quantization=args.quantization)
    c = lm.model.config
    context = max(args.lengths) + NEW_TOKENS + 16
    per_token = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(kv_cache_bytes=context * per_token + (1 << 20),
                                                         max_model_len=context, enable_prefix_caching=False))
    vocab = c.vocab_size
    result: dict = {"machine": machine_info("cpu", torch.get_num_threads()), "model": lm.name,
                    "quantization": lm.quantization, "lengths": {}}
    for i, length in enumerate([64, *args.lengths]):  # the first: a warm-up
        rng = random.Random(length)
        prompt = [rng.randrange(vocab // 4, vocab) for _ in range(length)]
        marks: list[float] = []
        t0 = time.perf_counter()
        engine.add_request(f"r{i}", prompt, greedy(NEW_TOKENS))
        while engine.has_unfinished():
            outs = engine.step()
            if any(o.token_ids for o in outs):
                marks.append(time.perf_counter())
        if i == 0:
            continue
        entry = {"prefill_tok_s": length / (marks[0] - t0), "decode_tok_s": (len(marks) - 1) / (marks[-1] - marks[0])}
        result["lengths"][str(length)] = entry
        print(f"{length:6d} tokens: prefill {entry['prefill_tok_s']:7.1f} tok/s, decode after it "
              f"{entry['decode_tok_s']:6.1f} tok/s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
