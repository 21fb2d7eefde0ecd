"""Attribution on the served modules (model/probes/direct_logit.py, attribution_patching.py) against HF transformers
on the same random weights (float32, 1e-4): direct logit attribution per head and MLP against forward hooks, the
sum against the logit difference; attribution patching's estimates at every site, layer, head and position against
HF autograd through the whole model (ours recomputes one block at a time); AtP*'s QK fix against the attention
pattern recomputed cell by cell; the quantized layers' backward; and the same on the default model (slow)."""

from __future__ import annotations

import math

import pytest
import torch

from attribution_reference import attribution_patching as hf_attribution_patching
from attribution_reference import direct_logit as hf_direct_logit
from hf_checkpoints import save_tiny_llama
from model.interventions import HeadShape
from model.loaders.hf import load_hf
from model.probes.attribution_patching import AttributionPatchingRun
from model.probes.direct_logit import DirectLogitRun
from model.probes.patching import PatchSweep
from model.quantize import QuantLinear

ALL_SITES = ["block_output", "attention_output", "mlp_output", "head_q", "head_k", "head_v", "head_output"]
N_LAYERS = 3
SOURCE = [5, 17, 99, 3, 44, 81, 60, 7, 23, 90]
TARGET = [5, 17, 98, 3, 44, 81, 61, 7, 23, 90]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf-attribution")
    hf = save_tiny_llama(d, num_hidden_layers=N_LAYERS)
    return load_hf(d), hf, d


def test_direct_logit_equals_hf_hooks_and_sums_to_the_logit_difference(pair):
    ours, hf, _ = pair
    r = DirectLogitRun(ours, SOURCE, 10, 20).run().result
    ref = hf_direct_logit(hf, SOURCE, 10, 20)
    assert r.embedding == pytest.approx(ref["embed"], abs=1e-4)
    assert torch.tensor(r.heads).sub(torch.tensor(ref["heads"])).abs().max() <= 1e-4
    assert torch.tensor(r.mlp).sub(torch.tensor(ref["mlp"])).abs().max() <= 1e-4
    assert r.logit_diff == pytest.approx(ref["logit_diff"], abs=1e-4)
    assert r.total == pytest.approx(r.logit_diff, abs=1e-4)
    assert max(abs(x) for x in r.remainder) <= 1e-4  # float weights, no bias: the heads are the whole attention
    assert max(abs(v) for row in r.heads for v in row) > 0.1  # the heads write something, so the test means something


def _sweep(model, metric="logit_diff", sites=ALL_SITES) -> PatchSweep:
    s = PatchSweep(list(sites), list(range(N_LAYERS)), list(range(len(SOURCE))), len(SOURCE), 10,
                   20 if metric == "logit_diff" else None, metric, head_shape=HeadShape.of(model.config))
    s.validate(N_LAYERS)
    return s


@pytest.mark.parametrize("metric", ["logit_diff", "logprob"])
def test_attribution_patching_equals_hf_autograd(pair, metric):
    """Without the QK fix every estimate is (a_source - a_target) . dm/da: the gradient, checkpointed block by block
    on our side, against HF autograd through the whole model, at all seven sites."""
    ours, hf, _ = pair
    sweep = _sweep(ours, metric)
    run = AttributionPatchingRun(ours, sweep, SOURCE, TARGET, qk_fix=False, keep_gradients=True).run()
    ref, grads = hf_attribution_patching(hf, SOURCE, TARGET, 10, sweep.contrast, ALL_SITES, range(N_LAYERS),
                                         sweep.positions)
    gdiff = _gradient_difference(run, grads)
    got = {(c.site, c.layer, c.head, c.position): v for c, v in run.estimates.items()}
    assert set(got) == set(ref)
    diff = max(abs(got[k] - ref[k]) for k in ref)
    print(f"{metric}: {len(ref)} cells, max |gradient - HF's| {gdiff:.2e}, max |estimate - HF's| {diff:.2e}, "
          f"largest estimate {max(map(abs, ref.values())):.2f}")
    assert gdiff <= 1e-4 and diff <= 1e-4
    assert max(abs(v) for v in ref.values()) > 0.1
    # position 0 is the same token in both prompts, with nothing before it: nothing to patch
    assert all(v == 0.0 for (s, l, h, p), v in got.items() if p == 0)


def _gradient_difference(run: AttributionPatchingRun, hf_grads: dict) -> float:
    """The largest |dm/da| difference at every swept (layer, site) and position, ours against HF autograd's."""
    worst = 0.0
    for (layer, site), g in run.gradients.items():
        want = hf_grads[(layer, site)][run.positions].reshape(g.shape)  # (P, D) or (P, heads, E)
        worst = max(worst, (g - want).abs().max().item())
    return worst


def _pattern_row(scores_row: torch.Tensor) -> torch.Tensor:
    return scores_row.softmax(-1)


def test_qk_fix_is_the_patched_pattern_then_linear(pair, monkeypatch):
    """AtP*'s estimate for head_q / head_k, vectorised (the key's closed form), against the attention pattern
    recomputed cell by cell with the source's rotated q or k in it: sum_j dm/dA_j (A'_j - A_j)."""
    ours, _, _ = pair
    sweep = _sweep(ours, sites=["head_q", "head_k"])
    seen = {}
    original = AttributionPatchingRun._qk_fix

    def spy(self, layer, site, cap, grad_pattern):
        seen[(layer, site)] = (cap, grad_pattern.detach().double())
        return original(self, layer, site, cap, grad_pattern)

    monkeypatch.setattr(AttributionPatchingRun, "_qk_fix", spy)
    run = AttributionPatchingRun(ours, sweep, SOURCE, TARGET).run()
    H, K, E = ours.config.n_heads, ours.config.n_kv_heads, ours.config.head_dim
    group = H // K
    for (layer, site), (cap, gA) in seen.items():
        scores = cap.attention[layer][0].double()  # (H, T, T)
        q_t, k_t = (t.double() for t in cap.qk[layer])
        src_q, src_k = (t.double() for t in run.source.capture.qk[layer])
        tgt_q, tgt_k = (t.double() for t in run.target.capture.qk[layer])
        for p in sweep.positions:
            for head in sweep.heads_of(site):
                want = 0.0
                heads = [head] if site == "head_q" else range(head * group, (head + 1) * group)
                for h in heads:
                    g = h // group
                    for i in range(len(SOURCE)):
                        row = scores[h, i].clone()
                        if site == "head_q":
                            if i != p:
                                continue
                            moved = row + (src_q[p, h] - tgt_q[p, h]) @ k_t[:, g].T / math.sqrt(E)
                        else:
                            if i < p:
                                continue
                            moved = row.clone()
                            moved[p] = row[p] + q_t[i, h] @ (src_k[p, g] - tgt_k[p, g]) / math.sqrt(E)
                        want += float((gA[h, i] * (_pattern_row(moved) - _pattern_row(row))).sum())
                got = run.estimates[next(c for c in run.estimates if (c.site, c.layer, c.head, c.position) ==
                                         (site, layer, head, p))]
                assert got == pytest.approx(want, abs=1e-9, rel=1e-7), (site, layer, head, p)


def test_quantized_layers_backward_through_their_dequantized_weight(pair):
    _, _, d = pair
    model = load_hf(d, quantization="int8")
    layer = model.layers[0].feed_forward.w2
    x = torch.randn(5, layer.in_features, requires_grad=True)
    dy = torch.randn(5, layer.out_features)
    (dx,) = torch.autograd.grad(layer(x), x, dy)
    assert torch.allclose(dx, dy @ layer.dequantize(torch.float32), atol=1e-5)
    with torch.no_grad():
        assert torch.equal(layer(x.detach()), layer(x).detach())  # the forward is the served kernel's


def _dequantized(q, d):
    """The float32 model whose weights are `q`'s dequantized: what `q` computes but for its kernels' rounding of the
    activations."""
    f = load_hf(d)
    with torch.no_grad():
        for name, mod in q.named_modules():
            if isinstance(mod, QuantLinear) and ".parts." not in name:
                owner = name.removesuffix(".table")  # a quantized embedding's table: the float Embedding's weight
                f.get_submodule(owner).weight.copy_(mod.dequantize(torch.float32)[: f.get_submodule(owner).weight.shape[0]])
    return f


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_attribution_patching_runs_at_the_served_precision(pair, mode):
    """A quantized model's estimates: forward through its kernels, backward through each layer's dequantized weight
    (the precision says so); against the float32 model of the same dequantized weights (what the quantized one
    computes but for the kernels' rounding of activations to int8 blocks)."""
    _, _, d = pair
    q = load_hf(d, quantization=mode)
    sweep = _sweep(q, sites=["block_output", "head_output", "head_k"])
    run = AttributionPatchingRun(q, sweep, SOURCE, TARGET).run()
    assert run.gradient_precision.startswith("float32 (each quantized layer's weight dequantized")
    ref = AttributionPatchingRun(_dequantized(q, d), sweep, SOURCE, TARGET).run()
    a = torch.tensor([run.estimates[c] for c in sweep.cells()])
    b = torch.tensor([ref.estimates[c] for c in sweep.cells()])
    print(f"{mode}: correlation with the dequantized float32 model {torch.corrcoef(torch.stack([a, b]))[0, 1]:.5f}, "
          f"max |difference| {(a - b).abs().max():.2e} of {b.abs().max():.2f}")
    assert torch.corrcoef(torch.stack([a, b]))[0, 1] > 0.98


@pytest.mark.slow
def test_default_model_direct_logit_and_gradient_equal_hf(default_model, hf_gguf_model, hf_gguf_tokenizer):
    """The acceptance on the default model (float32, both sides the same GGUF): direct logit attribution per head
    and MLP equal HF hooks and sum to the served logit difference, within 1e-4; attribution patching's estimates
    (the gradient) equal HF autograd within 1e-4."""
    m = default_model.model
    tok = default_model.tokenizer
    clean = tok.encode("The Eiffel Tower is in the city of")
    corrupted = tok.encode("The Colosseum is in the city of")
    paris, rome = (tok.encode(w, add_bos=False)[0] for w in (" Paris", " Rome"))
    r = DirectLogitRun(m, clean, paris, rome).run().result
    ref = hf_direct_logit(hf_gguf_model, clean, paris, rome)
    heads = torch.tensor(r.heads).sub(torch.tensor(ref["heads"])).abs().max().item()
    mlp = torch.tensor(r.mlp).sub(torch.tensor(ref["mlp"])).abs().max().item()
    print(f"default model DLA: logit diff {r.logit_diff:.4f} (HF {ref['logit_diff']:.4f}), sum {r.total:.4f}, "
          f"max |heads - HF| {heads:.1e}, max |MLPs - HF| {mlp:.1e}")
    assert abs(r.total - r.logit_diff) <= 1e-4 and heads <= 1e-4 and mlp <= 1e-4
    assert r.embedding == pytest.approx(ref["embed"], abs=1e-4)
    sites = ["block_output", "head_output", "head_q", "head_k"]
    sweep = PatchSweep(sites, list(range(m.config.n_layers)), list(range(len(clean))), len(clean), paris, rome,
                       head_shape=HeadShape.of(m.config))
    run = AttributionPatchingRun(m, sweep, clean, corrupted, qk_fix=False, keep_gradients=True).run()
    want, grads = hf_attribution_patching(hf_gguf_model, clean, corrupted, paris, rome, sites, range(m.config.n_layers),
                                          sweep.positions)
    gdiff = _gradient_difference(run, grads)
    diff = max(abs(run.estimates[c] - want[(c.site, c.layer, c.head, c.position)]) for c in sweep.cells())
    largest = max(map(abs, want.values()))
    print(f"default model AtP: {sweep.num_cells} cells, max |gradient - HF autograd's| {gdiff:.1e}; estimates: max "
          f"|ours - HF| {diff:.1e} of the largest, {largest:.2f}")
    assert gdiff <= 1e-4 and diff <= 1e-4 * max(1.0, largest)

