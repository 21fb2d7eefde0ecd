"""Attribution patching: every cell of an activation-patching sweep (model/probes/patching.py) estimated to first
order from one forward of each prompt and one backward of the target's.

Nanda 2023, "Attribution Patching: Activation Patching At Industrial Scale"; Syed, Rager, Conmy 2023, "Attribution
Patching Outperforms Automated Circuit Discovery". Patching activation a of the target run (the corrupted prompt
when denoising) with the source's value a' changes the metric by about

    m(patched) - m(target)  ~  (a' - a) . dm/da          (the gradient at the target run)

which is exact where m is linear in a, and degrades where a patch moves the model far (its error is second order in
a' - a). Kramár, Lieberum, Shah, Nanda 2024, "AtP*: An efficient and scalable method for localizing LLM behaviour to
components", section 3.1: the estimate fails worst for queries and keys where attention saturates (the softmax's
gradient vanishes while a finite change of one score can move the whole row). Their QK fix, done here for head_q
and head_k (`qk_fix`): recompute the patched attention pattern exactly, then go on linearly from the pattern,

    head_q, position p, head h    sum_j dm/dA[h, p, j] (softmax(s[h, p] + dq . K / sqrt(E))_j - A[h, p, j])
    head_k, position p, KV head g sum over g's query heads h and rows i >= p of the same, with only the score s[h, i, p]
                                  moved, by q[h, i] . dk / sqrt(E) (a closed form: one column of each row changes)

AtP*'s other correction, GradDrop (a backward per layer, against cancellation along paths), is not done: it costs
L backward passes where this costs one.

The work, as an `EngineJob` a block per unit (so the engine thread serves between units, as for /inspect):
capture forwards of the source and target prompts in the served precision (model/probes/capture.py: the swept sites
at the swept positions, the target's block inputs kept); the metric's gradient at the target's last position
(model/probes/logit_metric.py); then the blocks from the last down to the lowest swept one, each recomputed from
its kept input with autograd on (gradient checkpointing: one block's activations held at a time) and its gradient
passed down. Every recomputed block runs the served modules: float32 and bfloat16 weights through PyTorch's own ops
(the native kernels have no backward), a quantized layer's forward through its kernel and its backward through its
weight dequantized for the call (model/quantize/).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from model.features.lora import LoRAAdapter
from model.probes.capture import CaptureRun, SiteCapture, SteppedJob
from model.probes.logit_metric import metric_gradient, scored
from model.probes.patching import Cell, PatchSweep, metric
from model.quantize import QuantLinear
from model.transformer import Transformer

QK_SITES = ("head_q", "head_k")


class AttributionPatchingRun(SteppedJob):
    """Every cell of `sweep` estimated for patching `source_ids`' activations into `target_ids`' run (the clean
    prompt into the corrupted one when denoising): `estimates` {cell: m(patched) - m(target)} and `baselines` (the
    two runs' metrics) once done."""

    def __init__(self, model: Transformer, sweep: PatchSweep, source_ids: list[int], target_ids: list[int],
                 qk_fix: bool = True, keep_gradients: bool = False, adapter: LoRAAdapter | None = None) -> None:
        """`keep_gradients`: keep dm/da at every swept (layer, site) and position in `gradients` (the tests compare
        them with HF autograd's). `adapter`: a LoRA adapter both runs and the backward go under (model/features/lora/adapters.py)."""
        if len(source_ids) != len(target_ids) or len(source_ids) != sweep.num_tokens:
            raise ValueError("the two prompts must have the sweep's token count")
        self.model, self.sweep, self.adapter = model, sweep, adapter
        self.positions = sorted(sweep.positions)
        self.qk_layers = frozenset(sweep.layers) if qk_fix and set(QK_SITES) & set(sweep.sites) else frozenset()

        def capture() -> SiteCapture:
            return SiteCapture(tuple(sweep.sites), frozenset(sweep.layers), self.positions, rotated=self.qk_layers,
                               adapter=adapter)

        self.source = CaptureRun(model, source_ids, capture())
        self.target = CaptureRun(model, target_ids, capture(), keep_inputs=True)
        self.baselines: tuple[float, float] | None = None  # the metric of the source and target runs
        self.grad: Tensor | None = None  # (T, D): dm / d(the output of block next_back)
        self.next_back = model.config.n_layers - 1
        self.estimates: dict[Cell, float] = {}  # the estimated m(patched) - m(target)
        self.gradients: dict[tuple[int, str], Tensor] | None = {} if keep_gradients else None  # (P, D) / (P, heads, E)
        self.done = False

    @staticmethod
    def held_bytes(sweep: PatchSweep, config, qk_fix: bool = True) -> int:
        """What a run holds at most, before it starts: the two captures (every swept site's activation at the swept
        positions, float32; the rotated q, k for the QK fix), the target's block inputs, and one block's backward
        (its activations a few times over; with the QK fix its attention logits, pattern and their gradients,
        float32 and float64, H x T x T each)."""
        c, T, P = config, sweep.num_tokens, len(sweep.positions)
        H, K, E, D = c.n_heads, c.n_kv_heads, c.head_dim, c.dim
        width = {"head_q": H * E, "head_k": K * E, "head_v": K * E, "head_output": H * E}
        qk = qk_fix and bool(set(QK_SITES) & set(sweep.sites))
        per_position = sum(width.get(s, D) for s in sweep.sites) + ((H + K) * E if qk else 0)
        captures = 2 * 4 * per_position * P * len(sweep.layers)
        block = 4 * T * (8 * D + 2 * (H + 2 * K) * E + 4 * c.hidden_dim)
        patterns = (4 * 4 + 3 * 8) * H * T * T if qk else 0
        return captures + 4 * T * D * (c.n_layers + 2) + block + patterns

    @property
    def gradient_precision(self) -> str:
        """What the backward ran at: the activations' dtype, through PyTorch's ops; under quantized weights float32,
        each layer's weight dequantized for its call."""
        m = self.model
        if any(isinstance(mod, QuantLinear) for mod in m.modules()):
            return "float32 (each quantized layer's weight dequantized for its call)"
        return str(m.dtype).removeprefix("torch.")

    def values(self) -> list[float]:
        """The estimated metric of every cell, m(target) + estimate, in `sweep.cells()` order (the exact sweep's
        `raw`)."""
        target = self.baselines[1]
        return [target + self.estimates[c] for c in self.sweep.cells()]

    def unit(self) -> None:
        """A block of the source's or the target's forward, the metric's gradient, or a block of the backward."""
        s, m = self.sweep, self.model
        if not self.source.done:
            self.source.unit()
        elif not self.target.done:
            self.target.unit()
        elif self.grad is None:
            ids = s.score_token_ids()
            T = s.num_tokens
            self.baselines = (metric(s, scored(m, self.source.final[T - 1], ids)),
                              metric(s, scored(m, self.target.final[T - 1], ids)))
            self.grad = torch.zeros_like(self.target.final, dtype=torch.float32)  # (T, D)
            self.grad[T - 1] = metric_gradient(m, self.target.final[T - 1], s.metric, s.answer, s.contrast)
        elif self.next_back >= min(s.layers):
            self._backward(self.next_back)
            self.next_back -= 1
        else:
            self.target.inputs.clear()
            self.done = True

    def _backward(self, layer: int) -> None:
        """Block `layer` recomputed with autograd from its kept input: the gradient at its input (for the block
        below) and the estimates of its cells."""
        s, block = self.sweep, self.model.layers[layer]
        swept = layer in s.layers
        cap = SiteCapture(tuple(s.sites) if swept else (), frozenset([layer]), None, grad=True,
                          rotated=self.qk_layers & {layer}, patterns=self.qk_layers & {layer}, adapter=self.adapter)
        with torch.enable_grad():
            h = self.target.inputs[layer].detach().clone()[None].requires_grad_(True)  # (1, T, D)
            out = block(h, self.target.cos, self.target.sin, cap)  # (1, T, D)
            probes = [cap.probes[(layer, site)] for site in s.sites] if swept else []
            pattern = [cap.attention[layer][1]] if layer in self.qk_layers else []
            grads = torch.autograd.grad(out, [h, *probes, *pattern], self.grad[None].to(out.dtype), allow_unused=True)
        self.grad = grads[0][0].float()
        if not swept:
            return
        for site, g in zip(s.sites, grads[1 : 1 + len(s.sites)]):
            if g is None:  # (a site the metric does not depend on: a KV head no query reads after it)
                g = torch.zeros_like(cap.probes[(layer, site)])
            g = g[0, self.positions].double()  # (P, D) or (P, heads, E)
            if self.gradients is not None:
                self.gradients[(layer, site)] = g.float()
            delta = (self.source.capture.values[(layer, site)] - self.target.capture.values[(layer, site)]).double()
            est = (g * delta).sum(-1)  # (P,) or (P, heads)
            if site in QK_SITES and layer in self.qk_layers:
                est = self._qk_fix(layer, site, cap, grads[-1])
            self._store(layer, site, est)

    def _store(self, layer: int, site: str, est: Tensor) -> None:
        row = {p: i for i, p in enumerate(self.positions)}
        for h in self.sweep.heads_of(site):
            for p in self.sweep.positions:
                v = est[row[p]] if h is None else est[row[p], h]
                self.estimates[Cell(site, layer, p, h)] = float(v)

    def _qk_fix(self, layer: int, site: str, cap: SiteCapture, grad_pattern: Tensor) -> Tensor:
        """AtP*'s estimate for head_q / head_k at every swept position -> (P, H) or (P, K) float64."""
        scores = cap.attention[layer][0].double()  # (H, T, T): the target's attention logits (-inf above the diagonal)
        A, gA = scores.softmax(-1), grad_pattern.double()  # (H, T, T)
        q_t, k_t = (t.double() for t in cap.qk[layer])  # (T, H, E), (T, K, E): the target's, rotated
        q_src, k_src = (t.double() for t in self.source.capture.qk[layer])  # (P, H, E), (P, K, E)
        q_tgt, k_tgt = (t.double() for t in self.target.capture.qk[layer])
        H, E, K = A.shape[0], q_t.shape[-1], k_t.shape[1]
        group = H // K
        pos = torch.tensor(self.positions, device=A.device)
        if site == "head_q":
            # the rows p of the pattern, recomputed from their logits moved by the change of q: dq . K / sqrt(E)
            dq = q_src - q_tgt  # (P, H, E)
            kk = k_t.repeat_interleave(group, 1)  # (T, H, E)
            shift = torch.einsum("phe,the->hpt", dq, kk) / math.sqrt(E)  # (H, P, T)
            moved = (scores[:, pos] + shift).softmax(-1)  # (H, P, T): keys past p stay at -inf, weight 0
            return (gA[:, pos] * (moved - A[:, pos])).sum(-1).T  # (P, H)
        # head_k: for every query head h of KV head g and row i, column p's logit moves by q[h, i] . dk[p] / sqrt(E)
        dk = (k_src - k_tgt).repeat_interleave(group, 1)  # (P, H, E)
        delta = torch.einsum("the,phe->htp", q_t, dk) / math.sqrt(E)  # (H, T, P)
        a = A[:, :, pos]  # (H, T, P): each row's weight on key p
        g_p = gA[:, :, pos]
        c = (gA * A).sum(-1, keepdim=True)  # (H, T, 1)
        r = delta.clamp(max=700.0).exp()
        z = 1.0 - a + a * r  # the row's new normaliser, relative to the old
        est = (c - g_p * a + g_p * a * r) / z - c  # (H, T, P): rows i < p have a = 0 and give 0
        return est.sum(1).view(K, group, -1).sum(1).T  # (P, K)

