"""The sink + window KV cache over HTTP (StreamingLLM, Xiao et al. 2024), on the default model in float32.

    .venv/bin/python -m benchmarks.streaming [--text /usr/share/common-licenses/GPL-3] [--tokens 4096]
                                             [--windows 256 1024] [--sinks 4] [--generate 2048]
                                             [--generate-sinks 4 0] [--temperature 1] [--top-p 1] [--quick]

1. Perplexity of a long real text (Debian's base-files installs the GPL-3 at /usr/share/common-licenses/GPL-3 on
   every Debian system, about 8,000 tokens with the default tokenizer), scored by the server itself: one
   `/v1/completions` request per setting with `echo` + `logprobs` (the prompt's own logprobs, max_tokens 1), under
   full attention, each window with its sink tokens, and each window with `sink_tokens: 0` (the paper's control).
   Perplexity = exp(mean NLL of tokens 1..N-1).
2. Generation past the context: a server started with `--max-model-len 512` generates `--generate` tokens (4x the
   context) after a 64-token prompt, sampling (`--temperature`, `--top-p`; default 1 and 1; seed 0, EOS ignored) with a window of 256 and 4
   sinks, then again without sinks (`--generate-sinks`); the rolling perplexity of the sampled tokens (exp of their
   mean NLL under the model, per 256 tokens) shows whether the model stays on its feet once the context has rolled
   over many times. The same server then scores the text of part 1 (4x its context and more) with and without
   sinks, per 256 tokens: the paper's figure 3, a rolling perplexity that stays flat with sinks.

Each part runs its own server (`python -m service`, benchmarks/load.py's ServedProcess) on a free loopback port;
the machine, its load average before and after, and every number go to benchmarks/results/streaming.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.load import ServedProcess
from benchmarks.machine import machine_info

RESULTS = Path(__file__).resolve().parent / "results" / "streaming.json"
GPL3 = Path("/usr/share/common-licenses/GPL-3")
SERVER = ["--quantization", "none", "--dtype", "float32", "--block-size", "16", "--max-num-batched-tokens", "512"]
# On a shared, oversubscribed machine spinning OpenMP barriers make a step take seconds (bench_decode says the same);
# the servers run with passive waits unless the caller set the variable.
SERVER_ENV = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def _progress(msg: str) -> None:
    print(f"[streaming] {msg}", file=sys.stderr, flush=True)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _tokenize(url: str, text: str) -> list[int]:
    r = httpx.post(url + "/tokenize", json={"prompt": text}, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def _rolling(lps: list[float], every: int) -> list[float]:
    """exp(mean NLL) of each run of `every` logprobs: perplexity as the sequence goes on."""
    return [math.exp(-sum(lps[i : i + every]) / len(lps[i : i + every])) for i in range(0, len(lps), every)]


def perplexity(url: str, ids: list[int], window: dict | None, every: int = 256) -> dict:
    """The server's own scoring of `ids` (echo + logprobs), under `window` (a kv_window object) or full attention;
    also per `every` tokens (the first entry covers tokens 1..every-1)."""
    body = {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0.0}
    if window is not None:
        body["kv_window"] = window
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=3600)
    r.raise_for_status()
    lps = r.json()["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)]  # the prompt's tokens 1..N-1
    nll = -sum(lps) / len(lps)
    return {"kv_window": window, "nll": nll, "perplexity": math.exp(nll), "rolling_every": every,
            "rolling_perplexity": _rolling(lps, every), "seconds": time.perf_counter() - t0}


def generate(url: str, prompt: list[int], n: int, window: dict, every: int, temperature: float = 1.0,
             top_p: float = 1.0) -> dict:
    body = {"prompt": prompt, "max_tokens": n, "temperature": temperature, "top_p": top_p, "seed": 0,
            "ignore_eos": True, "logprobs": 0, "kv_window": window}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=7200)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    lps = choice["logprobs"]["token_logprobs"]
    rolling = _rolling(lps, every)
    return {"kv_window": window, "tokens": len(lps), "finish_reason": choice["finish_reason"], "rolling_every": every,
            "rolling_perplexity": rolling, "seconds": time.perf_counter() - t0}


def run(args: argparse.Namespace) -> dict:
    logs = Path(tempfile.mkdtemp(prefix="llamascope-streaming-"))
    out: dict = {"schema": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "command": " ".join(["python -m benchmarks.streaming", *args.argv]),
                 "machine": machine_info("cpu", os.cpu_count()), "load_avg_before": _load(),
                 "model": "default (SmolLM2-135M-Instruct Q4_1 GGUF, dequantized to float32)", "server": SERVER,
                 "server_env": SERVER_ENV}
    _progress(f"perplexity server (logs in {logs})")
    server = ServedProcess(SERVER, logs / "perplexity.log", SERVER_ENV)
    try:
        ids = _tokenize(server.url, args.text.read_text())[: args.tokens]
        out["text"] = {"path": str(args.text), "tokens": len(ids)}
        rows = [("full attention", None)]
        for w in args.windows:
            rows += [(f"window {w} + {args.sinks} sinks", {"sink_tokens": args.sinks, "window": w}),
                     (f"window {w}, no sinks", {"sink_tokens": 0, "window": w})]
        out["perplexity"] = []
        for name, window in rows:
            _progress(f"{name}: {len(ids)} tokens (load {_load()})")
            res = perplexity(server.url, ids, window)
            res["setting"] = name
            out["perplexity"].append(res)
            _progress(f"  perplexity {res['perplexity']:.3f} in {res['seconds']:.0f} s")
    finally:
        server.stop()
    full = out["perplexity"][0]["perplexity"]
    for res in out["perplexity"]:
        res["vs_full"] = res["perplexity"] / full
    if args.generate:
        _progress("generation server: --max-model-len 512")
        server = ServedProcess(SERVER + ["--max-model-len", "512"], logs / "generate.log", SERVER_ENV)
        try:
            prompt = _tokenize(server.url, args.text.read_text())[:64]
            out["generation"] = {"max_model_len": 512, "prompt_tokens": len(prompt), "temperature": args.temperature,
                                 "top_p": args.top_p, "runs": []}
            for window in [{"sink_tokens": s, "window": 256} for s in args.generate_sinks]:
                _progress(f"generating {args.generate} tokens with {window} (load {_load()})")
                res = generate(server.url, prompt, args.generate, window, 256, args.temperature, args.top_p)
                out["generation"]["runs"].append(res)
                _progress("  rolling perplexity " + " ".join(f"{x:.1f}" for x in res["rolling_perplexity"]))
            # the text itself past the 512-token context: its prompt logprobs under the window, per 256 tokens
            out["generation"]["text"] = []
            for window in ({"sink_tokens": args.sinks, "window": 256}, {"sink_tokens": 0, "window": 256}):
                _progress(f"scoring {len(ids)} tokens of the text with {window} (load {_load()})")
                res = perplexity(server.url, ids, window)
                out["generation"]["text"].append(res)
                _progress("  rolling perplexity " + " ".join(f"{x:.1f}" for x in res["rolling_perplexity"]))
        finally:
            server.stop()
    out["load_avg_after"] = _load()
    return out


def print_report(r: dict) -> None:
    m = r["machine"]
    print(f"\n{r['text']['tokens']} tokens of {r['text']['path']}, default model float32; {m.get('cpu_model')}, "
          f"load {r['load_avg_before']} -> {r['load_avg_after']}\n")
    print(f"{'setting':<26} {'perplexity':>10} {'vs full':>8} {'seconds':>8}")
    for e in r["perplexity"]:
        print(f"{e['setting']:<26} {e['perplexity']:>10.3f} {e['vs_full']:>7.3f}x {e['seconds']:>8.0f}")
    g = r.get("generation")
    if g:
        print(f"\ngeneration past the context (--max-model-len {g['max_model_len']}, {g['prompt_tokens']}-token prompt, "
              f"temperature {g.get('temperature', 1.0)}, top_p {g.get('top_p', 1.0)}, seed 0): rolling perplexity of "
              f"the sampled tokens per 256")
        for e in g["runs"]:
            w = e["kv_window"]
            print(f"  window {w['window']}, {w['sink_tokens']} sinks: {e['tokens']} tokens, finish {e['finish_reason']}: "
                  + " ".join(f"{x:.1f}" for x in e["rolling_perplexity"]))
        print(f"the text's {r['text']['tokens']} tokens scored on the same server (echo + logprobs), per 256 tokens:")
        for e in g.get("text", []):
            w = e["kv_window"]
            print(f"  window {w['window']}, {w['sink_tokens']} sinks: {e['perplexity']:.3f} overall: "
                  + " ".join(f"{x:.1f}" for x in e["rolling_perplexity"]))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.streaming", description=__doc__.splitlines()[0])
    p.add_argument("--text", type=Path, default=GPL3)
    p.add_argument("--tokens", type=int, default=4096, help="score the text's first N tokens")
    p.add_argument("--windows", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--generate", type=int, default=2048, help="tokens generated past a 512 context (0: skip)")
    p.add_argument("--generate-sinks", type=int, nargs="+", default=None,
                   help="the sink counts generated with (default: --sinks, then 0, the paper's control)")
    p.add_argument("--temperature", type=float, default=1.0, help="the generation's sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="the generation's nucleus (top_p)")
    p.add_argument("--quick", action="store_true", help="512 tokens, window 128, 256 generated: a smoke test")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.generate_sinks is None:
        args.generate_sinks = [args.sinks, 0]
    if args.quick:
        args.tokens, args.windows, args.generate = 512, [128], 256
    results = run(args)
    path = args.out or RESULTS.with_name(f"streaming{'-quick' if args.quick else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print_report(results)
    print(f"\nresults: {path}")
    return results


if __name__ == "__main__":
    main()
