"""`SiteCapture`: the attention context of attribution's forwards, and `CaptureRun`, one such forward stepped a block
at a time on the engine thread (an `EngineJob`, model/engine/async_engine.py).

A capture forward runs the served modules over a whole sequence without a KV cache (causal attention over the
call's own tokens, `CausalAttention`'s SDPA call) and records, at chosen (layer, site)s, the activations the block
hands its context (model/transformer.py): the residual sites (D wide: attention_output, mlp_output, block_output)
and the head sites (per head, E wide: head_q, head_k, head_v before RoPE, head_output before wo); and for AtP*'s QK
fix, the rotated q and k the attention sees. With `grad`, each recorded activation also gets a zero tensor added to
it (a "probe", a leaf of autograd): the gradient of a metric with respect to a probe is its gradient with respect
to that activation (what TransformerLens' backward hooks return), and the forward's values do not change.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from model.attention import sdpa
from model.interventions import EDIT_SITES, HEAD_SITES
from model.features.lora import LoRAAdapter
from model.transformer import Transformer

IN_PLACE_SITES = ("head_q", "head_k", "head_v")  # views of the fused projection, edited in place


@dataclass
class SiteCapture:
    """Records `sites` of `layers` at `positions` (None: every position) in `values`; with `grad`, adds a probe to
    each (`probes`). `rotated`: layers whose rotated q, k (T, heads, E) to keep at `positions`; `patterns`: layers
    whose attention runs explicitly, softmax(q k^T / sqrt(E)) with a probe on the pattern (the QK fix reads the
    logits and the pattern's gradient). `adapter`: a LoRA adapter the forward runs under (model/features/lora/adapters.py), as a
    completion naming it does, or None (the base)."""

    sites: tuple[str, ...]
    layers: frozenset[int]
    positions: list[int] | None = None
    grad: bool = False
    rotated: frozenset[int] = frozenset()
    patterns: frozenset[int] = frozenset()
    values: dict[tuple[int, str], Tensor] = field(default_factory=dict)  # (P, D) or (P, heads, E) float32
    probes: dict[tuple[int, str], Tensor] = field(default_factory=dict)  # the activation's shape, zeros
    qk: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # layer -> q (P, H, E), k (P, K, E) float32
    attention: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # layer -> logits (H, T, T), probe
    adapter: LoRAAdapter | None = None

    def __post_init__(self) -> None:
        if unknown := set(self.sites) - set(EDIT_SITES + HEAD_SITES):  # (the sites a block hands its context)
            raise ValueError(f"sites: unknown {sorted(unknown)}")

    def _at(self, x: Tensor) -> Tensor:  # (1, T, ...) -> (P, ...) float32, a copy
        x = x[0] if self.positions is None else x[0, self.positions]
        return x.detach().float().clone()

    def edit(self, layer: int, site: str, x: Tensor) -> Tensor:
        if site not in self.sites or layer not in self.layers:
            return x
        self.values[(layer, site)] = self._at(x)
        if not self.grad:
            return x
        probe = torch.zeros(x.shape, dtype=x.dtype, device=x.device, requires_grad=True)
        self.probes[(layer, site)] = probe
        if site in IN_PLACE_SITES:
            return x.add_(probe)  # in place: the view's base, the fused projection, is what RoPE then rotates
        return x + probe

    def adapt(self, layer: int, site: str, x: Tensor, y: Tensor) -> Tensor:
        """x (1, T, in), y (1, T, out): every position under the adapter, if any (with autograd on, through
        PyTorch's ops: the native kernels have no backward)."""
        return y if self.adapter is None else self.adapter.apply(layer, site, x, y)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (1, T, H, E), k/v (1, T, K, E), rotated -> (1, T, H, E)."""
        if layer in self.rotated:
            self.qk[layer] = (self._at(q), self._at(k))
        if layer not in self.patterns:
            return sdpa(q, k, v, is_causal=True)
        T, H, E = q.shape[1], q.shape[2], q.shape[3]
        group = H // k.shape[2]
        kk, vv = k[0].repeat_interleave(group, 1), v[0].repeat_interleave(group, 1)  # (T, H, E): each head's KV head
        scores = torch.einsum("the,she->hts", q[0].float(), kk.float()) / math.sqrt(E)  # (H, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        pattern = scores.softmax(-1)  # (H, T, T) float32
        probe = torch.zeros_like(pattern, requires_grad=self.grad)
        self.attention[layer] = (scores.detach(), probe)
        out = torch.einsum("hts,she->the", pattern + probe, vv.float())  # (T, H, E)
        return out.to(q.dtype)[None]


class SteppedJob:
    """An `EngineJob` made of units of work (a block of a forward or of a backward): `step(budget_s)` runs units
    until about `budget_s` has passed (at least one; None: one) and returns True when the last has run."""

    done: bool
    elapsed: float = 0.0

    def unit(self) -> None:
        raise NotImplementedError

    def step(self, budget_s: float | None = None) -> bool:
        t0 = time.perf_counter()
        while not self.done:
            self.unit()
            if budget_s is None or time.perf_counter() - t0 >= budget_s:
                break
        self.elapsed += time.perf_counter() - t0
        return self.done

    def run(self):
        while not self.step():
            pass
        return self


class CaptureRun(SteppedJob):
    """One capture forward of `token_ids` (1 <= T), a block per unit of work. Afterwards: `capture` holds
    the recorded sites, `final` the last block's output (T, D), and with `keep_inputs` `inputs[l]` is block l's input
    (T, D) (what attribution patching recomputes each block's backward from). Runs without autograd (the native
    kernels serve it, as they serve completions)."""

    def __init__(self, model: Transformer, token_ids: list[int], capture: SiteCapture, keep_inputs: bool = False) -> None:
        if not token_ids:
            raise ValueError("nothing to run: the sequence is empty")
        self.model, self.token_ids, self.capture, self.keep_inputs = model, list(token_ids), capture, keep_inputs
        self.inputs: list[Tensor] = []
        self.final: Tensor | None = None
        self.next_layer = -1  # -1: the embedding comes next
        self.h: Tensor | None = None  # (1, T, D)

    @property
    def done(self) -> bool:
        return self.final is not None

    def embed(self) -> tuple[Tensor, Tensor, Tensor]:
        """The embedding's output (1, T, D) and the RoPE tables every block shares."""
        m, T = self.model, len(self.token_ids)
        tokens = torch.tensor([self.token_ids], device=m.device)  # (1, T)
        positions = torch.arange(T, device=m.device).unsqueeze(0)  # (1, T)
        return m.embed(tokens, positions)

    @torch.no_grad()
    def unit(self) -> None:
        """The embedding, or the next block."""
        m = self.model
        if self.next_layer < 0:
            self.h, self.cos, self.sin = self.embed()
            self.next_layer = 0
            return
        if self.keep_inputs:
            self.inputs.append(self.h[0])
        self.h = m.layers[self.next_layer](self.h, self.cos, self.sin, self.capture)  # (1, T, D)
        self.next_layer += 1
        if self.next_layer == len(m.layers):
            self.final, self.h = self.h[0], None
