"""Feature attribution on the served modules (model/probes/feature_attribution.py) against HF transformers on the
same random weights (float32, 1e-4), with random dictionaries at four hook points (the residual stream, the MLP's
and the attention's outputs, the heads before wo), one of them normalising its input: each feature's direct logit
contribution against the definition on HF's hook activation and HF's final norm; features + b_dec + error against
the site's own contribution; the gradient attribution patching reads against HF autograd through the whole model,
and every feature's estimate against the definition (HF's gradient, the dictionary's encode of HF's activations)."""

from __future__ import annotations

import pytest
import torch

from attribution_reference import attribution_patching as hf_attribution_patching
from attribution_reference import run as hf_run
from hf_checkpoints import save_tiny_llama
from model.features.sae import Dictionary
from model.hook_names import parse_hook
from model.loaders.hf import load_hf
from model.probes.feature_attribution import FeatureAttributionRun, FeatureDirectLogitRun, check_attributable

N_LAYERS = 3
CLEAN = [5, 17, 99, 3, 44, 81, 60, 7, 23, 90]
CORRUPTED = [5, 17, 98, 3, 44, 81, 61, 7, 23, 90]
ANSWER, CONTRAST = 10, 20
HOOKS = [  # (hook name, activation, normalize_activations)
    ("blocks.1.hook_resid_post", "topk", "none"),
    ("blocks.2.hook_mlp_out", "relu", "none"),
    ("blocks.0.hook_attn_out", "topk", "constant_norm_rescale"),
    ("blocks.1.attn.hook_z", "topk", "none"),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf-feature-attribution")
    hf = save_tiny_llama(d, num_hidden_layers=N_LAYERS)
    return load_hf(d), hf


def random_dictionary(name: str, activation: str, normalize: str, width: int = 64, d_sae: int = 96,
                      seed: int = 0) -> Dictionary:
    g = torch.Generator().manual_seed(seed)
    hook = parse_hook(name)
    return Dictionary(W_enc=torch.randn(width, d_sae, generator=g) / width ** 0.5,
                      b_enc=torch.randn(d_sae, generator=g) * 0.1 - (0.5 if activation == "relu" else 0.0),
                      W_dec=torch.randn(d_sae, width, generator=g) / width ** 0.5,
                      b_dec=torch.randn(width, generator=g) * 0.1, hook_in=hook, hook_out=hook, activation=activation,
                      k=12 if activation == "topk" else 0, apply_b_dec_to_input=True, normalize_activations=normalize)


def hf_site(hf, ids: list[int], d: Dictionary) -> torch.Tensor:
    """The dictionary's site on HF's forward (T, W) float64 (tests/attribution_reference.py's hooks)."""
    h = d.hook_in
    return hf_run(hf, ids, (h.site,), (h.layer,))["values"][(h.layer, h.site)].detach().double()


def decoder_scale(d: Dictionary, x: torch.Tensor) -> torch.Tensor:
    """What decode multiplies f W_dec by (T, 1): SAELens' constant_norm_rescale undoes x * sqrt(D) / |x|."""
    if d.normalize_activations == "constant_norm_rescale":
        return x.norm(dim=-1, keepdim=True) / d.d_in ** 0.5
    return torch.ones(x.shape[0], 1, dtype=x.dtype)


def hf_direction(hf, ids: list[int], d: Dictionary) -> torch.Tensor:
    """u_site: the logit difference's direction with the final norm's scale frozen, at the dictionary's site."""
    kept = {}
    handle = hf.model.norm.register_forward_pre_hook(lambda m, a: kept.__setitem__("x", a[0][0, -1]))
    with torch.no_grad():
        hf(torch.tensor([ids]))
    handle.remove()
    x = kept["x"].double()
    w = hf.lm_head.weight.detach().double()
    u = hf.model.norm.weight.detach().double() * torch.rsqrt(x.pow(2).mean() + hf.config.rms_norm_eps) * (w[ANSWER] - w[CONTRAST])
    if d.hook_in.site == "head_output":
        u = hf.model.layers[d.hook_in.layer].self_attn.o_proj.weight.detach().double().T @ u  # (H E,)
    return u


@pytest.mark.parametrize("name,activation,normalize", HOOKS)
def test_direct_logit_features_equal_the_definition_and_sum_to_the_site(pair, name, activation, normalize):
    ours, hf = pair
    d = random_dictionary(name, activation, normalize)
    job = FeatureDirectLogitRun(ours, CLEAN, ANSWER, CONTRAST, d).run()
    got = job.features
    x = hf_site(hf, CLEAN, d)[-1:]  # (1, W)
    u = hf_direction(hf, CLEAN, d)
    f = d.encode(x.float()).double()[0]  # (F,)
    want = f * decoder_scale(d, x)[0, 0] * (d.W_dec.double() @ u)  # (F,)
    assert got.site_contribution == pytest.approx(float(u @ x[0]), abs=1e-4)
    assert {i for i, _, _ in got.features} == set(f.nonzero().flatten().tolist())
    worst = max(abs(c - float(want[i])) for i, _, c in got.features)
    largest = max(abs(c) for _, _, c in got.features)
    print(f"{name}: {len(got.features)} active, max |ours - definition| {worst:.1e} of contributions up to {largest:.2f}")
    assert worst <= 1e-4 * max(1.0, largest) and largest > 1e-2
    assert [abs(c) for _, _, c in got.features] == sorted((abs(c) for _, _, c in got.features), reverse=True)
    assert got.total == pytest.approx(got.site_contribution, abs=1e-4)  # features + b_dec + error = the site
    assert abs(got.error) > 1e-3  # a random dictionary reconstructs badly: the error node carries something
    assert job.result.total == pytest.approx(job.result.logit_diff, abs=1e-4)  # the plain attribution beside it


@pytest.mark.parametrize("metric", ["logit_diff", "logprob"])
@pytest.mark.parametrize("name,activation,normalize", HOOKS)
def test_feature_attribution_patching_equals_hf_autograd(pair, name, activation, normalize, metric):
    ours, hf = pair
    d = random_dictionary(name, activation, normalize)
    h = d.hook_in
    contrast = CONTRAST if metric == "logit_diff" else None
    T = len(CLEAN)
    job = FeatureAttributionRun(ours, d, CLEAN, CORRUPTED, ANSWER, contrast, metric, list(range(T))).run()
    # HF autograd at the clean run (the target of a corrupted-into-clean patch), through the whole model
    _, grads = hf_attribution_patching(hf, CORRUPTED, CLEAN, ANSWER, contrast, [h.site], [h.layer], range(T))
    g = grads[(h.layer, h.site)].double().reshape(T, -1)  # (T, W)
    grad_err = (job.gradient.double() - g).abs().max()
    assert grad_err <= 1e-4 * max(1.0, float(g.abs().max())), grad_err
    x_clean, x_corr = hf_site(hf, CLEAN, d).reshape(T, -1), hf_site(hf, CORRUPTED, d).reshape(T, -1)
    f_clean, f_corr = d.encode(x_clean.float()).double(), d.encode(x_corr.float()).double()
    est = (g @ d.W_dec.double().T) * decoder_scale(d, x_clean) * (f_corr - f_clean)  # (T, F): Marks et al. eq. 3
    largest = float(est.abs().max())
    worst = max(abs(n.estimate - float(est[n.position, n.feature])) for n in job.nodes)
    print(f"{name} {metric}: {len(job.nodes)} nodes, gradient error {grad_err:.1e}, max |ours - definition| "
          f"{worst:.1e} of estimates up to {largest:.3f}")
    assert worst <= 1e-4 * max(1.0, largest) and largest > 1e-3
    reported = {(n.position, n.feature) for n in job.nodes}
    assert {(int(t), int(i)) for t, i in (est.abs() > 1e-3).nonzero()} <= reported
    for n in job.nodes[:5]:
        assert n.clean == pytest.approx(float(f_clean[n.position, n.feature]), abs=1e-4)
        assert n.corrupted == pytest.approx(float(f_corr[n.position, n.feature]), abs=1e-4)
    site = (g * (x_corr - x_clean)).sum(-1)  # the site's own estimate per position
    assert torch.tensor(job.site).sub(site).abs().max() <= 1e-4 * max(1.0, float(site.abs().max()))
    # features + error reconstruct the site's estimate exactly; input normalisation leaves a remainder
    if normalize == "none":
        assert max(map(abs, job.rest)) <= 1e-4 * max(1.0, float(site.abs().max()))
    assert max(map(abs, job.error)) > 1e-4
    m_clean, m_corr = job.baselines
    assert m_clean != pytest.approx(m_corr, abs=1e-3)


def test_exact_patch_vector_is_the_feature_moved(pair):
    """What verify adds at a node's position: x + patch_vector re-encodes with that feature at its corrupted value
    under the decoder (a ReLU dictionary with one feature moved: its decode moves by exactly that)."""
    ours, _ = pair
    d = random_dictionary("blocks.1.hook_resid_post", "topk", "none")
    job = FeatureAttributionRun(ours, d, CLEAN, CORRUPTED, ANSWER, CONTRAST, "logit_diff", [2, 6]).run()
    n = job.nodes[0]
    v = job.patch_vector(n)
    assert torch.allclose(v.double(), (n.corrupted - n.clean) * d.W_dec[n.feature].double(), atol=1e-6)
    (edit,) = job.interventions(n)
    assert (edit.layer, edit.site, edit.op, edit.positions) == (1, "block_output", "add", (n.position,))
    z = FeatureAttributionRun(ours, random_dictionary("blocks.1.attn.hook_z", "topk", "none"), CLEAN, CORRUPTED,
                              ANSWER, CONTRAST, "logit_diff", [2]).run()
    edits = z.interventions(z.nodes[0])
    assert [e.head for e in edits] == list(range(ours.config.n_heads))
    assert torch.equal(torch.cat([e.vector for e in edits]), z.patch_vector(z.nodes[0]))


def test_transcoders_and_sites_not_recorded_are_refused():
    d = random_dictionary("blocks.1.hook_resid_mid", "topk", "none")
    with pytest.raises(ValueError, match="^sae: .*resid_mid"):
        check_attributable(d)
    t = random_dictionary("blocks.1.hook_resid_post", "topk", "none")
    t.transcoder, t.apply_b_dec_to_input = True, False
    with pytest.raises(ValueError, match="^sae: a transcoder"):
        check_attributable(t)
