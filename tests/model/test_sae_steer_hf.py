"""Steering by feature against HF transformers on the same weights (float32): `add` of a feature (scale x its
decoder row at the dictionary's site) and `clamp` (its activation held at a value, x += decode(f with f_F = v) -
decode(f), Templeton et al. 2024) equal a forward hook on the HF module whose output is the dictionary's site doing
the same with the dictionary's own `encode` and `decode` (logits <= 1e-4), for relu, jumprelu, topk, groupmax and
gated dictionaries, with and without input normalization and `apply_b_dec_to_input`, at block, attention and MLP
outputs; and greedy generation through the engine under a clamp of the generated positions follows HF."""

from __future__ import annotations

import pytest
import torch

from hf_checkpoints import save_tiny_llama
from model.edits import EditTables, Segment
from model.engine import Engine, EngineConfig, RequestOptions
from model.engine.forward_context import ForwardContext
from model.engine.paged_cache import PagedKVCache, SeqSlice
from model.engine.sampling_params import SamplingParams
from model.features.sae import FeatureClamp
from model.interventions import Intervention, InterventionPlan
from model.loaders.hf import load_hf
from random_dictionaries import random_dictionary, sometimes_active
from tiny import byte_tokenizer

IDS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 53, 58]


@pytest.fixture(scope="module")
def ours_and_hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf-steer")
    hf = save_tiny_llama(d, num_hidden_layers=3)
    return load_hf(d), hf


def _module(hf, layer: int, site: str):
    block = hf.model.layers[layer]
    return {"block_output": block, "attention_output": block.self_attn, "mlp_output": block.mlp}[site]


def hf_site(hf, layer: int, site: str, ids: list[int]) -> torch.Tensor:
    """HF's activation at (layer, site) on ids -> (T, D)."""
    seen = {}

    def grab(mod, args, out):
        seen["x"] = (out[0] if isinstance(out, tuple) else out)[0].detach().clone()

    handle = _module(hf, layer, site).register_forward_hook(grab)
    try:
        with torch.inference_mode():
            hf(torch.tensor([ids]))
    finally:
        handle.remove()
    return seen["x"]


def hf_steered(hf, it: Intervention, d, feature: int, ids: list[int], P: int) -> torch.Tensor:
    """HF's logits (T, V) with the feature edit done by a forward hook at the dictionary's site, from the
    definition: add: x + scale d_F; clamp: x + decode(f with f_F = v, x) - decode(f, x), f = encode(x)."""
    def edit(h):  # (1, T, D)
        h = h.clone()
        rows = [t for t in range(h.shape[1]) if it.applies(t, P)]
        x = h[0, rows]
        if it.op == "add":
            h[0, rows] = x + it.scale * d.W_dec[feature]
        else:
            f = d.encode(x)
            f2 = f.clone()
            f2[:, feature] = it.clamp.value
            h[0, rows] = x + d.decode(f2, x) - d.decode(f, x)
        return h

    def hook(mod, args, out):
        return (edit(out[0]),) + tuple(out[1:]) if isinstance(out, tuple) else edit(out)

    handle = _module(hf, it.layer, it.site).register_forward_hook(hook)
    try:
        with torch.inference_mode():
            return hf(torch.tensor([ids])).logits[0]
    finally:
        handle.remove()


def our_logits(model, ids: list[int], items: list[Intervention]) -> torch.Tensor:
    """Our module path over a paged cache, with the step's edits table -> (T, V)."""
    T, bs = len(ids), 16
    cache = PagedKVCache.for_model(model, num_blocks=-(-T // bs), block_size=bs)
    plan = InterventionPlan(items, T, model.config.n_layers, model.config.dim)
    edits, _ = EditTables(model.config.n_layers, model.config.dim, model.device,
                          model.config.norm_eps).build([Segment(0, 0, T, plan)])
    ctx = ForwardContext.from_slices(cache, [SeqSlice(0, T, T, list(range(-(-T // bs))))], edits)
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(T)[None], ctx)[0]


# name -> (dictionary options, op, value or scale, positions)
CASES = {
    "add relu": (dict(activation="relu"), "add", 4.0, "all"),
    "clamp relu": (dict(activation="relu"), "clamp", 6.0, "all"),
    "clamp relu to zero (ablation)": (dict(activation="relu", seed=1), "clamp", 0.0, (2, 5, 6, 9, 13)),
    "clamp jumprelu, b_dec in, norm rescale": (dict(activation="jumprelu", apply_b_dec=True,
                                                    normalize="constant_norm_rescale"), "clamp", 5.0, "all"),
    "clamp jumprelu @mlp_output": (dict(activation="jumprelu", layer=0, site="mlp_output", seed=2), "clamp", -3.0,
                                   "all"),
    "clamp topk": (dict(activation="topk", k=4, seed=3), "clamp", 5.0, "all"),
    "clamp topk @attention_output, layer_norm": (dict(activation="topk", k=6, layer=2, site="attention_output",
                                                      normalize="layer_norm", seed=4), "clamp", 4.0, (1, 4, 8)),
    "clamp groupmax": (dict(activation="groupmax", k=6, seed=5), "clamp", 5.0, "all"),
    "clamp gated, b_dec in": (dict(activation="gated", apply_b_dec=True, seed=6), "clamp", 5.0, "all"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_feature_edit_equals_a_hooked_hf_forward(ours_and_hf, case):
    ours, hf = ours_and_hf
    opts, op, amount, positions = CASES[case]
    layer, site = opts.get("layer", 1), opts.get("site", "block_output")
    x = hf_site(hf, layer, site, IDS)
    d = random_dictionary(**opts, input_scale=float(x.norm(dim=-1).mean()))
    F = sometimes_active(d, x)
    if op == "add":
        it = Intervention(layer, site, "add", positions, d.W_dec[F].clone(), scale=amount)
    else:
        it = Intervention(layer, site, "clamp", positions, clamp=FeatureClamp(d, F, amount))
    ref = hf_steered(hf, it, d, F, IDS, len(IDS))
    got = our_logits(ours, IDS, [it])
    with torch.inference_mode():
        plain = hf(torch.tensor([IDS])).logits[0]
    print(f"{case}: feature {F}, max |ours - HF| {(got - ref).abs().max():.2e}, moved {(ref - plain).abs().max():.2f}")
    assert (got - ref).abs().max().item() <= 1e-4
    assert (ref - plain).abs().max().item() > 1e-2  # the edit changes the logits, so the equality means something


def test_engine_generation_under_a_clamp_follows_hf(ours_and_hf):
    """Greedy decoding through the engine (the fused native step) with a topk clamp on the generated positions: HF's
    tokens under the same hook, and the same generated logprobs (<= 1e-4)."""
    ours, hf = ours_and_hf
    prompt = [7, 1, 44, 9, 12, 80, 5]
    x = hf_site(hf, 1, "block_output", IDS)
    d = random_dictionary("topk", k=4, seed=3, input_scale=float(x.norm(dim=-1).mean()))
    F = sometimes_active(d, x)
    it = Intervention(1, "block_output", "clamp", "generated", clamp=FeatureClamp(d, F, 8.0))
    engine = Engine(ours, byte_tokenizer(), EngineConfig(num_blocks=16, block_size=4))
    engine.add_request("r", prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0),
                       RequestOptions(interventions=[it]))
    tokens, lps = [], []
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.token_ids
            lps += [lp.logprob for lp in o.logprobs or []]
    seq = prompt + tokens
    P = len(prompt)
    it_hf = Intervention(1, "block_output", "clamp", tuple(range(P, len(seq))), clamp=it.clamp)
    ref = hf_steered(hf, it_hf, d, F, seq, len(seq)).log_softmax(-1)
    assert tokens == ref[P - 1 : -1].argmax(-1).tolist()
    want = ref[torch.arange(P - 1, len(seq) - 1), torch.tensor(seq[P:])]
    assert lps == pytest.approx(want.tolist(), abs=1e-4)
    # the TopK clamp's decode steps in the fused native step (its selection from the encoders the table names)
    from model import kernels

    if kernels.native() is not None:
        assert engine.runner.path_counts["module"] == 0 and engine.runner.path_counts["native"] > 0
