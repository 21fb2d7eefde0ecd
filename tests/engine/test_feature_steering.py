"""Steering by feature in the engine, on a tiny random model: 32 concurrent requests with mixed feature edits (add
and clamp, dictionaries of three activations at three sites, every kind of positions), plain rows among them, each
give exactly (tokens and every logprob, bitwise) what they give alone, with the native step on and off (a step
holding any clamp, a TopK's included, runs the fused step); a clamp equals an uncached forward hooked with the
dictionary's own encode; the prefix cache keys blocks by the clamp (dictionary content, feature, value)."""

from __future__ import annotations

import random

import pytest
import torch

from model import kernels
from model.edits import clamp_reference
from model.features.sae import FeatureClamp
from model.interventions import Intervention, InterventionPlan
from random_dictionaries import random_dictionary
from test_interventions import _engine, _prompts, greedy, serve

pytestmark = pytest.mark.skipif(kernels.native() is None, reason=f"native kernels: {kernels.status()}")
L = 2


@pytest.fixture(scope="module")
def dictionaries():
    return {
        "relu": random_dictionary("relu", layer=1, site="block_output", seed=0, input_scale=8.0),
        "topk": random_dictionary("topk", layer=0, site="mlp_output", seed=1, k=4, input_scale=4.0),
        "jumprelu": random_dictionary("jumprelu", layer=0, site="block_output", seed=2, apply_b_dec=True,
                                      normalize="constant_norm_rescale"),
        "relu@resid_mid": random_dictionary("relu", layer=0, site="resid_mid", seed=3, input_scale=4.0),
        "jumprelu@mlp_input": random_dictionary("jumprelu", layer=1, site="mlp_input", seed=4, apply_b_dec=True),
    }


def _feature_items(dicts, i: int) -> list[Intervention] | None:
    """Request i's edits: every fourth request plain, the others a mix of feature adds and clamps."""
    rng = random.Random(i)
    if i % 4 == 0:
        return None
    positions = [("all", "generated", "prompt", tuple(sorted(rng.sample(range(40), 6))))[j] for j in range(4)]
    items = []
    for name in rng.sample(sorted(dicts), rng.randint(1, 3)):
        d = dicts[name]
        F, pos = rng.randrange(d.d_sae), rng.choice(positions)
        h = d.hook_in
        if rng.random() < 0.35:
            items.append(Intervention(h.layer, h.site, "add", pos, d.W_dec[F].clone(), scale=rng.uniform(-4, 4)))
        else:
            items.append(Intervention(h.layer, h.site, "clamp", pos, clamp=FeatureClamp(d, F, rng.uniform(-2, 8))))
    return items


@pytest.mark.slow  # 65 engines' runs
@pytest.mark.parametrize("path", ["native", "module"])
def test_32_concurrent_feature_edits_each_equal_alone(model, dictionaries, path):
    kw = {"native": dict(decode_graphs="off"), "module": dict(native_step=False, decode_graphs="off")}[path]
    prompts = _prompts(32, seed=21, lo=4, hi=36)
    items = {str(i): _feature_items(dictionaries, i) for i in range(32)}
    reqs = {r: (prompts[int(r)], greedy(8, logprobs=2, prompt_logprobs=1), items[r]) for r in items}
    engine = _engine(model, max_num_seqs=32, max_num_batched_tokens=96, **kw)
    batched = serve(engine, reqs, {r: int(r) // 4 for r in reqs})
    counts = engine.runner.path_counts
    if path == "native":  # every step, a TopK's clamps included, in the fused step
        assert counts["native"] > 0 and counts["module"] == 0, counts
    else:
        assert counts["module"] > 0, counts
    plain = serve(_engine(model, **kw), {r: (p, sp, None) for r, (p, sp, _) in reqs.items()})
    moved = 0
    for r, req in reqs.items():
        alone = serve(_engine(model, **kw), {r: req})
        assert batched[r]["tokens"] == alone[r]["tokens"], r
        assert batched[r]["lp"] == alone[r]["lp"] and batched[r]["prompt_lp"] == alone[r]["prompt_lp"], r
        if items[r] is None:
            assert batched[r] == plain[r], r  # plain rows beside feature edits: bit-identical to none anywhere
        else:
            moved += batched[r]["lp"] != plain[r]["lp"]
    assert moved >= 16  # the edits did something


def _clamp_hook(d, F: int, v: float, P: int, positions):
    it = Intervention(d.hook_in.layer, d.hook_in.site, "clamp", positions, clamp=FeatureClamp(d, F, v))

    def hook(module, args, out):
        out = out.clone()
        rows = [t for t in range(out.shape[1]) if it.applies(t, P)]
        x = out[0, rows]
        f = d.encode(x)
        f2 = f.clone()
        f2[:, F] = v
        out[0, rows] = x + d.decode(f2, x) - d.decode(f, x)
        return out
    return it, hook


@pytest.mark.parametrize("name", ["relu", "topk", "jumprelu", "relu@resid_mid", "jumprelu@mlp_input"])
def test_a_clamp_equals_the_hooked_forward(model, dictionaries, name):
    d = dictionaries[name]
    prompt = _prompts(1, seed=5, lo=12, hi=12)[0]
    it, hook = _clamp_hook(d, 3, 6.0, len(prompt), "all")
    block = model.layers[it.layer]
    got = serve(_engine(model, decode_graphs="off"), {"r": (prompt, greedy(6, prompt_logprobs=0), [it])})["r"]
    ids, handles, seen = list(prompt), [], {}
    if it.site == "resid_mid":  # the attention output that makes the stream h + a the clamped one
        handles.append(block.register_forward_pre_hook(lambda m, a: seen.__setitem__("h", a[0])))
        handles.append(block.attention.register_forward_hook(lambda m, a, o: hook(m, a, seen["h"] + o) - seen["h"]))
    elif it.site == "mlp_input":  # the feed-forward's input
        handles.append(block.feed_forward.register_forward_pre_hook(lambda m, a: (hook(m, a, a[0]), *a[1:])))
    else:
        module = {"block_output": block, "attention_output": block.attention, "mlp_output": block.feed_forward}[it.site]
        handles.append(module.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            for _ in range(6):
                logits = model(torch.tensor([ids]))[0]
                ids.append(int(logits[-1].argmax()))
    finally:
        for h in handles:
            h.remove()
    assert got["tokens"] == ids[len(prompt):]
    want = logits.log_softmax(-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
    assert got["prompt_lp"][1:] == pytest.approx(want, abs=1e-4)


def test_block_digests_key_the_clamp(dictionaries):
    d = dictionaries["relu"]
    twin = random_dictionary("relu", layer=1, site="block_output", seed=0, input_scale=8.0)  # same weights, new object
    other = random_dictionary("relu", layer=1, site="block_output", seed=9, input_scale=8.0)

    def digest(dic, F, v, positions="all"):
        plan = InterventionPlan([Intervention(1, "block_output", "clamp", positions, clamp=FeatureClamp(dic, F, v))],
                                8, L, 64)
        return plan.block_digest(0, 4)

    assert digest(d, 3, 2.0) == digest(twin, 3, 2.0)  # content, not identity
    assert len({digest(d, 3, 2.0), digest(other, 3, 2.0), digest(d, 4, 2.0), digest(d, 3, 2.5)}) == 4
    assert digest(d, 3, 2.0, (6,)) is None  # a block the clamp does not touch keys as a plain one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["relu", "jumprelu", "gated", "topk", "groupmax"])
def test_native_clamp_equals_the_reference(dictionaries, name, dtype):
    """The C++ clamp (csrc/interventions.cpp) against FeatureClamp.apply, the PyTorch definition, within the
    tolerance the projection test uses (both take float64 dot products, in different orders); a TopK's and a
    GroupMax's selection from the row's whole encode (their clamps' features both selected and not, at these rows)."""
    d = {"relu": dictionaries["relu"], "jumprelu": dictionaries["jumprelu"],
         "gated": random_dictionary("gated", seed=4, apply_b_dec=True, normalize="layer_norm", input_scale=8.0),
         "topk": random_dictionary("topk", seed=5, k=6, apply_b_dec=True, input_scale=8.0),
         "groupmax": random_dictionary("groupmax", seed=6, k=4, normalize="constant_norm_rescale",
                                       input_scale=8.0)}[name]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 64, generator=g) * 8).to(dtype)
    rows = torch.randperm(37, generator=g)[:20]
    clamps = [FeatureClamp(d, F, v) for F, v in ((3, 5.0), (7, 0.0), (11, -2.0))]
    # one table: each clamp on its rows, and the first one's rows clamped twice (by the first, then the third)
    parts = [native_clamp_table(c, rows[j::3], 3 * j) for j, c in enumerate(clamps)]
    parts.append(native_clamp_table(clamps[2], rows[0::3], 6))
    ops = torch.cat([p[0] for p in parts])
    params = torch.cat([p[1] for p in parts])
    bank = torch.cat([native_clamp_table(c, rows[:1], 0)[2] for c in clamps])
    encoders = list(clamps[0].encoder() or ())
    if encoders:  # the selection matters here: some clamped rows have F selected, some not
        active = torch.cat([(c.activation(x[rows[j::3]].float()) > 0) for j, c in enumerate(clamps)])
        assert 0 < int(active.sum()) < active.numel()
    a, b, c_ = x.clone(), x.clone(), x.clone()
    kernels.native().apply_clamps(a, ops, params, bank, encoders)
    clamp_reference(b, ops, params, bank, encoders)
    for c, r in [(clamps[0], rows[0::3]), (clamps[1], rows[1::3]), (clamps[2], rows[2::3]), (clamps[2], rows[0::3])]:
        y = c_[r]
        c.apply(y)  # the definition, model/features/sae/steer.py
        c_[r] = y
    untouched = torch.ones(37, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(a[untouched], x[untouched])
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-4)
    assert torch.allclose(a.float(), b.float(), **tol)
    assert torch.allclose(a.float(), c_.float(), **tol)
    assert not torch.equal(a, x)


def native_clamp_table(c: FeatureClamp, rows: torch.Tensor, base: int, encoder: int = 0):
    """One clamp on `rows` as model/edits.py's clamp table: ops (n, 4), params (n, 7), and its bank rows, which a
    caller places at `base`; a TopK or GroupMax clamp's encoder at index `encoder` of the step's encoders."""
    vs, params = c.table_entry()
    if c.encoder() is not None:
        params[3] = float(encoder)
    n = rows.numel()
    ops = torch.stack([rows, torch.full((n,), base), torch.full((n,), base + 1),
                       torch.full((n,), base + 2 if len(vs) > 2 else -1)], 1)
    bank = torch.stack(vs + [torch.zeros(64)] * (3 - len(vs)))
    return ops.contiguous(), torch.tensor([params] * n, dtype=torch.float64), bank
