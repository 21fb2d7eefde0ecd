"""Long prompts against llama.cpp's `llama-server`, same file, same run, over HTTP, one stream: prefill speed and the
decode speed after the prompt, at each prompt length.

    python -m benchmarks.long_prompts [--model PATH] [--lengths 1024 2048 4096 8192] [--rounds 2]

Both servers are up for the whole run, each sized for the longest prompt: llama-server `-np 1 -c LONGEST+64`
(its default f16 KV cache), ours `--kv-cache-bytes` for LONGEST+64 tokens (float32 KV) and `--max-model-len`
to match. Per length and round, on each side in turn (the order flipping each round): one streamed
`/v1/completions` request with a prompt of random token ids (a fresh seed each time, so no prompt cache serves it),
greedy, EOS ignored, 32 new tokens. Prefill tok/s = prompt length / time to the first token; decode tok/s = 31 /
(last token - first). Medians over rounds. Not part of CI (llama-server is an optional peer; benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import sse_client
from benchmarks.load import ServedProcess
from benchmarks.machine import machine_info
from benchmarks.shapes import _kv_bytes_per_token

NEW_TOKENS = 32


class LongLlamaServer(ServedProcess):
    def __init__(self, binary: Path, model: Path, threads: int, context: int, log_path: Path) -> None:
        self.port = self.free_port()
        self.start([str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-np", "1",
                    "-c", str(context), "-t", str(threads)], log_path, timeout=600)


def one(url: str, length: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompt = [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(length)]

    async def go():
        t0 = time.perf_counter()
        out = await sse_client.stream(None, url, prompt, NEW_TOKENS, False)
        return t0, out

    t0, out = asyncio.run(go())
    if out["finish"] != "length":
        raise RuntimeError(f"{url}: finish_reason {out['finish']!r}")
    m = out["marks"]
    return {"prefill_tok_s": length / (m[0] - t0), "decode_tok_s": (NEW_TOKENS - 1) / (m[-1] - m[0])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.long_prompts", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vocab", type=int, default=49152, help="prompt ids are drawn below this")
    p.add_argument("--llama-server", type=Path, default=Path(shutil.which("llama-server") or "/work/peers/llama-server"))
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--ours-args", default="")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/long-prompts.json"))
    args = p.parse_args(argv)
    if not args.llama_server.is_file():
        print(f"llama-server not found at {args.llama_server}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    from model.loaders.checkpoint import default_model_path

    model = args.model or default_model_path()
    context = max(args.lengths) + 64
    logs = Path(tempfile.mkdtemp(prefix="long-prompts-"))
    ours_cmd = ["--model", str(model), "--kv-cache-bytes", str(context * _kv_bytes_per_token(model)),
                "--max-model-len", str(context), *args.ours_args.split()]
    ours = ServedProcess(ours_cmd, logs / "ours.log")
    peer = LongLlamaServer(args.llama_server, model, args.threads, context, logs / "peer.log")
    sides = {"ours": ours.url, "llama-server": peer.url}
    result: dict = {"machine": machine_info("cpu", args.threads), "model": str(model), "context": context,
                    "ours_cmd": ours.cmd, "peer_cmd": peer.cmd, "new_tokens": NEW_TOKENS, "lengths": {}}
    try:
        for url in sides.values():
            one(url, 64, args.vocab, seed=99)  # warm-up
        for length in args.lengths:
            runs: dict[str, list[dict]] = {n: [] for n in sides}
            for r in range(args.rounds):
                for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                    runs[name].append(one(sides[name], length, args.vocab, seed=1000 * length + r))
            entry = {n: {k: statistics.median(x[k] for x in v) for k in ("prefill_tok_s", "decode_tok_s")}
                     for n, v in runs.items()}
            entry["ratio"] = {k: entry["ours"][k] / entry["llama-server"][k] for k in ("prefill_tok_s", "decode_tok_s")}
            result["lengths"][length] = entry
            print(f"{length:6d} tokens: prefill ours {entry['ours']['prefill_tok_s']:7.1f} vs "
                  f"{entry['llama-server']['prefill_tok_s']:7.1f} tok/s ({entry['ratio']['prefill_tok_s']:.2f}x); "
                  f"decode after it {entry['ours']['decode_tok_s']:6.1f} vs {entry['llama-server']['decode_tok_s']:6.1f} "
                  f"({entry['ratio']['decode_tok_s']:.2f}x)", flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        result["ours_exit"], result["peer_exit"] = ours.stop(), peer.stop(grace=0)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
