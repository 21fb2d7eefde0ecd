"""Inspection, interventions, hidden-state reads and attention telemetry on every family, against transformers on the
same weights: a Qwen2 bias, a Qwen3 or OLMo-2 q/k norm, Mistral's window, Granite's attention scale and multipliers
are not lost on the probe path (model/probes recomputes attention itself), nor on the engine's."""

from __future__ import annotations

import pytest
import torch

from hf_checkpoints import FAMILIES, save_tiny_family
from model.engine import Engine, EngineConfig, RequestOptions
from model.engine.sampling_params import SamplingParams
from model.features import TelemetryOptions
from model.interventions import HiddenStateRead, Intervention
from model.loaders.hf import load_hf
from model.probes import ProbeOptions, ProbeRun
from test_interventions_hf import hf_hidden, hf_hook, our_logits
from tiny import byte_tokenizer

IDS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]  # 20 tokens: past the window


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(family, ours, HF with eager attention so it returns its attention weights)."""
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp(request.param)
    save_tiny_family(d, request.param)
    hf = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
    return request.param, load_hf(d), hf


def test_attention_maps_hidden_states_and_lens_equal_hf(family):
    name, ours, hf = family
    with torch.no_grad():
        ref = hf(torch.tensor([IDS]), output_attentions=True)
    opts = ProbeOptions(mode="full", row_block=8, lens_positions=list(range(len(IDS))),
                        include=frozenset({"attention", "hidden_states", "logit_lens", "prediction"}))
    r = ProbeRun(ours, IDS, opts).run()
    for layer, hf_attn in zip(r.layers, ref.attentions):
        assert (layer.maps.values - hf_attn[0]).abs().max().item() < 1e-5, (name, layer.layer)
    if name == "mistral":  # the window: nothing before p - window + 1 is attended
        assert r.layers[0].maps.values[:, -1, : len(IDS) - 8].abs().max().item() == 0.0
    hidden = hf_hidden(hf, IDS)  # (T, L, D)
    for layer in r.layers:
        ref_l = hidden[:, layer.layer]
        assert ((layer.hidden - ref_l).abs().max() / ref_l.abs().max()).item() <= 1e-5
    probs = ref.logits[0].softmax(-1)  # the lens at the last block: the model's own distribution (Granite's scaling)
    for e in r.layers[-1].lens:
        assert e.token_ids[0] == probs[e.position].argmax().item()
        assert e.probs[0] == pytest.approx(probs[e.position].max().item(), rel=1e-4)
    assert r.prediction.next_token_probs[0] == pytest.approx(probs[-1].max().item(), rel=1e-4)


def test_a_steering_edit_equals_a_hooked_hf_forward(family):
    """An add at block 1's output on every position, and a set of three dims at block 0's: transformers with the same
    forward hooks on its decoder layers gives the same logits."""
    _, ours, hf = family
    g = torch.Generator().manual_seed(0)
    v = torch.randn(ours.config.dim, generator=g)
    items = [Intervention(1, "block_output", "add", "all", v / v.norm() * 4.0),
             Intervention(0, "block_output", "set", (0, 5), dims=(2, 17, 40), values=(0.0, 5.0, -3.0))]
    handles = [hf_hook(hf, it) for it in items]
    try:
        with torch.inference_mode():
            ref = hf(torch.tensor([IDS])).logits[0]
    finally:
        for h in handles:
            h.remove()
    got = our_logits(ours, IDS, items)
    with torch.inference_mode():
        plain = hf(torch.tensor([IDS])).logits[0]
    assert (got - ref).abs().max().item() <= 1e-4
    assert (ref - plain).abs().max().item() > 1e-2


def test_engine_reads_and_telemetry_follow_hf(family):
    """The engine (native step) reads every block's output where HF's output_hidden_states has it, and its attention
    telemetry (sink mass, top keys of each generated token) is what /inspect's maps give for that row."""
    name, ours, hf = family
    prompt = IDS[:14]
    engine = Engine(ours, byte_tokenizer(), EngineConfig(num_blocks=32, block_size=4, max_num_batched_tokens=8))
    engine.add_request("r", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                       RequestOptions(hidden_states=HiddenStateRead([0, 1], "all"),
                                      telemetry=TelemetryOptions(top_k=3)))
    tokens, reads, tel = [], [], []
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.token_ids
            reads += [o.hidden_states] if o.hidden_states is not None else []
            tel += [o.features.get("telemetry")] if o.features.get("telemetry") is not None else []
    seq = prompt + tokens
    ref = hf_hidden(hf, seq[:-1])
    got = torch.cat([h.values for h in reads])
    assert ((got - ref).abs().amax((0, 2)) / ref.abs().amax((0, 2))).max().item() <= 1e-5
    assert engine.runner.path_counts["native"] > 0
    # telemetry of the last generated token against the full map of the sequence that produced it
    maps = ProbeRun(ours, seq[:-1], ProbeOptions(mode="full", layers=[0, 1])).run()
    last = tel[-1]
    assert last.position == len(seq) - 2
    for layer in maps.layers:
        row = layer.maps.values[:, -1]  # (H, T): the last row's weights per head
        assert torch.allclose(last.sink_mass[layer.layer], row[:, 0], atol=1e-5), name
        assert torch.allclose(last.top_probs[layer.layer], row.topk(3).values, atol=1e-5), name
