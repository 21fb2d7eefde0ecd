"""xgrammar beside llguidance on this machine: the numbers behind the choice of grammar engine (docs/performance.md).

    .venv/bin/python -m benchmarks.bench_grammar_engines [--model PATH] [--rounds 5] [--out results.json]

Both engines need only the default model's vocabulary (its GGUF tokenizer); neither sees the network. Per engine:
1. tokenizer set-up: the per-vocabulary preprocessing each does once per server;
2. compile: a realistic nested JSON schema (objects in objects, an array of objects, enums, required fields,
   bounded numbers) from scratch, median of --rounds cold compiles (a fresh compiler each time: no cache);
3. mask time per token: the token bitmask of every position of a valid output, filled then advanced, at batch 1
   (one matcher) and batch 32 (32 matchers on 32 different outputs, each step filling all 32 rows, the way a decode
   step of 32 constrained rows needs them), serially on the calling thread and with the engine's own parallel API.
Each engine runs in compact-JSON mode (no free whitespace), the mode the server uses.

xgrammar is not a dependency of the project: install it by hand to measure it (`pip install xgrammar`; it pulls
transformers, triton and apache-tvm-ffi). An engine that is not installed is reported as missing, not measured.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks.machine import machine_info

# An order: nested objects, an array of objects, enums, required fields, integers and numbers with bounds.
SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 999999},
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string", "maxLength": 60},
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 30},
                        "country": {"enum": ["FR", "DE", "US", "JP"]},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 12},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                    "unit_price": {"type": "number", "minimum": 0, "maximum": 10000},
                },
                "required": ["sku", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
    },
    "required": ["order_id", "status", "customer", "items"],
    "additionalProperties": False,
}


def instances(n: int, seed: int = 0) -> list[str]:
    """n different compact JSON documents that validate against SCHEMA."""
    rng = random.Random(seed)
    words = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "Ken", "Leslie", "Niklaus"]
    cities = ["Paris", "Berlin", "Boston", "Kyoto", "Lyon", "Munich"]
    out = []
    for _ in range(n):
        doc = {
            "order_id": rng.randint(1, 999999),
            "status": rng.choice(["pending", "paid", "shipped", "cancelled"]),
            "customer": {"name": f"{rng.choice(words)} {rng.choice(words)}",
                         "email": f"{rng.choice(words).lower()}@example.com",
                         "address": {"city": rng.choice(cities), "country": rng.choice(["FR", "DE", "US", "JP"]),
                                     "zip": f"{rng.randint(0, 99999):05d}"}},
            "items": [{"sku": f"SKU-{rng.randint(0, 9999)}", "quantity": rng.randint(1, 100),
                       "unit_price": round(rng.uniform(0, 500), 2)} for _ in range(rng.randint(1, 3))],
            "gift": rng.random() < 0.5,
        }
        out.append(json.dumps(doc, separators=(",", ":")))
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Llguidance:
    name = "llguidance"

    def __init__(self, tok) -> None:
        import llguidance

        self.ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(tok._tk.to_str(), n_vocab=tok.vocab_size, eos_token=sorted(tok.stop_ids))
        self.grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
        self.executor = llguidance.LLExecutor()

    def compile(self):
        m = self.ll.LLMatcher(self.tokenizer, self.grammar)
        assert not m.is_error(), m.get_error()
        return m

    def matchers(self, compiled, n: int) -> list:
        return [compiled.deep_copy() for _ in range(n)]

    def fill(self, matcher, mask: torch.Tensor, row: int) -> None:
        v = mask[row]
        matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def fill_batch(self, matchers: list, mask: torch.Tensor) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.data_ptr(),
                                              mask.shape[1] * 4, mask.shape[0])

    def accept(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok) -> None:
        import xgrammar

        self.xgr = xgrammar
        vocab = [tok.id_to_token(i) or "" for i in range(tok.vocab_size)]
        # GPT-2-style byte-level BPE (SmolLM2's): the raw vocabulary strings, decoded by xgrammar's byte-level rule
        self.info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=tok.vocab_size,
                                           stop_token_ids=sorted(tok.stop_ids))

    def compile(self):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(SCHEMA, any_whitespace=False, separators=(",", ":"))

    def matchers(self, compiled, n: int) -> list:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matcher, mask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(mask, row)

    def fill_batch(self, matchers: list, mask: torch.Tensor) -> None:
        if not hasattr(self, "batch"):
            self.batch = self.xgr.BatchGrammarMatcher()
        self.batch.batch_fill_next_token_bitmask(matchers, mask)

    def accept(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)


def measure(engine_cls, tok, rounds: int) -> dict:
    t0 = time.perf_counter()
    engine = engine_cls(tok)
    setup_s = time.perf_counter() - t0
    compile_s = [_timed(engine.compile) for _ in range(rounds)]
    compiled = engine.compile()
    docs = [tok.encode(d, add_bos=False) for d in instances(32)]
    words = (tok.vocab_size + 31) // 32
    result = {"tokenizer_setup_ms": setup_s * 1e3, "compile_ms_median": statistics.median(compile_s) * 1e3,
              "compile_ms_all": [c * 1e3 for c in compile_s]}
    for batch, parallel in ((1, False), (32, False), (32, True)):
        mask = torch.zeros(batch, words, dtype=torch.int32)
        per_step = []
        for _ in range(rounds):
            ms = engine.matchers(compiled, batch)
            seqs = docs[:batch]
            steps = max(len(s) for s in seqs)
            for j in range(steps):
                live = [i for i, s in enumerate(seqs) if j < len(s)]
                t = time.perf_counter()
                if parallel:
                    engine.fill_batch(ms, mask)
                else:
                    for i in live:
                        engine.fill(ms[i], mask, i)
                per_step.append((time.perf_counter() - t, len(live)))
                for i in live:
                    tok_id = seqs[i][j]
                    assert (int(mask[i, tok_id // 32]) >> (tok_id % 32)) & 1, "a valid token was masked"
                    engine.accept(ms[i], tok_id)
        key = f"batch{batch}" + ("_parallel" if parallel else "")
        step_us = [s * 1e6 for s, _ in per_step]
        result[key] = {"step_us_mean": statistics.fmean(step_us), "step_us_p50": statistics.median(step_us),
                       "step_us_p99": sorted(step_us)[int(0.99 * (len(step_us) - 1))],
                       "row_us_mean": sum(s for s, _ in per_step) * 1e6 / sum(n for _, n in per_step)}
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_grammar_engines", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    from model.loaders.checkpoint import default_model_path
    from model.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(args.model or default_model_path())
    report = {"machine": machine_info("cpu", torch.get_num_threads()), "schema_bytes": len(json.dumps(SCHEMA)), "engines": {}}
    for cls in (Llguidance, Xgrammar):
        try:
            report["engines"][cls.name] = measure(cls, tok, args.rounds)
        except ImportError as e:
            report["engines"][cls.name] = {"missing": str(e)}
    for name, r in report["engines"].items():
        if "missing" in r:
            print(f"{name}: not installed ({r['missing']})")
            continue
        print(f"{name}: tokenizer set-up {r['tokenizer_setup_ms']:.0f} ms, schema compile {r['compile_ms_median']:.1f} ms "
              f"(median of {args.rounds})")
        for key in ("batch1", "batch32", "batch32_parallel"):
            s = r[key]
            print(f"  {key:17s} step mean {s['step_us_mean']:8.1f} us  p50 {s['step_us_p50']:8.1f}  "
                  f"p99 {s['step_us_p99']:8.1f}  per row {s['row_us_mean']:6.1f} us")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
