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
    assert_edits_follow_hooks(ours, hf, items, [h for it in items for h in hf_hook(hf, it)])


def assert_edits_follow_hooks(ours, hf, items, handles, name: str = "") -> None:
    """Our logits under `items` equal HF's with `handles` (its forward hooks doing the same) within 1e-4, and the
    edits move HF's logits (the hooks are removed once run)."""
    try:
        with torch.inference_mode():
            ref = hf(torch.tensor([IDS])).logits[0]
    finally:
        for h in handles:
            h.remove()
    got = our_logits(ours, IDS, items)
    with torch.inference_mode():
        plain = hf(torch.tensor([IDS])).logits[0]
    assert (got - ref).abs().max().item() <= 1e-4, name
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


def _hf_stream_hooks(name: str, hf, items: list[Intervention], seen: dict) -> list:
    """HF hooks doing `items` (a `set` at resid_mid, an `add` at mlp_input, every position) in each family's layout,
    and recording both sites into `seen` {(layer, site): (T, D)}. resid_mid is the stream after the attention's
    residual add: the attention output a of `residual + a` (times Granite's multiplier; OLMo-2's post-norm output)
    is replaced by the one that makes the sum the edited stream; mlp_input is the MLP's input (OLMo-2's has no norm
    before it: the stream itself)."""
    handles = []
    for l, layer in enumerate(hf.model.layers):
        mine = [it for it in items if it.layer == l]
        kept = {}
        handles.append(layer.register_forward_pre_hook(
            lambda m, a, kw, kept=kept: kept.__setitem__("h", a[0] if a else kw["hidden_states"]), with_kwargs=True))

        def edit(x, its):  # (1, T, D)
            x = x.clone()
            for it in its:
                if it.op == "set":
                    x[0, :, list(it.dims)] = torch.tensor(it.values)
                else:
                    x[0] += it.scale * it.vector
            return x

        mid = [it for it in mine if it.site == "resid_mid"]
        mult = getattr(layer, "residual_multiplier", 1.0)

        def stream(a, kept=kept, mid=mid, mult=mult):  # a as the add takes it -> (the edited stream - h), unscaled
            s = edit(kept["h"] + a * mult, mid) if mid else kept["h"] + a * mult
            return (s - kept["h"]) / mult

        module = layer.post_attention_layernorm if name == "olmo2" else layer.self_attn
        handles.append(module.register_forward_hook(
            lambda m, a, o, stream=stream: (stream(o[0]),) + tuple(o[1:]) if isinstance(o, tuple) else stream(o)))

        def mlp_in(m, a, l=l, mine=mine, kept=kept):
            if name == "olmo2":  # the MLP's input is the stream itself
                seen[(l, "resid_mid")] = a[0][0].float().clone()
            x = edit(a[0], [it for it in mine if it.site == "mlp_input"])
            seen[(l, "mlp_input")] = x[0].float().clone()
            return (x, *a[1:])
        handles.append(layer.mlp.register_forward_pre_hook(mlp_in))
        if name != "olmo2":
            handles.append(layer.post_attention_layernorm.register_forward_pre_hook(
                lambda m, a, l=l: seen.__setitem__((l, "resid_mid"), a[0][0].float().clone())))
    return handles


def test_stream_sites_follow_hf(family):
    """A set at block 0's resid_mid and an add at block 1's mlp_input in each family's layout: the module path's
    logits equal HF's with the same edits as hooks (1e-4), and the engine's reads of both sites (native step, the
    edits on) equal HF's tensors there (1e-5 of their scale)."""
    name, ours, hf = family
    v = torch.randn(ours.config.dim, generator=torch.Generator().manual_seed(2))
    items = [Intervention(0, "resid_mid", "set", "all", dims=(3, 40), values=(6.0, -5.0)),
             Intervention(1, "mlp_input", "add", "all", v / v.norm() * 3.0)]
    seen: dict = {}
    assert_edits_follow_hooks(ours, hf, items, _hf_stream_hooks(name, hf, items, seen), name)

    prompt = IDS[:14]
    engine = Engine(ours, byte_tokenizer(), EngineConfig(num_blocks=32, block_size=4, max_num_batched_tokens=8))
    engine.add_request("r", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                       RequestOptions(interventions=items,
                                      hidden_states=HiddenStateRead([0, 1], "all", ("resid_mid", "mlp_input"))))
    tokens, reads = [], []
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.token_ids
            reads += [o.hidden_states] if o.hidden_states is not None else []
    assert engine.runner.path_counts["native"] > 0
    seq = prompt + tokens
    seen.clear()
    handles = _hf_stream_hooks(name, hf, items, seen)
    try:
        with torch.inference_mode():
            hf(torch.tensor([seq[:-1]]))
    finally:
        for h in handles:
            h.remove()
    values = torch.cat([h.values for h in reads])  # (T - 1, 2 x 2, D)
    for j, key in enumerate((l, s) for l in (0, 1) for s in ("resid_mid", "mlp_input")):
        want = seen[key]
        assert ((values[:, j] - want).abs().max() / want.abs().max()).item() <= 1e-5, (name, key)
