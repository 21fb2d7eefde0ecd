"""The sites between a block's two sub-blocks (model/interventions.py): resid_mid (the stream after the attention's
residual add), mlp_normalized (resid_mid / rms(resid_mid), read only) and mlp_input (the feed-forward's normed
input), on every path the runner can choose. Edits equal a forward with hooks doing the same (an edit of resid_mid is
the stream's: the MLP and every later block see it; one of mlp_input is the MLP's alone); reads equal the hooked
values; the native fused step is bitwise the module path; a row's reads batched equal its reads alone, bitwise; the
static-buffer graph step leaves such steps to another path."""

from __future__ import annotations

import pytest
import torch

from model import kernels
from model.interventions import HiddenStateRead, Intervention, InterventionPlan
from test_interventions import PATHS, _engine, _hook_edit, _prompts, _vec, greedy, serve

L = 2
STREAM_SITES = ("resid_mid", "mlp_normalized", "mlp_input")
GRAPH_PATH = {"module": "module", "native": "native", "graph": "cuda_graph"}


def _items(seed: int) -> list[Intervention]:
    """Edits at the stream sites (and one at an older site), positions of every kind."""
    return [
        Intervention(0, "resid_mid", "add", "all", _vec(seed, 4.0)),
        Intervention(1, "resid_mid", "set", (0, 3, 11), dims=(2, 30), values=(3.0, -2.5)),
        Intervention(0, "mlp_input", "add", "generated", _vec(seed + 1, 2.0), scale=-1.0),
        Intervention(1, "mlp_input", "project_out", "prompt", _vec(seed + 2)),
        Intervention(1, "block_output", "add", "generated", _vec(seed + 3)),
    ]


def _hooks(model, items: list[Intervention], P: int) -> list:
    """Forward hooks doing `items` on our modules, each from its site's definition: block_output on the block's
    output; resid_mid as the attention output a that makes the stream h + a the edited one (the block's input h
    kept by a pre-hook); mlp_input on the feed-forward's input."""
    handles, sites = [], {}
    for it in items:
        sites.setdefault((it.layer, it.site), []).append(it)
    for (layer, site), its in sites.items():
        block, edit = model.layers[layer], _hook_edit(its, P)
        if site == "block_output":
            handles.append(block.register_forward_hook(edit))
        elif site == "resid_mid":
            seen = {}
            handles.append(block.register_forward_pre_hook(lambda m, a, seen=seen: seen.__setitem__("h", a[0])))
            handles.append(block.attention.register_forward_hook(
                lambda m, a, o, seen=seen, edit=edit: edit(m, a, seen["h"] + o) - seen["h"]))
        else:
            assert site == "mlp_input"
            handles.append(block.feed_forward.register_forward_pre_hook(
                lambda m, a, edit=edit: (edit(m, a, a[0]), *a[1:])))
    return handles


def hooked(model, ids: list[int], items: list[Intervention], P: int, n: int = 0):
    """Greedy tokens (n of them) and the last forward's stream sites {(layer, site): (T, D)} and log-probabilities,
    by full uncached forwards with hooks."""
    handles = _hooks(model, items, P)
    seen = {}
    for l, block in enumerate(model.layers):
        def before(m, a, l=l):
            x = a[0][0].float()
            seen[(l, "resid_mid")] = a[0][0].clone()
            # TransformerLens' ln2.hook_normalized: x / rms(x), statistics in float32 (rms_norm.py)
            seen[(l, "mlp_normalized")] = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.config.norm_eps)
        handles.append(block.ffn_norm.register_forward_pre_hook(before))
        handles.append(block.feed_forward.register_forward_pre_hook(
            lambda m, a, l=l: seen.__setitem__((l, "mlp_input"), a[0][0].clone())))
    ids = list(ids)
    try:
        with torch.inference_mode():
            for i in range(max(n, 1)):
                logits = model(torch.tensor([ids]))[0]
                if i < n:
                    ids.append(int(logits[-1].argmax()))
    finally:
        for h in handles:
            h.remove()
    return ids[len(ids) - n:] if n else [], seen, logits.log_softmax(-1)


def _needs_native(path: str) -> None:
    if path != "module" and kernels.native() is None:
        pytest.skip(f"native kernels: {kernels.status()}")


def test_mlp_normalized_is_read_not_edited():
    with pytest.raises(ValueError, match=r"interventions\[0\].site: 'mlp_normalized' is read, not edited"):
        InterventionPlan([Intervention(0, "mlp_normalized", vector=_vec(0))], 5, L, 64)
    HiddenStateRead([0], "all", STREAM_SITES).validate(L)  # and read it is


@pytest.mark.parametrize("path", list(PATHS))
def test_edits_at_the_stream_sites_equal_a_hooked_forward(model, path):
    _needs_native(path)
    prompts = _prompts(3, seed=21, lo=14, hi=24)
    items = {str(i): _items(10 * i) for i in range(3)}
    engine = _engine(model, **PATHS[path])
    got = serve(engine, {r: (prompts[int(r)], greedy(8, prompt_logprobs=0), items[r]) for r in items})
    counts = engine.runner.path_counts
    if path == "graph":  # a graph edits the sub-blocks' and block outputs only: these steps ran another path
        assert counts["cuda_graph"] == 0 and counts["native"] > 0, counts
    else:
        assert counts[GRAPH_PATH[path]] > 0, counts
    moved = False
    for r, its in items.items():
        P = len(prompts[int(r)])
        tokens, _, logprobs = hooked(model, prompts[int(r)], its, P, 8)
        plain, _, _ = hooked(model, prompts[int(r)], [], P, 8)
        moved = moved or tokens != plain
        assert got[r]["tokens"] == tokens, r
        want = logprobs[torch.arange(P - 1), torch.tensor(prompts[int(r)][1:])].tolist()
        assert got[r]["prompt_lp"][1:] == pytest.approx(want, abs=1e-4)
    assert moved  # the edits change what is generated, so the equality means something


@pytest.mark.parametrize("path", list(PATHS))
def test_reads_at_the_stream_sites_equal_the_hooked_values(model, path):
    """Reads of every stream site at every position (edits of resid_mid and mlp_input on the same request: the reads
    are after them), batched with other traffic through preemption, equal the hooked forward's values over the final
    sequence (on the graph path, steps with the reading rows run another one: a graph records block outputs only)."""
    _needs_native(path)
    prompts = _prompts(6, seed=22, lo=8, hi=20)
    read = HiddenStateRead([1, 0], "all", STREAM_SITES + ("block_output",))
    reqs = {"0": (prompts[0], greedy(10), _items(5), read), "1": (prompts[1], greedy(10)),
            "2": (prompts[2], greedy(10), None, HiddenStateRead([0], "last", ("mlp_normalized",))),
            "3": (prompts[3], greedy(10), _items(7)), "4": (prompts[4], greedy(10)), "5": (prompts[5], greedy(10))}
    engine = _engine(model, num_blocks=20, max_num_batched_tokens=16, **PATHS[path])
    got = serve(engine, reqs, {r: int(r) for r in reqs})
    assert engine.scheduler.num_preemptions > 0
    for r in ("0", "2"):
        rd, (prompt, _, its, _) = reqs[r][3], reqs[r]
        P, seq = len(prompt), prompt + got[r]["tokens"]
        _, seen, _ = hooked(model, seq[:-1], its or [], P)
        hs = got[r]["hidden"]
        positions = [p for h in hs for p in h.positions]
        assert positions == (list(range(len(seq) - 1)) if rd.positions == "all" else list(range(P - 1, len(seq) - 1)))
        values = torch.cat([h.values for h in hs])  # (n, layers x sites, D), layer-major
        for j, (layer, site) in enumerate((l, s) for l in rd.layers for s in rd.sites):
            if site == "block_output":
                continue
            ref = seen[(layer, site)][positions].float()
            err = ((values[:, j] - ref).abs().max() / ref.abs().max()).item()  # paged attention vs SDPA: rounding
            assert err <= 1e-5, (r, layer, site, err)


def _bitwise_runs(model, reqs, **kw):
    return serve(_engine(model, **kw), reqs)


@pytest.mark.skipif(kernels.native() is None, reason=f"native kernels: {kernels.status()}")
def test_native_step_is_bitwise_the_module_path_at_the_stream_sites(model):
    prompts = _prompts(4, seed=23)
    read = HiddenStateRead([0, 1], "all", STREAM_SITES)
    reqs = {str(i): (p, greedy(10, logprobs=3), _items(i) if i % 2 else None, read if i < 3 else None)
            for i, p in enumerate(prompts)}
    a = _bitwise_runs(model, reqs, decode_graphs="off")
    b = _bitwise_runs(model, reqs, native_step=False, decode_graphs="off")
    for r in reqs:
        assert a[r]["tokens"] == b[r]["tokens"] and a[r]["lp"] == b[r]["lp"], r  # every logprob, bitwise
        assert len(a[r]["hidden"]) == len(b[r]["hidden"])
        for x, y in zip(a[r]["hidden"], b[r]["hidden"]):
            assert x.positions == y.positions and torch.equal(x.values, y.values), r


def test_a_rows_stream_reads_batched_equal_its_reads_alone(model):
    """Batch invariance: the same request's reads (and tokens) next to other edited and reading traffic, under
    chunked prefill, equal what it gets alone, to the last bit."""
    prompts = _prompts(6, seed=24, lo=6, hi=22)
    read = HiddenStateRead([1, 0], "all", STREAM_SITES)
    reqs = {str(i): (p, greedy(8), _items(30 + i) if i % 3 else None, read if i % 2 == 0 else None)
            for i, p in enumerate(prompts)}
    batched = serve(_engine(model, max_num_batched_tokens=24), reqs, {r: int(r) // 2 for r in reqs})
    for r in ("0", "2", "4"):
        alone = serve(_engine(model), {r: reqs[r]})[r]
        assert batched[r]["tokens"] == alone["tokens"], r
        assert torch.equal(torch.cat([h.values for h in batched[r]["hidden"]]),
                           torch.cat([h.values for h in alone["hidden"]])), r
