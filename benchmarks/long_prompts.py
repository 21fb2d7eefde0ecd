"""Long prompts against llama.cpp's `llama-server`, same file, same run, over HTTP, one stream: prefill speed and the
decode speed after the prompt, at each prompt length.

    python -m benchmarks.long_prompts [--model PATH] [--lengths 1024 2048 4096 8000] [--rounds 2]

Both servers are up for the whole run, each sized for the longest prompt: llama-server `-np 1 -c LONGEST+64`
(its default f16 KV cache), ours `--kv-cache-bytes` for LONGEST+64 tokens at its cache dtype (float16 like the
peer's, unless its args name another: `shapes.kv_cache_args`) and `--max-model-len` to match. `--ours-args` given
several times runs one of ours per value beside the same llama-server (e.g. the float16 and the float32 KV cache,
`--ours-args '' --ours-args '--kv-cache-dtype float32'`), and `--peer-args` given several times one llama-server per
value beside the first (e.g. its q8_0 cache beside its f16 one). The int8 cache against both caches of each side:

    python -m benchmarks.long_prompts --ours-args '' --ours-args '--kv-cache-dtype int8' \
        --peer-args '' --peer-args '--cache-type-k q8_0 --cache-type-v q8_0' --out benchmarks/results/long-prompts-int8.json

`ratio` compares each of ours with the first llama-server, `ratios` with every one, and `vs_first_ours` each of ours
with the first of ours. Per length and round, on each side in turn (the order
flipping each round): one streamed `/v1/completions` request with a prompt of random token ids (a fresh seed each
time, so no prompt cache serves it), greedy, EOS ignored, 32 new tokens. Prefill tok/s = prompt length / time to
the first token; decode tok/s = 31 / (last token - first). Medians over rounds. `--out` is rewritten after every
request with each request's figures so far (`runs`: length -> side -> one entry a round), so a run stopped early (a
32k-token prefill takes the peer's q8_0 cache hours on 2 cores) keeps what it measured. Not part of CI (llama-server
is an optional peer; benchmarks/README.md).
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
from benchmarks.shapes import kv_cache_args

NEW_TOKENS = 32


class LongLlamaServer(ServedProcess):
    def __init__(self, binary: Path, model: Path, threads: int, context: int, log_path: Path,
                 extra: list[str] = ()) -> None:
        self.port = self.free_port()
        self.start([str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-np", "1",
                    "-c", str(context), "-t", str(threads), *extra], log_path, timeout=600)


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
    # (8000, not 8192: the prompt and its new tokens must fit the default model's context of 8192)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vocab", type=int, default=49152, help="prompt ids are drawn below this")
    p.add_argument("--llama-server", type=Path, default=Path(shutil.which("llama-server") or "/work/peers/llama-server"))
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--ours-args", action="append", default=None,
                   help="flags for our server; given again, one more of our servers in the same run (e.g. '' and "
                        "'--kv-cache-dtype float32'), each compared with llama-server")
    p.add_argument("--peer-args", action="append", default=None,
                   help="flags for llama-server; given again, one more llama-server in the same run (e.g. '' and "
                        "'--cache-type-k q8_0 --cache-type-v q8_0')")
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
    base = ["--model", str(model), "--max-model-len", str(context)]
    ours = {("ours " + a).strip(): ServedProcess(base + kv_cache_args(model, context, a.split()) + a.split(),
                                                 logs / f"ours{i}.log")
            for i, a in enumerate(args.ours_args or [""])}  # "ours", "ours --kv-cache-dtype float16", ...
    peers = {("llama-server " + a).strip(): LongLlamaServer(args.llama_server, model, args.threads, context,
                                                             logs / f"peer{i}.log", a.split())
             for i, a in enumerate(args.peer_args or [""])}  # "llama-server", "llama-server --cache-type-k q8_0 ..."
    first_peer, first_ours = next(iter(peers)), next(iter(ours))
    sides = {**{n: o.url for n, o in ours.items()}, **{n: p.url for n, p in peers.items()}}
    result: dict = {"machine": machine_info("cpu", args.threads), "model": str(model), "context": context,
                    "ours_cmd": {n: o.cmd for n, o in ours.items()}, "peer_cmd": peers[first_peer].cmd,
                    "peer_cmds": {n: p.cmd for n, p in peers.items()}, "new_tokens": NEW_TOKENS, "lengths": {},
                    "runs": {}}
    keys = ("prefill_tok_s", "decode_tok_s")

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    try:
        for url in sides.values():
            one(url, 64, args.vocab, seed=99)  # warm-up
        for length in args.lengths:
            runs: dict[str, list[dict]] = result["runs"].setdefault(length, {n: [] for n in sides})
            for r in range(args.rounds):
                for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                    runs[name].append(one(sides[name], length, args.vocab, seed=1000 * length + r))
                    save()
            entry = {n: {k: statistics.median(x[k] for x in v) for k in keys} for n, v in runs.items()}
            ratios = {n: {p: {k: entry[n][k] / entry[p][k] for k in keys} for p in peers} for n in ours}
            entry["ratio"] = {n: ratios[n][first_peer] for n in ours}
            entry["ratios"] = ratios
            entry["vs_first_ours"] = {n: {k: entry[n][k] / entry[first_ours][k] for k in keys} for n in ours}
            result["lengths"][length] = entry
            for n in ours:
                for peer in peers:
                    x, peer_s, ratio = entry[n], entry[peer], ratios[n][peer]
                    print(f"{length:6d} tokens, {n} vs {peer}: prefill {x['prefill_tok_s']:7.1f} vs "
                          f"{peer_s['prefill_tok_s']:7.1f} tok/s ({ratio['prefill_tok_s']:.2f}x); decode after it "
                          f"{x['decode_tok_s']:6.1f} vs {peer_s['decode_tok_s']:6.1f} ({ratio['decode_tok_s']:.2f}x)",
                          flush=True)
            save()
    finally:
        result["ours_exit"] = {n: o.stop() for n, o in ours.items()}
        result["peer_exit"] = {n: p.stop(grace=0) for n, p in peers.items()}
        save()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
