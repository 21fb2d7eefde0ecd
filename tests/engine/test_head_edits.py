"""Edits of single attention heads (model/interventions.py's head sites: head_q / head_k / head_v before RoPE,
head_output before wo) through the engine, on a tiny random GQA model: equal to an uncached forward whose attention
module edits the same head the same way; a step with head edits runs the module path (the fused native step and
the graphs leave it), and the rows beside it are bit-identical to a run with no edits anywhere; the prefix cache
keys blocks by the head edited; out-of-range heads are refused."""

from __future__ import annotations

import pytest
import torch

from model.attention import CausalAttention
from model.interventions import HeadShape, Intervention, InterventionPlan
from test_interventions import _engine, _prompts, greedy, serve

E = 16  # tiny_model: dim 64, 4 query heads, 2 KV heads


def _set(layer, site, head, positions, seed):
    g = torch.Generator().manual_seed(seed)
    return Intervention(layer, site, "set", positions, dims=tuple(range(E)), values=tuple(torch.randn(E, generator=g).tolist()),
                        head=head)


def _items(seed: int) -> list[Intervention]:
    """Every head site and op kind."""
    g = torch.Generator().manual_seed(seed)
    return [
        _set(0, "head_q", 1, "all", seed),
        _set(1, "head_k", 0, (2, 5), seed + 1),
        Intervention(0, "head_v", "add", "prompt", torch.randn(E, generator=g), head=1),
        Intervention(1, "head_output", "scale", "generated", dims=(0, 3, 7), factor=-3.0, head=2),
        Intervention(1, "head_output", "project_out", "all", torch.randn(E, generator=g), head=2),
    ]


class HeadEditing(CausalAttention):
    """The reference: an uncached forward whose attention module edits heads from each item's definition."""

    def __init__(self, items: list[Intervention], P: int) -> None:
        super().__init__(None)
        self.items, self.P = sorted(items, key=lambda it: it.op != "project_out"), P

    def edit(self, layer: int, site: str, x: torch.Tensor) -> torch.Tensor:
        for it in self.items:
            if it.layer != layer or it.site != site:
                continue
            for t in range(x.shape[1]):
                if not it.applies(t, self.P):
                    continue
                h = x[0, t, it.head]  # (E,), a view
                if it.op == "set":
                    h[list(it.dims)] = torch.tensor(it.values)
                elif it.op == "scale":
                    h[list(it.dims)] *= it.factor
                elif it.op == "add":
                    h += it.scale * it.vector
                else:
                    u = it.vector.double() / it.vector.double().norm()
                    h.copy_((h.double() - (h.double() @ u) * u).float())
        return x


def reference_greedy(model, prompt: list[int], items: list[Intervention], n: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            T = len(ids)
            ctx = HeadEditing(items, len(prompt))
            h, cos, sin = model.embed(torch.tensor([ids]), torch.arange(T)[None])
            for block in model.layers:
                h = block(h, cos, sin, ctx)
            ids.append(int(model.head(h)[0, -1].argmax()))
    return ids[len(prompt):]


def test_head_edits_equal_the_reference_and_run_the_module_path(model):
    prompts = _prompts(3, seed=11, lo=8, hi=20)
    items = {str(i): _items(20 + i) for i in range(3)}
    engine = _engine(model, decode_graphs="off")
    got = serve(engine, {r: (prompts[int(r)], greedy(6), items[r]) for r in items})
    assert engine.runner.path_counts["module"] > 0
    for r, its in items.items():
        assert got[r]["tokens"] == reference_greedy(model, prompts[int(r)], its, 6), r


def test_rows_beside_head_edits_are_bit_identical_to_a_run_with_none(model):
    prompts = _prompts(5, seed=12)
    edited = {"1", "3"}
    reqs = {str(i): (p, greedy(8, logprobs=3), _items(i) if str(i) in edited else None) for i, p in enumerate(prompts)}
    a = serve(_engine(model), reqs)
    b = serve(_engine(model), {r: (p, sp, None) for r, (p, sp, _) in reqs.items()})
    for r in reqs:
        if r in edited:
            assert a[r]["lp"] != b[r]["lp"]
        else:
            assert a[r] == b[r], r


def test_prefix_cache_keys_blocks_by_the_head():
    shape = HeadShape(4, 2, E)
    a = InterventionPlan([_set(0, "head_q", 1, (1,), 0)], 8, 2, 64, shape)
    b = InterventionPlan([_set(0, "head_q", 2, (1,), 0)], 8, 2, 64, shape)
    assert a.block_digest(0, 4) != b.block_digest(0, 4)
    assert a.block_digest(4, 8) is None


@pytest.mark.parametrize("item,field", [
    (Intervention(0, "head_k", "set", "all", dims=(0,), values=(1.0,), head=2), "head"),  # 2 KV heads
    (Intervention(0, "head_q", "set", "all", dims=(E,), values=(1.0,), head=0), "dims"),  # head_dim 16
    (Intervention(0, "block_output", "set", "all", dims=(0,), values=(1.0,), head=0), "head"),
    (Intervention(0, "head_v", "add", "all", torch.ones(64), head=0), "vector"),
])
def test_validation_names_the_field(item, field):
    with pytest.raises(ValueError, match=rf"\.{field}:"):
        InterventionPlan([item], 8, 2, 64, HeadShape(4, 2, E))
    if item.site != "block_output":
        with pytest.raises(ValueError, match=r"\.site:"):
            InterventionPlan([item], 8, 2, 64)  # without the model's heads, no head site is taken
