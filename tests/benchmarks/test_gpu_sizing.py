"""The GPU benchmark's engines (benchmarks/gpu.py, sized by benchmarks/gpu_sizing.py) for the real model shapes,
built on the meta device (nothing allocated): every engine a GPU run would build holds its workload. Before this, the
7B-shaped eager engine got a fixed 64 MiB pool, 8 blocks of 8 MiB = 128 tokens, and its 256-token single stream
failed in add_request on the GPU, after minutes of measuring."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu, ours
from benchmarks.gpu_sizing import check, meta_model, plan_engines, preflight, stand_in_tokenizer
from model.config import KNOWN_SHAPES
from model.engine import Engine, EngineConfig
from tiny import byte_tokenizer, tiny_model

META = torch.device("meta")
# The run as prepared, and the variations its flags allow
CONFIGURATIONS = {
    "default": [],
    "no-graphs": ["--no-graphs"],
    "two-levels": ["--concurrency", "1", "64"],
    "long": ["--prompt-len", "1000", "--new-tokens", "500", "--concurrency", "1", "16"],
}


@pytest.fixture(scope="module")
def models():
    return {name: meta_model(KNOWN_SHAPES[name], torch.bfloat16) for name in ("llama-2-7b", "smollm2-135m")}


def blocks_of(tokens: int, block_size: int = 16) -> int:
    return -(-tokens // block_size)


@pytest.mark.parametrize("argv", CONFIGURATIONS.values(), ids=CONFIGURATIONS.keys())
def test_every_engine_of_the_gpu_run_holds_its_workload(argv, models):
    args = gpu.parse_args(["--device", "cuda", *argv])
    plans = gpu.engine_plans(args)
    assert [p.role for p in plans] == (["served"] if args.no_graphs else ["served", "eager"])
    request = blocks_of(args.prompt_len + args.new_tokens)
    for model in models.values():
        for plan in plans:
            engine = Engine(model, stand_in_tokenizer(model.config.vocab_size), plan.engine_config(META))
            assert engine.cache.k.device == META  # the real shape, no storage
            assert check(plan, engine) == [], plan.role
            # independently of the plan's arithmetic: the longest request fits, and the served engine holds every
            # request of the largest concurrency level at once (no preemption inside the timed runs)
            assert engine.kv.num_blocks >= request
            if plan.role == "served":
                assert engine.kv.num_blocks >= max(args.concurrency) * request
                assert engine.config.max_num_seqs == max(args.concurrency)


def test_the_7b_eager_engine_sized_as_before_is_caught(models):
    """The old fixed 64 MiB pool for the eager comparison engine: `check` names the phase it cannot run."""
    model = models["llama-2-7b"]
    eager = next(p for p in gpu.engine_plans(gpu.parse_args(["--device", "cuda"])) if p.role == "eager")
    old = Engine(model, stand_in_tokenizer(32000), EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=1, decode_graphs="off"))
    assert old.kv.num_blocks == 8  # 16-token blocks of 32 layers x 32 KV heads x 128 x 2 (K, V) x 2 bytes = 8 MiB
    problems = check(eager, old)
    assert any("phase single" in p and "add_request refuses 128 + 128" in p for p in problems), problems
    new = Engine(model, stand_in_tokenizer(32000), eager.engine_config(META))
    assert new.kv.num_blocks == 16 and check(eager, new) == []


def test_preflight_records_each_shape_and_enforces_the_cap():
    args = gpu.parse_args(["--device", "cuda"])
    shapes = {"llama-2-7b": KNOWN_SHAPES["llama-2-7b"]}
    record, problems = preflight(shapes, torch.bfloat16, gpu.engine_plans(args), 24 << 30)
    assert problems == [] and [e["role"] for e in record["llama-2-7b"]] == ["served", "eager"]
    served = record["llama-2-7b"][0]
    assert served["num_blocks"] == 128 * 16 and served["kv_mib"] == 128 * 16 * 8  # 16 GiB for 128 x 256 tokens
    _, problems = preflight(shapes, torch.bfloat16, gpu.engine_plans(args), 8 << 30)
    assert len(problems) == 1 and "over the 8 GiB cap" in problems[0]


def test_a_pool_sized_exactly_runs_every_phase_without_preemption():
    """The plan's arithmetic against a real (tiny, CPU) engine: the largest concurrency level runs with no
    preemption and nothing left over, so the sizing is neither short nor padded."""
    model, prompt_len, new_tokens = tiny_model(), 21, 11  # 32 tokens: 2 blocks of 16 per request
    plan = plan_engines(prompt_len, new_tokens, [1, 6], compare_tokens=4, decode_graphs=False)[0]
    engine = Engine(model, byte_tokenizer(), plan.engine_config(torch.device("cpu")))
    assert engine.kv.num_blocks == 12 and check(plan, engine) == []
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (6, prompt_len), generator=g).tolist()
    res = ours.run_concurrent(engine, prompts, new_tokens, gpu.Clock(torch.device("cpu")))
    assert res.notes["preemptions"] == 0 and res.notes["peak_kv_usage"] == 1.0
    assert all(len(t) == new_tokens for t in res.token_ids)
