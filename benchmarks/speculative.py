"""Speculative decoding over HTTP: the same server with and without --speculative-config, greedy, on the default model.

    python -m benchmarks.speculative [--rounds 3] [--max-tokens 200] [--out FILE]

Each phase starts one server at a time (`python -m service ...` on loopback, torch's threads) and sends the prompts
of benchmarks/data/speculative_prompts.json through `/v1/chat/completions` (streamed, `logprobs` with the top
logprob), one at a time, then 32 at once:
- ngram: `--quantization auto` (the default model's int4) without speculation and with
  `{"method": "ngram", "num_speculative_tokens": 6}`, on the 8 input-grounded prompts and the 4 open-ended ones;
- self-draft: `--quantization none` (float32) without speculation and with an int4 copy of the same checkpoint
  drafting (`{"method": "draft_model", "model": "self", "quantization": "int4", "num_speculative_tokens": 8}`);
- concurrent: 32 requests at once (16 of the prompts in turn, --concurrent-tokens new tokens each) on each pair.

Both servers of a pair run at once, each idle while the other computes, and every prompt goes to one and then the
other (the order alternating by round), so a drift in the host's speed reaches both alike. Single stream: decode
tokens/s = tokens after the first chunk / (last chunk - first chunk), summed over a set's prompts (prefill apart).
Concurrent: every request's tokens / the wall time of the 32. Every answer with speculation is compared with the
one without: text, each token and its logprob and top logprob, finish reason; a difference is printed and recorded.
The ratio reported is the median over rounds of each round's on / off. Results and the machine go to
benchmarks/results/speculative.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.load import ServedProcess
from benchmarks.machine import machine_info

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "speculative.json"
PROMPTS = json.loads((ROOT / "data" / "speculative_prompts.json").read_text())
NGRAM = {"method": "ngram", "num_speculative_tokens": 6}
SELF_DRAFT = {"method": "draft_model", "model": "self", "quantization": "int4", "num_speculative_tokens": 8}
PAIRS = {  # name: (server flags without speculation, speculative config)
    "ngram": (["--quantization", "auto"], NGRAM),
    "self_draft": (["--quantization", "none"], SELF_DRAFT),
}


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _body(prompt: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "logprobs": True, "top_logprobs": 1}


async def _chat(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat completion -> {"text", "tokens": [(token, logprob, top)], "finish", "start", "marks"}."""
    out = {"text": "", "tokens": [], "finish": None, "marks": [], "start": time.perf_counter()}
    async with client.stream("POST", url + "/v1/chat/completions", json=_body(prompt, max_tokens)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                content = (choice.get("logprobs") or {}).get("content") or []
                if content:
                    out["marks"].append((time.perf_counter(), len(content)))
                out["text"] += choice["delta"].get("content") or ""
                out["tokens"] += [(c["token"], c["logprob"], [(t["token"], t["logprob"]) for t in c["top_logprobs"]])
                                  for c in content]
                out["finish"] = choice.get("finish_reason") or out["finish"]
    out["end"] = time.perf_counter()
    return out


def single_stream(url: str, prompts: list[str], max_tokens: int) -> tuple[dict, list[dict]]:
    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=600) as client:
            return [await _chat(client, url, p, max_tokens) for p in prompts]

    answers = asyncio.run(run())
    tokens = sum(len(a["tokens"]) for a in answers)
    decode_s = sum(a["marks"][-1][0] - a["marks"][0][0] for a in answers)
    decode_tokens = sum(len(a["tokens"]) - a["marks"][0][1] for a in answers)  # after the first chunk's
    figures = {"tokens": tokens, "decode_tok_s": decode_tokens / decode_s,
               "e2e_tok_s": tokens / sum(a["end"] - a["start"] for a in answers),
               "ttft_s_median": statistics.median(a["marks"][0][0] - a["start"] for a in answers)}
    return figures, answers


def concurrent(url: str, prompts: list[str], n: int, max_tokens: int) -> dict:
    async def run() -> tuple[list[dict], float]:
        async with httpx.AsyncClient(timeout=1200, limits=httpx.Limits(max_connections=n)) as client:
            t0 = time.perf_counter()
            answers = await asyncio.gather(*[_chat(client, url, prompts[i % len(prompts)], max_tokens) for i in range(n)])
            return answers, time.perf_counter() - t0

    answers, wall = asyncio.run(run())
    tokens = sum(len(a["tokens"]) for a in answers)
    return {"requests": n, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


def _serve(flags: list[str], spec: dict | None, log: Path) -> ServedProcess:
    args = flags + (["--speculative-config", json.dumps(spec)] if spec else [])
    return ServedProcess(args, log)


def _speculation_metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("llamascope_spec_decode_num_") and "_total" in line and "{" not in line:
            name, value = line.split()
            out[name.removeprefix("llamascope_spec_decode_").removesuffix("_total")] = float(value)
    return out


def _differences(base: list[dict], spec: list[dict]) -> list[str]:
    diffs = []
    for i, (a, b) in enumerate(zip(base, spec)):
        for key in ("text", "tokens", "finish"):
            if a[key] != b[key]:
                diffs.append(f"prompt {i}: {key} differs")
    return diffs


def _cpu_family() -> str:
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("vendor_id", "cpu family", "model", "flags") and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile") if f in flags]
    return f"{fields.get('vendor_id')} family {fields.get('cpu family')} model {fields.get('model')} ({', '.join(isa)})"


def _sum_rounds(answers_by_round: list[list[dict]]) -> dict:
    """Decode tok/s of each round's answers (tokens after the first chunk / first-to-last chunk time, summed)."""
    out = []
    for answers in answers_by_round:
        decode_s = sum(a["marks"][-1][0] - a["marks"][0][0] for a in answers)
        decode_tokens = sum(len(a["tokens"]) - a["marks"][0][1] for a in answers)
        out.append(decode_tokens / decode_s)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--concurrent", type=int, default=32)
    p.add_argument("--concurrent-tokens", type=int, default=64)
    p.add_argument("--pairs", default=",".join(PAIRS), help="comma-separated: " + ", ".join(PAIRS))
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    sets = {"input_grounded": PROMPTS["input_grounded"], "open_ended": PROMPTS["open_ended"]}
    mixed = [q for pair in zip(sets["input_grounded"], sets["open_ended"] * 2) for q in pair]
    logs = Path(tempfile.mkdtemp(prefix="speculative-"))
    summary: dict = {}
    runs: dict = {}
    differences: list[str] = []
    for name in args.pairs.split(","):
        flags, spec = PAIRS[name]
        # both servers up at once, each idle while the other computes; every prompt goes to one then the other
        # (the order alternating by round), so a drift in the host's speed (other tenants) reaches both alike
        servers = {"off": _serve(flags, None, logs / f"{name}-off.log"), "on": _serve(flags, spec, logs / f"{name}-on.log")}
        try:
            per = {side: {k: [] for k in (*sets, "concurrent")} for side in servers}
            for r in range(args.rounds):
                order = ("off", "on") if r % 2 == 0 else ("on", "off")
                for set_name, prompts in sets.items():
                    got: dict = {side: [] for side in servers}
                    for prompt in prompts:
                        for side in order:
                            _, answers = single_stream(servers[side].url, [prompt], args.max_tokens)
                            got[side] += answers
                    differences += [f"{name} {set_name} round {r + 1}: {d}" for d in _differences(got["off"], got["on"])]
                    for side in servers:
                        per[side][set_name] += _sum_rounds([got[side]])
                    _progress(f"{name} round {r + 1} {set_name}: off {per['off'][set_name][-1]:.1f}, "
                              f"on {per['on'][set_name][-1]:.1f} tok/s decode")
                for side in order:
                    per[side]["concurrent"].append(
                        concurrent(servers[side].url, mixed, args.concurrent, args.concurrent_tokens)["tok_s"])
                _progress(f"{name} round {r + 1} {args.concurrent} concurrent: off {per['off']['concurrent'][-1]:.1f}, "
                          f"on {per['on']['concurrent'][-1]:.1f} tok/s")
            runs[name] = {**per, "spec_decode": _speculation_metrics(servers["on"].url)}
        finally:
            for server in servers.values():
                server.stop()
        summary[name] = {k: {"off": statistics.median(per["off"][k]), "on": statistics.median(per["on"][k]),
                             "ratio": statistics.median(b / a for a, b in zip(per["off"][k], per["on"][k])),
                             "ratios": [b / a for a, b in zip(per["off"][k], per["on"][k])]}
                         for k in per["off"]}
    result = {"command": "python -m benchmarks.speculative " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": {**machine_info("cpu", torch.get_num_threads()), "cpu": _cpu_family()},
              "configs": {n: {"flags": PAIRS[n][0], "speculative_config": PAIRS[n][1]} for n in runs},
              "max_tokens": args.max_tokens, "concurrent_tokens": args.concurrent_tokens,
              "summary": summary, "identical": not differences, "differences": differences, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"host: {result['machine']['cpu']}")
    for name, rows in summary.items():
        for k, v in rows.items():
            print(f"{name:10s} {k:15s} off {v['off']:7.1f}  on {v['on']:7.1f} tok/s  median ratio {v['ratio']:.2f}x "
                  f"(rounds {', '.join(f'{x:.2f}' for x in v['ratios'])})")
    print("answers identical with and without speculation" if not differences else
          f"{len(differences)} answers differ: {differences[:5]}")
    return 0 if not differences else 1


if __name__ == "__main__":
    sys.exit(main())
