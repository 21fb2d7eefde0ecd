"""Tensor parallelism (gloo, 2 processes) for the families: Qwen2's biases sliced with their rows, Qwen3's per-head
q/k norms replicated, Mistral's window, Phi-3's fused qkv / gate_up split into their parts' slices at load, Granite's
multipliers; each rank's load equal to the slices of the full load (HF and GGUF), TP=2 giving TP=1's greedy tokens
and logprobs through preemptions, and its inspection statistics. OLMo-2's q/k norm over every head is refused."""

from __future__ import annotations

import datetime

import pytest
import torch

from gguf_writer import write_tiny_gguf
from hf_checkpoints import save_tiny_family, save_tiny_family_checkpoint
from model.engine import EngineConfig
from model.loaders.assemble import split_fused
from model.loaders.checkpoint import load_model
from model.loaders.errors import CheckpointError
from model.loaders.gguf_file import load_gguf
from model.loaders.hf import load_hf
from model.parallel.plan import ShardPlan, TPRank
from model.probes import ProbeOptions, ProbeRun
from test_tensor_parallel import _prompts, _serve

TP_FAMILIES = ["qwen2", "qwen3", "mistral", "phi3", "granite"]


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("family", TP_FAMILIES)
def test_each_rank_loads_exactly_its_slices(tmp_path, family, fmt):
    hf = save_tiny_family(tmp_path / "hf", family)
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
        got = split_fused(shard.state_dict(), shard.config)
        assert got.keys() == whole.keys()
        for name, t in got.items():
            assert torch.equal(t, plan.take(name, whole[name])), (r, name)
    if family == "qwen2":
        assert plan.slice_of("layers.0.attention.bk") == (0, 16, 32)  # rank 1's KV head's rows of the bias
    if family == "qwen3":
        assert plan.slice_of("layers.0.attention.q_norm.weight") is None  # one (E,) gain for every head


def test_a_norm_over_every_head_is_refused():
    from tiny import tiny_family

    c = tiny_family("olmo2").config
    with pytest.raises(CheckpointError, match=r"tensor parallelism is not supported for .*q/k norm spans every head"):
        ShardPlan(c, TPRank(0, 2))
    ShardPlan(c, TPRank(0, 1))  # one rank: nothing to split


@pytest.fixture(scope="module", params=TP_FAMILIES)
def tp_family(request, tmp_path_factory):
    """(family, TP=1 model, TP=2 model) on one checkpoint; the TP group lives for the module."""
    from model.parallel.rank0 import launch

    path = save_tiny_family_checkpoint(tmp_path_factory.mktemp(request.param) / "ck", request.param)
    one = load_model(path)
    two = launch(path, 2, timeout=datetime.timedelta(seconds=120))
    yield request.param, one, two
    two.model.close()


def test_tp2_gives_tp1s_logits_tokens_and_logprobs(tp_family):
    family, one, two = tp_family
    tokens = torch.tensor(_prompts(1, 0) * 2)[:, :24]
    with torch.inference_mode():
        a, b = one.model(tokens), two.model(tokens)
    assert (a - b).abs().max().item() <= 1e-5 * max(1.0, a.abs().max().item())
    # (Mistral's window gives blocks back as sequences slide: a smaller pool to preempt)
    config = EngineConfig(num_blocks=14 if family == "mistral" else 30, block_size=4, max_num_batched_tokens=32,
                          max_num_seqs=6)
    ref, e1 = _serve(one.model, one.tokenizer, _prompts(8, 1), config, {})
    got, e2 = _serve(two.model, two.tokenizer, _prompts(8, 1), config, {})
    assert e1.scheduler.num_preemptions > 0
    worst = 0.0
    for rid, r in ref.items():
        assert got[rid]["tokens"] == r["tokens"], (family, rid)
        worst = max([worst] + [abs(x - y) for x, y in zip(r["lp"] + (r["prompt_lp"] or []),
                                                          got[rid]["lp"] + (got[rid]["prompt_lp"] or []))])
    assert worst <= 1e-4, (family, worst)


def test_inspection_under_tensor_parallelism(tp_family):
    _, one, two = tp_family
    ids = _prompts(1, 7)[0][:20]
    opts = dict(layers=[0, 1], heads=[1, 2, 3], mode="full")
    a = ProbeRun(one.model, ids, ProbeOptions(**opts)).run()
    b = ProbeRun(two.model, ids, ProbeOptions(**opts)).run()
    for la, lb in zip(a.layers, b.layers):
        assert (la.maps.values - lb.maps.values).abs().max().item() <= 1e-4
        assert la.max_abs == pytest.approx(lb.max_abs, rel=1e-5)
        assert [e.token_ids for e in la.lens] == [e.token_ids for e in lb.lens]
    assert a.sink_mass_by_layer == pytest.approx(b.sink_mass_by_layer, abs=1e-5)
