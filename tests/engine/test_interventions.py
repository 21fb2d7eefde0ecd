"""Interventions and hidden-state reads in the engine, on a tiny random model (model/interventions.py,
model/edits.py): each row gets its own sequence's edits on every path the runner can choose (module, native fused
decode, the static-buffer graph step), equal to a forward with hooks doing the same; rows without edits are
bit-identical to a run with none anywhere; batched equals alone under chunked prefill, prefix sharing and
preemption; the prefix cache never serves a block computed under other edits; reads equal the block outputs."""

from __future__ import annotations

import random

import pytest
import torch

from model import kernels
from model.edits import apply_reference
from model.engine import Engine, EngineConfig, RequestOptions
from model.engine.sampling_params import SamplingParams
from model.interventions import HiddenStateRead, Intervention, InterventionPlan
from test_engine import assert_pool_clean
from tiny import byte_tokenizer

D, L = 64, 2
native_only = pytest.mark.skipif(kernels.native() is None, reason=f"native kernels: {kernels.status()}")


def _vec(seed: int, norm: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(D, generator=g)
    return v / v.norm() * norm


def _prompts(n: int, seed: int, lo: int = 5, hi: int = 30, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _mixed(seed: int) -> list[Intervention]:
    """Every op and site, positions of every kind."""
    return [
        Intervention(0, "attention_output", "add", "all", _vec(seed), scale=0.7),
        Intervention(0, "mlp_output", "scale", "prompt", dims=(1, 5, 9), factor=-2.0),
        Intervention(1, "block_output", "set", (0, 3, 40), dims=(7,), values=(4.5,)),
        Intervention(1, "block_output", "project_out", "generated", _vec(seed + 1)),
        Intervention(1, "mlp_output", "add", "generated", _vec(seed + 2), scale=1.5),
    ]


# ---- the reference: an uncached forward with hooks doing each edit as it reads -------------------------------


def _hook_edit(items: list[Intervention], P: int):
    """A forward hook applying `items` (one layer and site) to positions 0..T-1 of a (1, T, D) output, each item
    as its definition reads (project_out first, then the rest in order)."""
    ordered = sorted(items, key=lambda it: it.op != "project_out")

    def hook(module, args, out):
        out = out.clone()
        for t in range(out.shape[1]):
            for it in ordered:
                if not it.applies(t, P):
                    continue
                x = out[0, t]
                if it.op == "add":
                    x = x + it.scale * it.vector
                elif it.op == "set":
                    x[list(it.dims)] = torch.tensor(it.values)
                elif it.op == "scale":
                    x[list(it.dims)] = x[list(it.dims)] * it.factor
                else:
                    u = it.vector.double() / it.vector.double().norm()
                    x = (x.double() - (x.double() @ u) * u).float()
                out[0, t] = x
        return out
    return hook


def hooked_greedy(model, prompt: list[int], items: list[Intervention], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits of every position, by full uncached forwards with hooks."""
    P, handles = len(prompt), []
    sites = {}
    for it in items:
        sites.setdefault((it.layer, it.site), []).append(it)
    for (layer, site), its in sites.items():
        block = model.layers[layer]
        module = {"block_output": block, "attention_output": block.attention, "mlp_output": block.feed_forward}[site]
        handles.append(module.register_forward_hook(_hook_edit(its, P)))
    ids = list(prompt)
    try:
        with torch.inference_mode():
            for _ in range(n):
                logits = model(torch.tensor([ids]))[0]
                ids.append(int(logits[-1].argmax()))
    finally:
        for h in handles:
            h.remove()
    return ids[P:], logits.log_softmax(-1)


def _engine(model, **kw) -> Engine:
    cfg = dict(num_blocks=96, block_size=4, max_num_seqs=16, max_num_batched_tokens=48)
    cfg.update(kw)
    return Engine(model, byte_tokenizer(), EngineConfig(**cfg))


def serve(engine: Engine, requests: dict[str, tuple], arrive_at: dict[str, int] | None = None) -> dict[str, dict]:
    """requests: id -> (prompt, params, interventions, hidden-state read); each joins at its `arrive_at` step."""
    out: dict[str, dict] = {}
    pending, step = dict(requests), 0
    while pending or engine.has_unfinished():
        for rid in [r for r in pending if (arrive_at or {}).get(r, 0) <= step]:
            prompt, params, *extra = pending.pop(rid)
            options = RequestOptions(interventions=extra[0] if extra else None,
                                     hidden_states=extra[1] if len(extra) > 1 else None)
            engine.add_request(rid, prompt, params, options)
        for o in engine.step():
            r = out.setdefault(o.request_id, {"tokens": [], "lp": [], "prompt_lp": None, "hidden": [], "cached": 0})
            r["tokens"] += o.token_ids
            r["lp"] += [(lp.logprob, lp.top) for lp in o.logprobs or []]
            if o.prompt_logprobs is not None:
                r["prompt_lp"] = [lp.logprob if lp else None for lp in o.prompt_logprobs]
            if o.hidden_states is not None:
                r["hidden"].append(o.hidden_states)
            r["cached"] = o.num_cached_tokens
        step += 1
        assert step < 5000
    return out


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


# ---- the plan ---------------------------------------------------------------------------------------------------


def test_validation_names_the_field():
    cases = [
        (Intervention(2, vector=_vec(0)), r"interventions\[0\].layer: 2 is out of range"),
        (Intervention(0, vector=torch.zeros(5)), r"interventions\[0\].vector: has 5 values"),
        (Intervention(0, vector=torch.full((D,), float("nan"))), r"interventions\[0\].vector: must be finite"),
        (Intervention(0, op="set", dims=(1, 2), values=(0.0,)), r"interventions\[0\].values: give one value per dim"),
        (Intervention(0, op="scale", dims=(D,)), r"interventions\[0\].dims: dimensions must be in"),
        (Intervention(0, op="project_out", vector=torch.zeros(D)), r"interventions\[0\].vector: project_out needs a non-zero"),
        (Intervention(0, site="residual", vector=_vec(0)), r"interventions\[0\].site: unknown"),
        (Intervention(0, positions=(-1,), vector=_vec(0)), r"interventions\[0\].positions"),
    ]
    for item, message in cases:
        with pytest.raises(ValueError, match=message):
            InterventionPlan([item], 5, L, D)
    twice = [Intervention(1, op="project_out", vector=_vec(1)), Intervention(1, op="project_out", vector=_vec(2))]
    with pytest.raises(ValueError, match=r"interventions\[1\].op: one project_out per block and site"):
        InterventionPlan(twice, 5, L, D)


def test_block_digests_cover_exactly_the_positions_edited():
    P, bs = 10, 4
    at_5 = InterventionPlan([Intervention(0, positions=(5,), vector=_vec(0))], P, L, D)
    assert at_5.block_digest(0, 4) is None and at_5.block_digest(4, 8) is not None and at_5.block_digest(8, 12) is None
    gen = InterventionPlan([Intervention(0, positions="generated", vector=_vec(0))], P, L, D)
    assert gen.block_digest(4, 8) is None and gen.block_digest(8, 12) is not None  # positions 10, 11 are generated
    prompt = InterventionPlan([Intervention(0, positions="prompt", vector=_vec(0))], P, L, D)
    assert prompt.block_digest(8, 12) != InterventionPlan([Intervention(0, positions="prompt", vector=_vec(0))], 11, L, D).block_digest(8, 12)
    other = InterventionPlan([Intervention(0, positions=(5,), vector=_vec(1))], P, L, D)
    assert other.block_digest(4, 8) != at_5.block_digest(4, 8)  # another vector, another digest
    same = InterventionPlan([Intervention(0, positions=(5,), vector=_vec(0))], P, L, D)
    assert same.block_digest(4, 8) == at_5.block_digest(4, 8)  # equal edits: the block is shared
    del bs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@native_only
def test_native_apply_equals_the_reference(dtype):
    """The native kernel against model/edits.py's definition: affine entries bitwise, projections to rounding."""
    g = torch.Generator().manual_seed(0)
    N, V = 37, 9
    x = (torch.randn(N, D, generator=g) * 50).to(dtype)
    bank = torch.randn(V, D, generator=g)
    bank[0] /= bank[0].norm()
    rows = torch.randperm(N, generator=g)[:20]
    ops = torch.stack([rows, torch.randint(-1, 1, (20,), generator=g), torch.randint(-1, V, (20,), generator=g),
                       torch.randint(-1, V, (20,), generator=g)], 1)
    affine = ops.clone()
    affine[:, 1] = -1
    for table, exact in ((affine, True), (ops, False)):
        a, b = x.clone(), x.clone()
        kernels.native().apply_edits(a, table.contiguous(), bank)
        apply_reference(b, table, bank)
        untouched = torch.ones(N, dtype=torch.bool)
        untouched[table[:, 0]] = False
        assert torch.equal(a[untouched], x[untouched])
        if exact:
            assert torch.equal(a, b)
        else:
            assert torch.allclose(a.float(), b.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-4)


# ---- every path equals the hooked forward -----------------------------------------------------------------------


PATHS = {"module": dict(native_step=False, decode_graphs="off"), "native": dict(decode_graphs="off"),
         "graph": dict(decode_graphs="eager")}


@pytest.mark.parametrize("path", list(PATHS))
def test_each_path_equals_a_hooked_forward(model, path):
    if path != "module" and kernels.native() is None:
        pytest.skip("native kernels unavailable")
    prompts = _prompts(3, seed=1, lo=18, hi=28)
    items = {str(i): _mixed(10 * i) for i in range(3)}
    engine = _engine(model, **PATHS[path])
    got = serve(engine, {r: (prompts[int(r)], greedy(8, prompt_logprobs=0), items[r]) for r in items})
    counts = engine.runner.path_counts
    assert counts[{"module": "module", "native": "native", "graph": "cuda_graph"}[path]] > 0, counts
    for r, its in items.items():
        tokens, logprobs = hooked_greedy(model, prompts[int(r)], its, 8)
        assert got[r]["tokens"] == tokens, r
        P = len(prompts[int(r)])
        want = logprobs[torch.arange(P - 1), torch.tensor(prompts[int(r)][1:])].tolist()
        assert got[r]["prompt_lp"][1:] == pytest.approx(want, abs=1e-4)


@native_only
def test_native_decode_is_bitwise_the_module_path_with_edits(model):
    prompts = _prompts(4, seed=2)
    reqs = {str(i): (p, greedy(10, logprobs=3), _mixed(i) if i % 2 else None) for i, p in enumerate(prompts)}
    a = serve(_engine(model, decode_graphs="off"), reqs)
    b = serve(_engine(model, native_step=False, decode_graphs="off"), reqs)
    for r in reqs:
        assert a[r]["tokens"] == b[r]["tokens"] and a[r]["lp"] == b[r]["lp"], r  # every logprob, bitwise


@pytest.mark.parametrize("path", list(PATHS))
def test_rows_without_edits_are_bit_identical_to_a_run_with_none(model, path):
    """The same steps, once with edits on some rows and once with none anywhere: the other rows' logprobs are equal
    to the last bit."""
    if path != "module" and kernels.native() is None:
        pytest.skip("native kernels unavailable")
    prompts = _prompts(6, seed=3)
    edited = {"0", "3", "4"}
    with_edits = {str(i): (p, greedy(10, logprobs=4, prompt_logprobs=2), _mixed(i) if str(i) in edited else None)
                  for i, p in enumerate(prompts)}
    without = {r: (p, sp, None) for r, (p, sp, _) in with_edits.items()}
    a, b = serve(_engine(model, **PATHS[path]), with_edits), serve(_engine(model, **PATHS[path]), without)
    for r in with_edits:
        if r in edited:
            assert a[r]["tokens"] != b[r]["tokens"] or a[r]["lp"] != b[r]["lp"]  # the edits did something
        else:
            assert a[r] == b[r], r


# ---- batched equals alone; the prefix cache --------------------------------------------------------------------


def test_batched_equals_alone_with_chunked_prefill_prefix_sharing_and_preemption(model):
    """16 concurrent requests, 12 of them with distinct interventions, sharing a 12-token prefix, arriving over
    time on a pool small enough to preempt, prefill chunked by a 24-token step budget: each request's tokens equal
    what it produces alone."""
    prompts = _prompts(16, seed=4, lo=4, hi=20, prefix=list(b"common prefix"))
    items = {str(i): _mixed(100 + i) if i < 12 else None for i in range(16)}
    reqs = {r: (prompts[int(r)], greedy(14), items[r]) for r in items}
    engine = _engine(model, num_blocks=44, max_num_batched_tokens=24)
    batched = serve(engine, reqs, {r: int(r) // 2 for r in reqs})
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.num_cached_prompt_tokens > 0  # the unedited and prompt-untouched prefixes were shared
    assert engine.runner.path_counts["native" if kernels.native() else "module"] > 0
    assert_pool_clean(engine)
    for r, req in reqs.items():
        alone = serve(_engine(model), {r: req})
        assert batched[r]["tokens"] == alone[r]["tokens"], r


def test_prefix_cache_never_crosses_interventions(model):
    """The same prompt with and without an edit at position 2, in both orders: each answer is the one it gets alone,
    and the second request reuses the first's blocks only where they were computed the same way."""
    prompt = _prompts(1, seed=5, lo=22, hi=22)[0]
    edit = [Intervention(0, positions=(2,), vector=_vec(7, norm=100.0))]
    late = [Intervention(0, positions=(13,), vector=_vec(7, norm=100.0))]  # block 3 (positions 12..15) onwards
    alone = {name: serve(_engine(model), {"x": (prompt, greedy(8), its)})["x"]["tokens"]
             for name, its in (("plain", None), ("edit", edit), ("late", late))}
    assert alone["plain"] != alone["edit"]
    for first, second in (("plain", "edit"), ("edit", "plain"), ("plain", "late")):
        engine = _engine(model)
        its = {"plain": None, "edit": edit, "late": late}
        a = serve(engine, {"a": (prompt, greedy(8), its[first])})["a"]
        b = serve(engine, {"b": (prompt, greedy(8), its[second])})["b"]
        assert (a["tokens"], b["tokens"]) == (alone[first], alone[second]), (first, second)
        # position 2 lies in block 0: nothing in common; an edit at 13 leaves blocks 0..2 (12 tokens) shareable
        assert b["cached"] == (12 if second == "late" else 0), (first, second, b["cached"])


# ---- reads ------------------------------------------------------------------------------------------------------


def _block_outputs(model, ids: list[int], items: list[Intervention] | None, P: int) -> torch.Tensor:
    """(T, L, D): every block's output over `ids` (hooked edits applied), from one uncached forward."""
    seen, handles, sites = {}, [], {}
    for it in items or []:
        sites.setdefault((it.layer, it.site), []).append(it)
    for (layer, site), its in sites.items():  # edits first: hooks run in the order they were registered
        block = model.layers[layer]
        module = {"block_output": block, "attention_output": block.attention, "mlp_output": block.feed_forward}[site]
        handles.append(module.register_forward_hook(_hook_edit(its, P)))
    handles += [model.layers[l].register_forward_hook(lambda m, a, o, l=l: seen.__setitem__(l, o[0].clone()))
                for l in range(L)]
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return torch.stack([seen[l] for l in range(L)], 1)


@pytest.mark.parametrize("path", list(PATHS))
def test_hidden_states_equal_the_block_outputs(model, path):
    """Reads at "last", "all" and explicit positions, batched with other traffic, through preemption: each
    position once, equal to the block outputs of an uncached forward over the final sequence."""
    if path != "module" and kernels.native() is None:
        pytest.skip("native kernels unavailable")
    prompts = _prompts(6, seed=6, lo=8, hi=20)
    reads = {"0": HiddenStateRead([1], "last"), "1": HiddenStateRead([0, 1], "all"),
             "2": HiddenStateRead([1, 0], (0, 3, 9, 21)), "3": None, "4": HiddenStateRead([0], "all"), "5": None}
    items = {"1": _mixed(1), "4": _mixed(4)}
    reqs = {r: (prompts[int(r)], greedy(10), items.get(r), reads[r]) for r in reads}
    engine = _engine(model, num_blocks=24, max_num_batched_tokens=16, **PATHS[path])
    got = serve(engine, reqs, {r: int(r) for r in reqs})
    assert engine.scheduler.num_preemptions > 0
    for r, read in reads.items():
        if read is None:
            assert got[r]["hidden"] == []
            continue
        P, seq = len(prompts[int(r)]), prompts[int(r)] + got[r]["tokens"]
        want = _block_outputs(model, seq[:-1], items.get(r), P)  # every computed position
        hs = got[r]["hidden"]
        positions = [p for h in hs for p in h.positions]
        if read.positions == "last":
            expected = list(range(P - 1, len(seq) - 1))
        elif read.positions == "all":
            expected = list(range(len(seq) - 1))
        else:
            expected = [p for p in read.positions if p < len(seq) - 1]
        assert positions == expected, r
        values = torch.cat([h.values for h in hs])  # (n, layers, D)
        assert hs[0].layers == read.layers
        ref = want[positions][:, read.layers]
        err = (values - ref).abs().max() / ref.abs().max()  # paged attention vs SDPA: rounding order only
        assert err <= 1e-5, (r, err)
        if read.positions == "last":  # one per generated token, delivered with it
            assert len(hs) == len(got[r]["tokens"])
