"""model/probes/feature_grid.py inside a ProbeRun: stepped in small slices (rows of each block in chunks, the grid's
stages in chunks, as the engine thread runs it between serving steps) it gives exactly the grid of one whole run,
and that grid is the dictionary's encode of the site's activations as a capture forward records them. (Against HF
transformers: tests/service/test_inspect_features.py.)"""

from __future__ import annotations

import pytest
import torch

from model.features.sae import Dictionary
from model.hook_names import Hook
from model.probes import CaptureRun, FeatureRequest, ProbeOptions, ProbeRun, SiteCapture
from tiny import tiny_model


def random_dictionary(model, layer: int, site: str, F: int = 24, activation: str = "relu", k: int = 0) -> Dictionary:
    c = model.config
    D = c.n_heads * c.head_dim if site == "head_output" else c.dim
    g = torch.Generator().manual_seed(layer * 7 + len(site))
    return Dictionary(W_enc=torch.randn(D, F, generator=g) * 0.3, b_enc=torch.randn(F, generator=g) * 0.1,
                      W_dec=torch.randn(F, D, generator=g), b_dec=torch.zeros(D), hook_in=Hook(layer, site),
                      hook_out=Hook(layer, site), activation=activation, k=k, apply_b_dec_to_input=True)


def grid_of(model, ids, d, budget=None, top_k=3, feature_ids=None):
    run = ProbeRun(model, ids, ProbeOptions(include=frozenset()), features=FeatureRequest("d", d, top_k, feature_ids))
    while not run.step(budget):
        pass
    return run.result().features


@pytest.mark.parametrize("site", ["block_output", "mlp_output", "head_output", "resid_mid", "mlp_input"])
def test_stepped_grid_equals_the_whole_run_and_the_captured_encode(site):
    model = tiny_model(seed=3, n_layers=3)
    ids = list(torch.randint(3, 250, (70,), generator=torch.Generator().manual_seed(1)).tolist())
    d = random_dictionary(model, 1, site, activation="topk" if site == "block_output" else "relu", k=5)
    whole = grid_of(model, ids, d, feature_ids=[0, 23])
    stepped = grid_of(model, ids, d, budget=1e-6, feature_ids=[0, 23])  # the smallest chunks: 4 rows, 16, 4 features
    for name in ("top_ids", "top_values", "ids", "max", "mean", "entry_feature", "entry_position", "entry_value",
                 "promote_ids", "promote_logits", "suppress_ids", "suppress_logits"):
        a, b = getattr(whole, name), getattr(stepped, name)
        assert a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=0, atol=1e-4 * whole.max.max().item()), name

    capture = SiteCapture((site,), frozenset({1}))
    CaptureRun(model, ids, capture).run()
    x = capture.values[(1, site)]
    f = d.encode(x.reshape(len(ids), -1))  # (T, F)
    dense = torch.zeros(len(whole.ids), len(ids))
    dense[whole.entry_feature, whole.entry_position] = whole.entry_value
    scale = f.abs().max()
    assert (dense - f[:, whole.ids].T).abs().max() <= 1e-4 * scale
    assert {0, 23} <= set(whole.ids.tolist())
    values, top = f.topk(3, dim=-1)
    assert torch.equal(torch.where(values > 0, top, -1), whole.top_ids)


def test_a_grid_too_large_for_the_response_stops_with_its_error():
    model = tiny_model(seed=3, n_layers=2)
    d = random_dictionary(model, 0, "block_output")
    run = ProbeRun(model, list(range(5, 40)), ProbeOptions(include=frozenset()),
                   features=FeatureRequest("d", d, 8, max_entries=10))
    with pytest.raises(ValueError, match="more than 10 nonzero"):
        run.run()


def test_sites_an_inspection_does_not_read_are_refused_naming_the_field():
    model = tiny_model(seed=3, n_layers=2)
    d = random_dictionary(model, 0, "block_output")
    d.hook_in = Hook(0, "mlp_normalized")  # no tensor a block hands its context
    with pytest.raises(ValueError, match="^features.sae: .*mlp_normalized"):
        ProbeRun(model, [5, 6, 7], ProbeOptions(include=frozenset()), features=FeatureRequest("d", d))
    with pytest.raises(ValueError, match="^features.ids: 24 is out of range"):
        ProbeRun(model, [5, 6, 7], ProbeOptions(include=frozenset()),
                 features=FeatureRequest("d", random_dictionary(model, 0, "block_output"), ids=[24]))
