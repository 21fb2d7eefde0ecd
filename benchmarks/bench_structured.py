"""What structured outputs cost: constrained decoding beside the same run unconstrained, one process, one engine.

    .venv/bin/python -m benchmarks.bench_structured [--model PATH] [--quantization none|int4] [--rounds 3]
                                                    [--max-tokens 64] [--out benchmarks/results/cpu-structured.json]

The engine is driven through `Engine.step()` as the service's engine thread drives it (benchmarks/ours.py), with
the prefix cache off so that no phase reuses another's prefill. Every request is greedy with ignore_eos, and the
constrained ones follow a schema no output can complete within max_tokens (an array of at least 100 nested
objects: strings, enums, bounded numbers), so every request of every phase generates exactly max_tokens tokens
and the phases do the same amount of model work:

1. concurrent: 32 chat requests at once, none constrained / half constrained (each with its own grammar state),
   the masks filled on the worker thread during the forward (overlap) and on the engine thread (no overlap);
   output tok/s, the ratio to the unconstrained phase;
2. single stream: one request, unconstrained / constrained (overlap and not); decode tok/s, the ratio;
3. compile: the vocabulary's one-time set-up, a cold compile of the schema (a fresh compiler each time), a cached one.
Phases interleave within each of --rounds rounds; the median round is reported, and --out is rewritten after
every round (a run stopped early keeps its completed rounds; `rounds_done` says how many). On a shared machine
the throughput ratios move with the neighbours' load, so each phase also reports tokens per CPU-second of the process (every
thread: what the neighbours' load moves least), and the seconds spent in the structured-output work
itself (filling masks, waiting for them, masking the logits, advancing the matchers), timed around those calls on
the engine thread, and its share of the phase's wall time: the cost, measured in the same conditions as the step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.machine import machine_info
import model.features.structured.masks as masks_module
from model.engine import Engine, EngineConfig, RequestOptions, SamplingParams
from model.features.structured import (GrammarCompiler, PendingMasks, SequenceGrammar, Structured, StructuredOutputs,
                                       StructuredOutputSpec)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["student", "teacher", "engineer", "artist"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "country": {"enum": ["FR", "DE", "JP", "PE"]}},
                    "required": ["city", "country"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "score", "address"],
    "additionalProperties": False,
}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 100}},
          "required": ["people"], "additionalProperties": False}
TOPICS = ["a lighthouse keeper", "a baker in Lyon", "two chess players", "a school in Kyoto", "a ship's crew",
          "a jazz band", "a team of engineers", "a village in Peru"]


def prompts(tok, n: int) -> list[list[int]]:
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"List the people in a story about "
                                                 f"{TOPICS[i % len(TOPICS)]} (story {i}) as JSON."}]), add_bos=False)
            for i in range(n)]


def params(max_tokens: int, constrained: bool) -> tuple[SamplingParams, RequestOptions]:
    spec = StructuredOutputSpec.json_schema(SCHEMA) if constrained else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), RequestOptions(structured=spec)


@contextlib.contextmanager
def timed_structured_work():
    """Adds up the engine thread's seconds inside the structured-output calls while the block runs."""
    spent = [0.0]
    patched = [(StructuredOutputs, "start_masks"), (PendingMasks, "result"), (SequenceGrammar, "accept"),
               (masks_module, "_apply_allowed")]
    originals = [getattr(owner, name) for owner, name in patched]

    def timer(fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t
        return wrapper

    for (owner, name), fn in zip(patched, originals):
        setattr(owner, name, timer(fn))
    try:
        yield spent
    finally:
        for (owner, name), fn in zip(patched, originals):
            setattr(owner, name, fn)


def drive(engine: Engine, reqs: list[tuple[list[int], tuple[SamplingParams, RequestOptions]]],
          tag: str) -> tuple[float, int, list[float]]:
    """(wall seconds, output tokens, per-step seconds after the first token) with every request added at t = 0."""
    t0 = time.perf_counter()
    for i, (prompt, (p, options)) in enumerate(reqs):
        engine.add_request(f"{tag}-{i}", prompt, p, options)
    n, steps, last = 0, [], None
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.error:
                raise RuntimeError(out.error)
            n += len(out.token_ids)
        if last is not None and any(o.token_ids for o in outs):
            steps.append(now - last)
        if any(o.token_ids for o in outs):
            last = now
    return time.perf_counter() - t0, n, steps


def compile_times(tok, vocab_size: int, rounds: int) -> dict:
    c = GrammarCompiler(tok, vocab_size)
    t = time.perf_counter()
    _ = c.ll_tokenizer
    setup = time.perf_counter() - t
    cold = []
    for _ in range(rounds):
        fresh = GrammarCompiler(tok, vocab_size)
        fresh._ll_tokenizer = c.ll_tokenizer  # the per-server vocabulary set-up, measured above, is not a compile
        t = time.perf_counter()
        fresh.compile(StructuredOutputSpec.json_schema(SCHEMA))
        cold.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(100):
        c.compile(StructuredOutputSpec.json_schema(SCHEMA))
    cached = (time.perf_counter() - t) / 100
    return {"vocabulary_setup_ms": setup * 1e3, "schema_compile_ms_median": statistics.median(cold) * 1e3,
            "schema_compile_ms_all": [x * 1e3 for x in cold], "cached_compile_us": cached * 1e6,
            "schema_chars": len(json.dumps(SCHEMA))}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_structured", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--quantization", choices=["none", "int8", "int4"], default="none")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request, every phase")
    p.add_argument("--single-max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from model.loaders.checkpoint import default_model_path, load_model

    loaded = load_model(args.model or default_model_path(), torch.float32, "cpu", quantization=args.quantization)
    tok, model = loaded.tokenizer, loaded.model
    V = model.config.vocab_size
    engine = Engine(model, tok, EngineConfig(max_num_seqs=args.num_requests, max_num_batched_tokens=2048,
                                             enable_prefix_caching=False, decode_graphs="off"))
    ps = prompts(tok, args.num_requests)
    compiles = compile_times(tok, V, 5)
    structured = next(f for f in engine.features.features if isinstance(f, Structured)).outputs  # the engine's own
    structured.compile(StructuredOutputSpec.json_schema(SCHEMA))  # as the service does before submitting
    drive(engine, [(ps[0], params(4, True)), (ps[1], params(4, False))], "warmup")

    half = [(pr, params(args.max_tokens, i % 2 == 0)) for i, pr in enumerate(ps)]
    phases = {
        "concurrent_free": lambda: drive(engine, [(pr, params(args.max_tokens, False)) for pr in ps], "free"),
        "concurrent_half_overlap": lambda: drive(engine, half, "half"),
        "concurrent_half_no_overlap": lambda: drive(engine, half, "half"),
        "single_free": lambda: drive(engine, [(ps[0], params(args.single_max_tokens, False))], "s"),
        "single_constrained_overlap": lambda: drive(engine, [(ps[0], params(args.single_max_tokens, True))], "s"),
        "single_constrained_no_overlap": lambda: drive(engine, [(ps[0], params(args.single_max_tokens, True))], "s"),
    }
    rounds: dict[str, list[dict]] = {k: [] for k in phases}

    def summary() -> dict:
        """The report over the rounds done so far (medians), written after every round: on a loaded machine a run
        can be stopped early and still leave its completed rounds."""
        med = {k: statistics.median(x["tok_s"] for x in v) for k, v in rounds.items()}
        med_cpu = {k: statistics.median(x["tok_per_cpu_s"] for x in v) for k, v in rounds.items()}
        report = {
            "machine": machine_info("cpu", torch.get_num_threads()),
            "load_average_after": list(__import__("os").getloadavg()),
            "model": loaded.name, "quantization": args.quantization,
            "rounds_done": len(rounds["single_constrained_no_overlap"]), "rounds": rounds, "median_tok_s": med,
            "ratios": {
                "concurrent_half_overlap": med["concurrent_half_overlap"] / med["concurrent_free"],
                "concurrent_half_no_overlap": med["concurrent_half_no_overlap"] / med["concurrent_free"],
                "single_constrained_overlap": med["single_constrained_overlap"] / med["single_free"],
                "single_constrained_no_overlap": med["single_constrained_no_overlap"] / med["single_free"],
            },
            "ratios_per_cpu_second": {k: med_cpu[k] / med_cpu["concurrent_free" if k.startswith("concurrent") else "single_free"]
                                      for k in med_cpu if "free" not in k},
            "structured_share_median": {k: statistics.median(x["structured_share"] for x in v) for k, v in rounds.items()},
            "compile": compiles,
            "workload": {"num_requests": args.num_requests, "max_tokens": args.max_tokens,
                         "single_max_tokens": args.single_max_tokens, "prompt_tokens": [len(x) for x in ps]},
        }
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")
        return report

    for r in range(args.rounds):
        for name, fn in phases.items():
            structured.masks.overlap = not name.endswith("no_overlap")
            cpu0 = time.process_time()
            with timed_structured_work() as spent:
                wall, n, steps = fn()
            cpu = time.process_time() - cpu0  # every thread of the process: less moved by neighbours than wall time
            tps = n / wall if name.startswith("concurrent") else (len(steps) / sum(steps) if steps else 0.0)
            rounds[name].append({"wall_s": wall, "output_tokens": n, "tok_s": tps,
                                 "step_ms_median": statistics.median(steps) * 1e3 if steps else None,
                                 "structured_s": spent[0], "structured_share": spent[0] / wall,
                                 "cpu_s": cpu, "tok_per_cpu_s": n / cpu})
            print(f"round {r} {name:32s} {tps:7.1f} tok/s ({n} tokens, {wall:.1f} s; structured work "
                  f"{spent[0] * 1e3:.0f} ms = {100 * spent[0] / wall:.2f}%)", flush=True)
        report = summary()
    print(json.dumps({"ratios": report["ratios"], "ratios_per_cpu_second": report["ratios_per_cpu_second"],
                      "median_tok_s": report["median_tok_s"], "compile": compiles,
                      "rounds_done": report["rounds_done"], "structured_share_median": report["structured_share_median"]}, indent=2))
    return report


if __name__ == "__main__":
    main()
