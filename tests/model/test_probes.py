"""model/probes.py on tiny random models: planted massive activations, constructed attention patterns, map modes
agreeing with each other, GQA labels, parity with HF `output_attentions`, and A @ V == the serving attention output."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import sdpa
from model.probes import ProbeAttention, ProbeOptions, ProbeRun, inspect, massive_activations
from tiny import tiny_model

IDS = [5, 17, 99, 3, 250, 42, 7, 7, 120, 64, 33, 200, 1, 9, 77, 18, 140, 66, 2, 31, 45]  # T = 21


def test_planted_massive_activation_is_reported_exactly():
    torch.manual_seed(0)
    h = torch.randn(12, 32)  # (T, D), median |h| about 0.67
    h[0, 7] = -2500.0
    h[4, 3] = 90.0  # large ratio but under the 100 threshold: not massive
    acts = massive_activations(h, ProbeOptions())
    median = h.abs().flatten().median().item()
    assert acts.num_massive == 1
    (e,) = acts.massive
    assert (e.token, e.dim, e.value, e.massive) == (0, 7, -2500.0, True)
    assert e.ratio == pytest.approx(2500.0 / median, rel=1e-6)
    assert acts.top[0].token == 0 and acts.top[1].value == 90.0 and not acts.top[1].massive
    # the ratio rule alone: raise it above this entry's ratio and nothing is flagged
    assert massive_activations(h, ProbeOptions(massive_ratio=e.ratio * 1.01)).num_massive == 0


def test_planted_massive_activation_through_the_model():
    """A bias planted in block 1's output at (token 0, dim 7) shows up in blocks 1.. and in the summary."""
    model = tiny_model(n_layers=3)
    block = model.layers[1]
    real = type(block).forward

    def planted(self, h, cos, sin, ctx):
        out = real(self, h, cos, sin, ctx)
        if self is block:
            out = out.clone()
            out[0, 0, 7] += 5e4
        return out

    type(block).forward = planted
    try:
        r = inspect(model, IDS, ProbeOptions())
    finally:
        type(block).forward = real
    assert r.massive_layers[0] == 1 and 7 in r.massive_dims and r.massive_tokens[0] == 0
    e = r.layers[1].massive[0]
    assert (e.token, e.dim, e.massive) == (0, 7, True) and e.value > 4e4
    assert r.layers[0].num_massive == 0


def _qkv(T=12, H=4, K=2, E=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, T, H, E, generator=g), torch.randn(1, T, K, E, generator=g), torch.randn(1, T, K, E, generator=g))


def test_constructed_sink_pattern_gives_the_expected_mass():
    """Keys equal and queries zero except a huge logit on key 0: every query puts the same known mass on token 0."""
    T, H, K, E = 10, 2, 1, 4
    q = torch.zeros(1, T, H, E)
    k = torch.zeros(1, T, K, E)
    q[..., 0] = 1.0
    k[0, 0, :, 0] = math.log(9.0) * math.sqrt(E)  # score on key 0 is log 9, others 0
    ctx = ProbeAttention(ProbeOptions(mode="full"), H, K, {0}, {0})
    ctx.attend(0, q, k, torch.randn(1, T, K, E))
    received, entropy, maps = ctx.stats[0]
    # query t (t >= 1) sees t + 1 keys: weight on key 0 is 9 / (9 + t)
    expected = sum(9 / (9 + t) for t in range(1, T)) / (T - 1)
    assert received[:, 0].tolist() == pytest.approx([expected] * H, rel=1e-5)
    assert maps.values[0, 3, 0].item() == pytest.approx(9 / 12, rel=1e-5)


@pytest.mark.parametrize("H,K", [(4, 4), (4, 2), (4, 1)])
def test_reported_weights_are_the_ones_used(H, K):
    """A @ V from the reported maps equals SDPA's output (what the model adds to the residual stream)."""
    q, k, v = _qkv(H=H, K=K)
    ctx = ProbeAttention(ProbeOptions(mode="full", row_block=5), H, K, {0}, {0})
    out = ctx.attend(0, q, k, v)  # (1, T, H, E)
    A = ctx.stats[0][2].values  # (H, T, T)
    v_heads = v[0].repeat_interleave(H // K, dim=1).transpose(0, 1)  # (H, T, E)
    assert torch.allclose(A @ v_heads, out[0].transpose(0, 1), atol=1e-5)
    assert torch.allclose(A.sum(-1), torch.ones(H, A.shape[1]), atol=1e-5)
    assert torch.all(A.triu(1) == 0)


def test_gqa_groups_are_labelled():
    model = tiny_model(n_heads=6, n_kv_heads=2, dim=48)
    r = inspect(model, IDS, ProbeOptions(heads=[0, 2, 3, 5], mode="full"))
    assert r.heads == [0, 2, 3, 5] and r.kv_groups == [0, 0, 1, 1]
    assert [h.kv_group for h in r.layers[0].heads] == [0, 0, 1, 1]
    # the selected head's map is that head's, whatever else is selected
    alone = inspect(model, IDS, ProbeOptions(heads=[3], mode="full"))
    assert torch.equal(alone.layers[1].maps.values[0], r.layers[1].maps.values[2])


def test_modes_agree_with_each_other():
    model = tiny_model(n_layers=2)
    T = len(IDS)
    full = inspect(model, IDS, ProbeOptions(mode="full", row_block=4)).layers
    rows = inspect(model, IDS, ProbeOptions(mode="rows", rows=[0, 7, T - 1], row_block=4)).layers
    topk = inspect(model, IDS, ProbeOptions(mode="topk", attention_top_k=5, row_block=4)).layers
    pooled = inspect(model, IDS, ProbeOptions(mode="pooled", pool_size=4)).layers
    pooled_max = inspect(model, IDS, ProbeOptions(mode="pooled", pool_size=4, pool_reduce="max")).layers
    for f, r, t, p, pm in zip(full, rows, topk, pooled, pooled_max):
        A = f.maps.values  # (H, T, T)
        assert torch.equal(r.maps.values, A[:, [0, 7, T - 1]])
        ref = A.topk(5, dim=-1)
        assert torch.equal(t.maps.values, ref.values)
        assert torch.equal(A.gather(-1, t.maps.indices), t.maps.values)
        # pooled mean keeps row sums; it equals the tile sums of the full map over the query-tile sizes
        n = math.ceil(T / 4)
        assert p.maps.values.shape == (A.shape[0], n, n)
        assert torch.allclose(p.maps.values.sum(-1), torch.ones(A.shape[0], n), atol=1e-5)
        padded = torch.nn.functional.pad(A, (0, n * 4 - T, 0, n * 4 - T)).view(A.shape[0], n, 4, n, 4)
        sizes = torch.tensor([4.0] * (n - 1) + [T - 4 * (n - 1)])
        assert torch.allclose(p.maps.values, padded.sum((2, 4)) / sizes.view(1, n, 1), atol=1e-6)
        assert torch.allclose(pm.maps.values, padded.amax((2, 4)), atol=1e-6)  # other row blocks: ulp-level differences
        # the per-head statistics do not depend on the mode
        assert [h.sink_mass for h in f.heads] == pytest.approx([h.sink_mass for h in p.heads], rel=1e-5)


def test_sink_mass_and_entropy_from_the_full_map():
    model = tiny_model(n_layers=2)
    layer = inspect(model, IDS, ProbeOptions(mode="full")).layers[1]
    A = layer.maps.values[:, 1:]  # queries 1..T-1
    for j, hs in enumerate(layer.heads):
        assert hs.sink_mass == pytest.approx(A[j, :, 0].mean().item(), rel=1e-5)
        ent = -(A[j] * torch.where(A[j] > 0, A[j].log(), 0)).sum(-1).mean().item()
        assert hs.entropy == pytest.approx(ent, rel=1e-5)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 2), (4, 1), (4, 4)])
def test_attention_maps_equal_hf_output_attentions(tmp_path, n_heads, n_kv_heads):
    from hf_checkpoints import save_tiny_llama
    from transformers import LlamaForCausalLM

    from model.loaders.hf import load_hf

    save_tiny_llama(tmp_path, seed=3, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads)
    ours = load_hf(tmp_path)
    hf = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = [t % 101 for t in IDS]  # the tiny HF vocabulary
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_attentions=True, output_hidden_states=True)
    r = inspect(ours, ids, ProbeOptions(mode="full", row_block=8, lens_positions=list(range(len(ids)))))
    for layer, hf_attn in zip(r.layers, ref.attentions):
        assert (layer.maps.values - hf_attn[0]).abs().max().item() < 1e-5
    # block outputs: HF's hidden_states[l + 1] (the last one is after the final norm, so compare norms up to it)
    for layer, hs in zip(r.layers[:-1], ref.hidden_states[1:-1]):
        assert torch.allclose(layer.residual_norm, hs[0].norm(dim=-1), rtol=1e-5)
    # the logit lens at the last block is the model's own next-token distribution
    probs = ref.logits[0].softmax(-1)
    for e in r.layers[-1].lens:
        assert e.token_ids[0] == probs[e.position].argmax().item()
        assert e.probs[0] == pytest.approx(probs[e.position].max().item(), rel=1e-4)


def test_probe_steps_a_block_at_a_time_and_validates():
    model = tiny_model(n_layers=3)
    run = ProbeRun(model, IDS, ProbeOptions())
    steps = 1
    while not run.step():
        steps += 1
    assert steps == 1 + 3  # the embeddings, then one step per block
    for bad, needle in [(ProbeOptions(layers=[3]), "layers"), (ProbeOptions(heads=[4]), "heads"),
                        (ProbeOptions(mode="rows"), "rows"), (ProbeOptions(include=frozenset({"x"})), "include"),
                        (ProbeOptions(mode="full", include=frozenset({"massive"})), "mode")]:
        with pytest.raises(ValueError, match=needle):
            ProbeRun(model, IDS, bad)
    with pytest.raises(ValueError):
        ProbeRun(model, [], ProbeOptions())


def test_single_token_has_no_sink_statistics():
    r = inspect(tiny_model(), [5], ProbeOptions(mode="full"))
    assert r.layers[0].heads[0].sink_mass is None and r.layers[0].maps.values.shape[-1] == 1
    assert r.sink_mass_by_layer == {}


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_inspection_runs_on_quantized_weights(mode):
    """The probe runs the serving modules, quantized ones included: its last-block lens is the quantized model's
    own next-token distribution, and int8 attention stays close to float32's."""
    from model.quantize import quantize_model

    ref = inspect(tiny_model(dim=128, hidden_dim=256), IDS, ProbeOptions(mode="full"))
    quantized = quantize_model(tiny_model(dim=128, hidden_dim=256), mode)
    r = inspect(quantized, IDS, ProbeOptions(mode="full"))
    with torch.inference_mode():
        probs = quantized(torch.tensor([IDS]))[0, -1].float().softmax(-1)
    assert r.layers[-1].lens[0].token_ids[0] == probs.argmax().item()
    # (the lens reads one row, which quantized layers run on their bfloat16 decode kernel: ~1% apart)
    assert r.layers[-1].lens[0].probs[0] == pytest.approx(probs.max().item(), rel=3e-2)
    for a, b in zip(r.layers, ref.layers):
        assert torch.allclose(a.maps.values.sum(-1), torch.ones_like(a.maps.values.sum(-1)), atol=1e-5)
        if mode == "int8":
            assert (a.maps.values - b.maps.values).abs().mean() < 0.01  # sharp random attention: a mean, not a max


@pytest.mark.parametrize("mode", ["full", "pooled", "rows", "topk"])
def test_a_block_run_in_row_chunks_reports_what_the_whole_block_does(mode):
    """`step(budget)` runs each block in chunks of query rows (so the engine thread never waits for a whole block);
    every statistic and map equals the one-call result."""
    model = tiny_model(n_layers=2)
    ids = [(5 * i) % 250 + 1 for i in range(70)]
    opts = dict(mode=mode, rows=[0, 33, 69], pool_size=8, attention_top_k=4, row_block=16,
                lens_positions=[5, 69])
    whole = inspect(model, ids, ProbeOptions(**opts))
    run = ProbeRun(model, ids, ProbeOptions(**opts))
    run.seconds_per_row = 1.0  # every chunk is the minimum: many chunks per block
    steps = 0
    while not run.step(budget_s=0.0):
        steps += 1
    assert steps >= 2 * 70 // max(ProbeRun.MIN_CHUNK_ROWS, 8)  # chunks per block (pooled: whole 8-row tiles)
    chunked = run.result()
    assert chunked.sink_mass_by_layer == pytest.approx(whole.sink_mass_by_layer, rel=1e-5)
    assert chunked.massive_layers == whole.massive_layers
    for a, b in zip(chunked.layers, whole.layers):
        assert a.max_abs == pytest.approx(b.max_abs, rel=1e-5)
        torch.testing.assert_close(a.residual_norm, b.residual_norm, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.maps.values, b.maps.values, rtol=1e-5, atol=1e-6)
        if a.maps.indices is not None:  # keys of weight 0 (after the query) tie: their order is arbitrary
            weighted = b.maps.values > 0
            assert torch.equal(a.maps.indices[weighted], b.maps.indices[weighted])
        assert [h.entropy for h in a.heads] == pytest.approx([h.entropy for h in b.heads], rel=1e-5)
        assert [e.token_ids for e in a.lens] == [e.token_ids for e in b.lens]


def test_the_prediction_runs_in_slices_of_rows_and_equals_the_models_own_loss():
    """After the last block, "prediction" runs the head over PREDICT_ROWS positions per unit of work (each step at
    least one), so a long sequence's (T, V) logits never hold the engine thread in one step; its perplexity is
    exp of the model's own mean next-token cross-entropy, and its top next tokens the model's."""
    model = tiny_model(n_layers=2)
    ids = [(5 * i) % 250 + 1 for i in range(2 * ProbeRun.PREDICT_ROWS + 20)]
    run = ProbeRun(model, ids, ProbeOptions(include=frozenset({"prediction"})))
    while run.next_layer < len(model.layers):
        run.step(budget_s=None)
    after = 0
    while not run.step(budget_s=0.0):
        after += 1
    assert after >= 2  # three units of rows: at least three steps
    p = run.result().prediction
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0].float()  # (T, V)
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    assert p.perplexity == pytest.approx(math.exp(nll.item()), rel=1e-4)
    assert p.num_predicted == len(ids) - 1
    top = logits[-1].softmax(-1).topk(5)
    assert p.next_token_probs == pytest.approx(top.values.tolist(), rel=1e-4)
