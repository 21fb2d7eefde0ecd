"""The GPU benchmark's engines (benchmarks/gpu.py), each sized from the run's own token needs.

A fixed byte budget does not fit every model: 64 MiB holds 182 blocks of SmolLM2-135M's bfloat16 cache but 8 of a
Llama-2-7B's (a 16-token block is 2 (K, V) x 32 layers x 16 tokens x 32 KV heads x 128 x 2 bytes = 8 MiB), so a
256-token request fails in `Engine.add_request`. Each engine here gets exactly the blocks its workload needs:

- a request of P prompt + N new tokens holds ceil((P + N) / block_size) blocks by its end (the count
  `Engine.add_request` checks against the pool);
- a phase of n requests on an engine that admits max_num_seqs at once needs the blocks of its min(n, max_num_seqs)
  largest requests together; with fewer the scheduler preempts, and the timing would include recomputation;
- an engine's pool is its most demanding phase's blocks, `PagedKVCache.bytes_per_block` bytes each.

`check` holds an engine as built against its plan, asking the engine itself (`add_request`) to accept each phase's
longest request. `preflight` builds every engine of a run on the meta device (the real shapes, nothing allocated)
and checks it: `--dry-run` and tests/benchmarks/test_gpu_sizing.py do that for the 7B shape before a GPU ever sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.ours import WARM_UP_NEW_TOKENS, WARM_UP_PROMPT_LENS, greedy
from model.config import ModelConfig
from model.engine import Engine, EngineConfig
from model.engine.paged_cache import PagedKVCache, kv_config
from model.transformer import Transformer

BLOCK_SIZE = 16  # EngineConfig's default
MAX_NUM_BATCHED_TOKENS = 4096  # prefill chunk budget per step: 128 prompts of 128 tokens prefill in 4 steps


@dataclass(frozen=True)
class Phase:
    name: str
    prompt_lens: tuple[int, ...]  # one per request, all added at once
    new_tokens: int

    def request_blocks(self, block_size: int) -> list[int]:
        """Blocks each request holds at its end, largest first."""
        return sorted((-(-(p + self.new_tokens) // block_size) for p in self.prompt_lens), reverse=True)

    def blocks(self, max_num_seqs: int, block_size: int) -> int:
        """Blocks held at once when the engine runs up to max_num_seqs of these requests together."""
        return sum(self.request_blocks(block_size)[:max_num_seqs])


@dataclass(frozen=True)
class EnginePlan:
    role: str  # "served": decode graphs as the server runs; "eager": the same single stream without them
    decode_graphs: bool
    max_num_seqs: int
    phases: tuple[Phase, ...]
    block_size: int = BLOCK_SIZE

    @property
    def num_blocks(self) -> int:
        return max(p.blocks(self.max_num_seqs, self.block_size) for p in self.phases)

    def kv_bytes(self, model: torch.nn.Module) -> int:
        return self.num_blocks * PagedKVCache.bytes_per_block(kv_config(model), self.block_size, model.dtype)

    def engine_config(self, device: torch.device) -> EngineConfig:
        # On CPU (--dry-run) "eager": the static-buffer decode step without capture, so the dry run covers it too.
        # No prefix caching: the phases reuse prompts[0] (single stream, then every concurrency level), and a cache
        # would skip those prefills, which the static decoder and transformers never can.
        mode = ("auto" if device.type == "cuda" else "eager") if self.decode_graphs else "off"
        return EngineConfig(block_size=self.block_size, num_blocks=self.num_blocks, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, decode_graphs=mode,
                            enable_prefix_caching=False)


def plan_engines(prompt_len: int, new_tokens: int, concurrency: list[int], compare_tokens: int,
                 decode_graphs: bool) -> list[EnginePlan]:
    """The engines one model's benchmark builds, in order, with every phase each runs (benchmarks/gpu.py)."""
    warm = Phase("warm-up", WARM_UP_PROMPT_LENS, WARM_UP_NEW_TOKENS)  # benchmarks/ours.py's warm_up
    single = Phase("single", (prompt_len,), new_tokens)
    compare = Phase("logprobs", (prompt_len,), compare_tokens)  # benchmarks/agreement.py's run
    concurrent = tuple(Phase(f"c{b}", (prompt_len,) * b, new_tokens) for b in concurrency)
    plans = [EnginePlan("served", decode_graphs, max(concurrency), (warm, single, *concurrent, compare))]
    if decode_graphs:  # built only where the served engine did get graphs
        plans.append(EnginePlan("eager", False, 1, (warm, single, compare)))
    return plans


def check(plan: EnginePlan, engine: Engine) -> list[str]:
    """What in `plan` the built `engine` could not hold (empty: everything fits). Leaves the engine as it was."""
    problems, pool = [], engine.kv.num_blocks
    for phase in plan.phases:
        need = phase.blocks(min(plan.max_num_seqs, engine.config.max_num_seqs), plan.block_size)
        if need > pool:
            problems.append(f"{plan.role} engine, phase {phase.name}: needs {need} blocks at once, the pool has {pool}")
        longest = max(phase.prompt_lens)
        try:  # the engine's own admission check, on a request no step will run
            engine.add_request("sizing-check", [0] * longest, greedy(phase.new_tokens))
        except ValueError as e:
            problems.append(f"{plan.role} engine, phase {phase.name}: add_request refuses {longest} + "
                            f"{phase.new_tokens} tokens: {e}")
        else:
            engine.abort("sizing-check")
    return problems


def describe(plan: EnginePlan, engine: Engine) -> dict:
    """The plan as the results JSON records it."""
    per_block = engine.cache.nbytes / engine.cache.num_blocks
    return {"role": plan.role, "max_num_seqs": plan.max_num_seqs, "num_blocks": engine.kv.num_blocks,
            "block_size": plan.block_size, "kv_mib": engine.kv.num_blocks * per_block / 2**20,
            "blocks_needed": {p.name: p.blocks(plan.max_num_seqs, plan.block_size) for p in plan.phases}}


def stand_in_tokenizer(vocab: int):
    """A tokenizer for random models (the engine detokenizes every token): token i is the word "t<i>"."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    from model.text.tokenizer import Tokenizer

    backend = Backend(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    return Tokenizer(backend, bos_id=None, eos_id=0, stop_ids=set(), add_bos=False)


def meta_model(config: ModelConfig, dtype: torch.dtype) -> Transformer:
    """A model of `config`'s shape with no storage: engines built on it size and check their pools for free."""
    with torch.device("meta"):
        model = Transformer(config)
    return model.to(dtype)


def preflight(shapes: dict[str, ModelConfig], dtype: torch.dtype, plans: list[EnginePlan],
              kv_cap_bytes: int) -> tuple[dict, list[str]]:
    """Every engine of `plans` for every shape, built on the meta device and checked: (what the results JSON
    records per shape, the problems found). A pool over `kv_cap_bytes` is a problem too."""
    record, problems = {}, []
    for name, config in shapes.items():
        model, tokenizer = meta_model(config, dtype), stand_in_tokenizer(config.vocab_size)
        record[name] = []
        for plan in plans:
            engine = Engine(model, tokenizer, plan.engine_config(torch.device("meta")))
            found = [f"{name}: {p}" for p in check(plan, engine)]
            if plan.kv_bytes(model) > kv_cap_bytes:
                found.append(f"{name}: {plan.role} engine needs {plan.kv_bytes(model) / 2**30:.1f} GiB of KV cache, "
                             f"over the {kv_cap_bytes / 2**30:.0f} GiB cap (--kv-gb)")
            record[name].append({**describe(plan, engine), "ok": not found})
            problems += found
    return record, problems
