"""Tensor parallelism on CPU (gloo, 2 processes) against the unsharded model on the same checkpoint: the shard plan,
per-rank sliced loading (HF and GGUF), forward logits, engine greedy tokens and logprobs (concurrent requests of
different lengths, an abort, forced preemption) and inspection, for KV heads split (K=2) and replicated (K=1)."""

from __future__ import annotations

import random

import pytest
import torch

from drafting import PerSequence
from hf_checkpoints import save_tiny_checkpoint, save_tiny_llama
from gguf_writer import write_tiny_gguf
from model.config import ModelConfig
from model.engine import Engine, EngineConfig, FatalEngineError, RequestOptions
from model.loaders.checkpoint import load_model
from model.loaders.errors import CheckpointError
from model.loaders.gguf_file import load_gguf
from model.loaders.hf import load_hf
from model.probes import ProbeOptions, ProbeRun
from model.engine.sampling_params import SamplingParams
from model.parallel.plan import ShardPlan, TPRank, allowed_sizes
from model.loaders.assemble import split_fused

VOCAB = 258  # the byte tokenizer's


# ---- the plan and the loaders (no processes) ------------------------------------------------------------------


def test_plan_splits_heads_and_replicates_kv_heads_when_needed():
    c = ModelConfig(vocab_size=10, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=96)
    p = [ShardPlan(c, TPRank(r, 2)) for r in range(2)]
    assert [x.q_heads for x in p] == [(0, 2), (2, 4)] and [x.kv_heads for x in p] == [(0, 1), (1, 2)]
    assert p[1].slice_of("layers.0.attention.wo.weight") == (1, 32, 64) and p[1].kv_replicas == 1
    assert p[0].slice_of("layers.0.feed_forward.w2.weight") == (1, 0, 48) and p[0].slice_of("norm.weight") is None
    mqa = c.replace(n_kv_heads=1)
    assert [ShardPlan(mqa, TPRank(r, 2)).kv_heads for r in range(2)] == [(0, 1), (0, 1)]  # one head, two copies
    smol = c.replace(dim=576, n_heads=9, n_kv_heads=3, head_dim=64, rope_dim=64)  # SmolLM2-135M's heads
    assert allowed_sizes(smol) == [1, 3, 9]
    assert [ShardPlan(smol, TPRank(r, 9)).kv_heads for r in (0, 2, 3, 8)] == [(0, 1), (0, 1), (1, 2), (2, 3)]
    with pytest.raises(CheckpointError, match=r"allows \[1, 3, 9\]"):
        ShardPlan(smol, TPRank(0, 2))
    assert ShardPlan(c, TPRank(0, 2)).local_heads([0, 3]) == [0] and ShardPlan(c, TPRank(1, 2)).local_heads([0, 3]) == [1]


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_each_rank_loads_exactly_its_slices(tmp_path, fmt):
    """Sharded loads equal the slices of the full load, K/V heads replicated for MQA; GGUF mixes F32 and Q8_0 (row
    slices are cut from the quantized blocks, column slices from the dequantized tensor)."""
    hf = save_tiny_llama(tmp_path / "hf", num_attention_heads=4, num_key_value_heads=1)
    if fmt == "gguf":
        from gguf import GGMLQuantizationType as Q

        write_tiny_gguf(tmp_path / "m.gguf", hf, qtype_for=lambda n, w: Q.Q8_0 if "ffn" in n or "attn_q" in n else Q.F32)
        load = lambda tp=None: load_gguf(tmp_path / "m.gguf", shard=tp and tp.plan)  # noqa: E731
    else:
        load = lambda tp=None: load_hf(tmp_path / "hf", shard=tp and tp.plan)  # noqa: E731
    full = load()
    whole = split_fused(full.state_dict(), full.config)
    for r in range(2):
        shard = load(TPRank(r, 2))
        plan = shard.tp_plan
        for name, t in split_fused(shard.state_dict(), shard.config).items():
            assert torch.equal(t, plan.take(name, whole[name])), (r, name)
        assert shard.config.n_heads == 2 and shard.config.n_kv_heads == 1 and shard.config.hidden_dim == 48


# ---- two processes ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 1], ids=["kv-split", "kv-replicated"])
def tp_pair(request, tmp_path_factory):
    """(TP=1 model, TP=2 model) on one checkpoint with n_kv_heads = the param; the TP group lives for the module."""
    from model.parallel.rank0 import launch

    path = save_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "ck", num_key_value_heads=request.param)
    one = load_model(path)
    two = launch(path, 2, timeout=__import__("datetime").timedelta(seconds=120))
    yield one, two
    two.model.close()


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def test_forward_logits_equal(tp_pair):
    one, two = tp_pair
    tokens = torch.tensor(_prompts(1, 0) * 2)[:, :24]  # (2, T)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens) + torch.tensor([[0], [5]])  # second row offset
    with torch.inference_mode():
        a, b = one.model(tokens, positions), two.model(tokens, positions)
    diff, scale = (a - b).abs().max().item(), a.abs().max().item()
    print(f"max |logit(TP=2) - logit(TP=1)| = {diff:.2e} (max |logit| {scale:.1f})")
    assert diff <= 1e-5 * max(1.0, scale), diff


def _serve(model, tok, prompts, config: EngineConfig, abort_at: dict[str, int]) -> tuple[dict, Engine]:
    """Drive an Engine to the end: prompt i arrives at step 2i, requests in `abort_at` are aborted at that step."""
    engine = Engine(model, tok, config)
    out: dict[str, dict] = {}
    step = 0
    pending = {str(i): p for i, p in enumerate(prompts)}
    while pending or engine.has_unfinished():
        for rid in [r for r in pending if 2 * int(r) <= step]:
            engine.add_request(rid, pending.pop(rid), SamplingParams(max_tokens=12, temperature=0, logprobs=2,
                                                                     prompt_logprobs=1, ignore_eos=True))
        outs = [o for rid, at in abort_at.items() if at == step for o in engine.abort(rid)] + engine.step()
        for o in outs:
            r = out.setdefault(o.request_id, {"tokens": [], "lp": [], "prompt_lp": None, "finish": None})
            r["tokens"] += o.token_ids
            r["lp"] += [lp.logprob for lp in o.logprobs or []] + [v for lp in o.logprobs or [] for _, v in lp.top]
            r["prompt_lp"] = r["prompt_lp"] or [lp.logprob for lp in o.prompt_logprobs or [] if lp is not None]
            r["finish"] = o.finish_reason or r["finish"]
        step += 1
    return out, engine


@pytest.mark.parametrize("kv", ["auto", "float16", "int8"])
def test_engine_greedy_tokens_and_logprobs_equal(tp_pair, kv):
    """Eight concurrent requests of 3-39 prompt tokens arriving over time, one aborted mid-generation, on a block pool
    small enough to force preemptions: same tokens, finish reasons and logprobs (<= 1e-4) with TP=2; every rank's
    pool a float16 one too when asked (<= 1e-3: a key's last-bit difference between the two splits can round to
    another float16), or an int8 one (<= 1e-2: such a difference can move a quant by one step, 1/127 of its row's
    largest entry)."""
    one, two = tp_pair
    prompts = _prompts(8, 1)
    config = EngineConfig(num_blocks=30, block_size=4, max_num_batched_tokens=32, max_num_seqs=6, kv_cache_dtype=kv)
    ref, e1 = _serve(one.model, one.tokenizer, prompts, config, {"3": 9})
    got, e2 = _serve(two.model, two.tokenizer, prompts, config, {"3": 9})
    assert e1.scheduler.num_preemptions > 0 and e2.scheduler.num_preemptions == e1.scheduler.num_preemptions
    assert ref["3"]["finish"] == "abort" and 0 < len(ref["3"]["tokens"]) < 12
    assert e2.cache.k.shape[3] == two.model.kv_config.n_kv_heads  # the pool holds this rank's KV heads only
    worst = 0.0
    for rid, r in ref.items():
        g = got[rid]
        assert (g["tokens"], g["finish"]) == (r["tokens"], r["finish"]), rid
        for x, y in ((r["lp"], g["lp"]), (r["prompt_lp"] or [], g["prompt_lp"] or [])):
            assert len(x) == len(y)
            worst = max([worst] + [abs(a - b) for a, b in zip(x, y)])
    assert e2.cache.k.dtype == {"float16": torch.float16, "int8": torch.int8}.get(kv, torch.float32)
    assert worst <= {"float16": 1e-3, "int8": 1e-2}.get(kv, 1e-4), worst
    print(f"max |logprob(TP=2) - logprob(TP=1)| = {worst:.2e}")


@pytest.mark.parametrize("mode", ["full", "topk"])
def test_inspection_gathers_heads_from_their_ranks(tp_pair, mode):
    """Selected heads on both ranks (and, for K=1, the one replicated KV head): maps, sink mass, entropy and the
    KV-group labels equal TP=1's; massive activations and the logit lens come from the replicated residual."""
    one, two = tp_pair
    ids = _prompts(1, 7)[0][:20]
    opts = dict(layers=[0, 1], heads=[1, 2, 3], mode=mode, attention_top_k=4)
    a = ProbeRun(one.model, ids, ProbeOptions(**opts)).run()
    b = ProbeRun(two.model, ids, ProbeOptions(**opts)).run()
    assert (a.heads, a.kv_groups) == (b.heads, b.kv_groups)
    for la, lb in zip(a.layers, b.layers):
        assert (la.maps.values - lb.maps.values).abs().max().item() <= 1e-4
        if mode == "topk":
            assert torch.equal(la.maps.indices, lb.maps.indices)
        for ha, hb in zip(la.heads, lb.heads):
            assert ha.head == hb.head and ha.kv_group == hb.kv_group
            assert abs(ha.sink_mass - hb.sink_mass) <= 1e-5 and abs(ha.entropy - hb.entropy) <= 1e-4
        assert la.max_abs == pytest.approx(lb.max_abs, rel=1e-5)
        assert [e.token_ids for e in la.lens] == [e.token_ids for e in lb.lens]
    assert a.sink_mass_by_layer == pytest.approx(b.sink_mass_by_layer, abs=1e-5)


def _edits(dim: int, seed: int) -> list:
    from model.interventions import Intervention

    g = torch.Generator().manual_seed(seed)
    v = torch.randn(dim, generator=g)
    return [Intervention(0, "attention_output", "add", "all", v * 2.0),
            Intervention(1, "block_output", "set", (0, 2), dims=(3, 9), values=(5.0, -5.0)),
            Intervention(1, "mlp_output", "project_out", "generated", torch.randn(dim, generator=g))]


def test_interventions_apply_once_after_the_all_reduce(tp_pair):
    """Requests with and without interventions in the same steps: TP=2 gives TP=1's tokens and logprobs (each rank
    edits the replicated residual stream once), and an inspection under the same edits the same statistics."""
    one, two = tp_pair
    prompts = _prompts(4, 3)
    config = EngineConfig(num_blocks=40, block_size=4, max_num_batched_tokens=24, max_num_seqs=4)
    results = []
    for model in (one.model, two.model):
        engine = Engine(model, one.tokenizer, config)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True),
                               RequestOptions(interventions=_edits(model.config.dim, i) if i % 2 == 0 else None))
        out: dict[str, list] = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend((t, lp.logprob) for t, lp in zip(o.token_ids, o.logprobs))
        results.append(out)
    ref, got = results
    for rid in ref:
        assert [t for t, _ in got[rid]] == [t for t, _ in ref[rid]], rid
        assert [lp for _, lp in got[rid]] == pytest.approx([lp for _, lp in ref[rid]], abs=1e-4)
    plain = Engine(one.model, one.tokenizer, config)
    plain.add_request("0", prompts[0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    tokens = []
    while plain.has_unfinished():
        tokens += [t for o in plain.step() for t in o.token_ids]
    assert tokens != [t for t, _ in ref["0"]]  # the edits changed the answer
    ids = _prompts(1, 11)[0][:16]
    opts = dict(layers=[0, 1], heads=[0, 3], mode="none")
    a = ProbeRun(one.model, ids, ProbeOptions(**opts), _edits(one.model.config.dim, 5)).run()
    b = ProbeRun(two.model, ids, ProbeOptions(**opts), _edits(one.model.config.dim, 5)).run()
    c = ProbeRun(one.model, ids, ProbeOptions(**opts)).run()
    assert a.sink_mass_by_layer == pytest.approx(b.sink_mass_by_layer, abs=1e-5)
    assert [l.max_abs for l in a.layers] == pytest.approx([l.max_abs for l in b.layers], rel=1e-5)
    assert a.sink_mass_by_layer != pytest.approx(c.sink_mass_by_layer, abs=1e-3)


def test_lora_adapters_under_tensor_parallelism(tp_pair):
    """Rows of the base and two LoRA adapters (one on every projection) in shared steps: each rank serves its share of
    an adapter (`ShardPlan.shard_adapter`: B's output columns of its q/k/v heads and FFN slice; A's input columns of
    its heads and FFN slice for wo and w2, x A^T all-reduced), and TP=2 gives TP=1's tokens and logprobs (<= 1e-4).
    An adapter removed and loaded again under its name with other weights: every rank serves the new one."""
    from test_lora_engine import random_adapter

    one, two = tp_pair
    c = one.model.config
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def adapters(seed: int):
        return [random_adapter("a", c, 4, seed, sites=every),
                random_adapter("b", c, 8, seed + 1, sites=("k_proj", "o_proj", "down_proj"))]

    prompts = _prompts(5, 7)
    jobs = [(None, prompts[0]), ("a", prompts[1]), ("b", prompts[2]), ("a", prompts[3]), ("b", prompts[4])]

    def serve(engine) -> dict[str, list]:
        for i, (lora, p) in enumerate(jobs):
            engine.add_request(f"{lora}-{i}", p, SamplingParams(max_tokens=6, temperature=0, logprobs=2,
                                                                ignore_eos=True), RequestOptions(lora=lora))
        out: dict[str, list] = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend((t, lp.logprob) for t, lp in zip(o.token_ids, o.logprobs))
        return out

    config = EngineConfig(num_blocks=60, block_size=4, max_num_batched_tokens=32, max_num_seqs=5)
    results = []
    for model in (one.model, two.model):
        engine = Engine(model, one.tokenizer, config)
        for a in adapters(10):
            engine.feature("lora").add(a)
        first = serve(engine)
        engine.feature("lora").remove("a")
        engine.feature("lora").add(adapters(20)[0])
        results.append((first, serve(engine)))
    for ref, got in zip(*results):
        for rid in ref:
            assert [t for t, _ in got[rid]] == [t for t, _ in ref[rid]], rid
            assert [lp for _, lp in got[rid]] == pytest.approx([lp for _, lp in ref[rid]], abs=1e-4)
    (before, after), _ = results
    assert before["None-0"] == after["None-0"] and before["a-1"] != after["a-1"]  # the base's unchanged, "a" new


def test_rows_of_several_tokens_under_tensor_parallelism(tp_pair):
    """Drafted rows (the engine's `drafter`: 1 + 2 or 4 tokens a step, half of them rejected and rolled back) on the
    TP=2 engine: every rank computes the same rows from the step's slices, and the tokens and logprobs are those of
    decoding one token at a time on the same engine."""
    _, two = tp_pair
    prompts = _prompts(3, 5)
    config = EngineConfig(num_blocks=48, block_size=4, max_num_batched_tokens=24, max_num_seqs=4)

    def serve(drafter=None) -> dict[str, list]:
        engine = Engine(two.model, two.tokenizer, config)
        engine.drafter = PerSequence(drafter) if drafter is not None else None
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True))
        out: dict[str, list] = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend((t, lp.logprob, lp.top) for t, lp in zip(o.token_ids, o.logprobs))
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        return out

    ref = serve()
    calls = [0]

    def drafter(seq) -> list[int]:  # the true continuation, every other time with its second half wrong
        calls[0] += 1
        n = len(seq.output_token_ids)
        right = [t for t, _, _ in ref[seq.request.request_id][n : n + 4]]
        return right if calls[0] % 2 else right[:2] + [(t + 1) % 256 for t in right[2:]]

    assert serve(drafter) == ref and calls[0] > 3


def test_ngram_speculation_under_tensor_parallelism(tp_pair):
    """--speculative-config's n-gram method on the TP=2 engine (a draft model is refused there): greedy tokens and
    logprobs equal to the same engine without speculation, with drafts verified and accepted."""
    from model.engine import SpeculativeConfig

    _, two = tp_pair
    prompts = [(p * 3)[:14] for p in _prompts(3, 5)]  # repeated phrases: their n-grams recur
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})

    def serve(speculative) -> tuple[dict, Engine]:
        engine = Engine(two.model, two.tokenizer, EngineConfig(num_blocks=48, block_size=4, max_num_seqs=4,
                                                               speculative=speculative))
        if speculative is not None:
            engine.drafter.row_cost = 0.0  # draft whatever is found
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True))
        out: dict = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend((t, lp.logprob, lp.top) for t, lp in zip(o.token_ids, o.logprobs))
        return out, engine

    ref, _ = serve(None)
    got, engine = serve(spec)
    assert got == ref and engine.stats().spec_decode.num_drafts > 0


def test_lost_worker_makes_the_next_step_fatal(tp_pair):
    """Runs last for each group: a killed worker makes the next step fail at once (no hang) with FatalEngineError,
    which ends the engine (the service then fails its clients and exits to be restarted: a group with a lost rank
    cannot serve again), and closing the group still returns."""
    _, two = tp_pair
    engine = Engine(two.model, two.tokenizer, EngineConfig(num_blocks=16, block_size=4))
    two.model.workers[0].kill()
    two.model.workers[0].wait()
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    try:
        with pytest.raises(FatalEngineError, match="rank 1 exited"):
            engine.step()
    finally:
        two.model.close(timeout=5)


def test_worker_imports_no_http_stack():
    import subprocess
    import sys

    code = "import sys, model.parallel.worker; print(sorted(m for m in ('fastapi', 'uvicorn', 'pydantic') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
