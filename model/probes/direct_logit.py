"""Direct logit attribution: the last position's logit difference between an answer and a contrast token, split into
what each component of the residual stream writes into it directly.

The residual stream at the last block's output is a sum (model/transformer.py's pre-norm blocks):

    x_L = embed + sum_l (attn_l + mlp_l),    attn_l = wo_l(concat_h z_lh) = sum_h wo_l[:, h E : (h + 1) E] z_lh

with z_lh head h's output in block l before wo (the head_output site). The logit difference is linear in the normed
stream, logit(a) - logit(c) = (W[a] - W[c]) . final_norm(x_L), and RMSNorm is linear in x once its scale
s = 1 / rms(x_L) is frozen at the value the forward had: final_norm(x) = g * s * x. So with the direction

    u = g * s * (W[a] - W[c])      (D,), in the residual stream

every component's contribution is u . component, and they sum to the logit difference (up to rounding). This is
TransformerLens' `ActivationCache.logit_attrs` over `decompose_resid` / `stack_head_results` with
`apply_ln_to_stack` (the cached final scale); Elhage et al. 2021, "A Mathematical Framework for Transformer
Circuits" (the residual stream as a sum of paths). What the frozen scale leaves out: a component's effect through
the final norm's scale itself (adding it changes rms(x)), so a contribution is "direct", not the change in the
logit difference were that component removed (that is what activation patching measures).

Per head the term is u . wo_l[:, head] z_lh, with wo's weight in float32 (a quantized layer's dequantized for the
call). `remainder` per block is u . attn_l minus the sum of its heads: zero up to rounding for float weights
(LLaMA's wo has no bias); under a quantized wo, the kernel rounds the heads' outputs to int8 blocks before the
product, and the remainder is what that rounding adds. Under a LoRA adapter with targets on wo, wo_l is the
adapted map wo_l + scale B A (LoRA is linear in z, so the heads still split it). The served logit difference (the head as it serves, and
under a quantized head its own rounding) is reported beside the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from model.features.lora import LoRAAdapter
from model.probes.capture import CaptureRun, SiteCapture, SteppedJob
from model.probes.logit_metric import head_rows, scored
from model.quantize import QuantLinear
from model.transformer import Transformer


@dataclass
class DirectLogitResult:
    position: int  # the last position, where the metric is read
    logit_diff: float  # served: logit(answer) - logit(contrast) from the served head
    total: float  # the sum of every contribution below
    embedding: float
    heads: list[list[float]]  # [layer][head]
    mlp: list[float]  # [layer]
    attention: list[float]  # [layer]: u . attn_l, the heads and the remainder together
    remainder: list[float]  # [layer]: u . attn_l - sum of its heads
    final_norm_scale: float  # s = 1 / rms(x_L) at the last position, frozen


def dense_weight(layer: nn.Module) -> Tensor:
    """A linear layer's weight (out, in) in float32: a float layer's own, a quantized one's dequantized."""
    if isinstance(layer, nn.Linear):
        return layer.weight.detach().float()
    if isinstance(layer, QuantLinear):
        return layer.dequantize(torch.float32)
    raise TypeError(f"no weight of a layer of type {type(layer).__name__}")


class DirectLogitRun(SteppedJob):
    """An `EngineJob`: one capture forward of `token_ids` a block per unit of work (`CaptureRun`), then the
    attribution above at its last position; `result` once `step` returned True."""

    def __init__(self, model: Transformer, token_ids: list[int], answer: int, contrast: int,
                 adapter: LoRAAdapter | None = None, extra_sites: tuple[str, ...] = ()) -> None:
        """`adapter`: a LoRA adapter the forward runs under (model/features/lora/adapters.py); each block's wo is then
        wo + its delta. `extra_sites`: more sites to record at the last position (a dictionary's,
        model/probes/feature_attribution.py)."""
        c = model.config
        T = len(token_ids)
        self.model, self.token_ids, self.answer, self.contrast = model, list(token_ids), answer, contrast
        self.adapter = adapter
        sites = ("head_output", "attention_output", "mlp_output")
        capture = SiteCapture(sites + tuple(s for s in extra_sites if s not in sites), frozenset(range(c.n_layers)),
                              [T - 1], adapter=adapter)
        self.forward = CaptureRun(model, token_ids, capture)
        self.result: DirectLogitResult | None = None
        self.direction: Tensor | None = None  # (D,) float64: u above, once the forward is done

    @property
    def done(self) -> bool:
        return self.result is not None

    def unit(self) -> None:
        """A block of the forward; after the last, the attribution."""
        self.forward.unit()
        if self.forward.done:
            self.result = self._attribute()

    @torch.no_grad()
    def _attribute(self) -> DirectLogitResult:
        m, c, T = self.model, self.model.config, len(self.token_ids)
        values = self.forward.capture.values
        x = self.forward.final[T - 1].double()  # (D,): the last block's output at the last position
        rows = head_rows(m, torch.tensor([self.answer, self.contrast], device=x.device)).double()  # (2, D)
        scale = float(torch.rsqrt(x.float().pow(2).mean() + c.norm_eps))  # the RMSNorm's, in float32 as it runs
        u = m.norm.weight.detach().double() * scale * (rows[0] - rows[1])  # (D,)
        self.direction = u
        embed = m.tok_embeddings(torch.tensor([self.token_ids[-1]], device=x.device))[0]  # (D,)
        H, E = c.n_heads, c.head_dim
        heads, mlp, attention, remainder = [], [], [], []
        for layer, block in enumerate(m.layers):
            w = u @ self._wo(layer, block.attention.wo)  # (H E,): u through wo, per input column
            z = values[(layer, "head_output")][0].double()  # (H, E)
            per_head = (w.view(H, E) * z).sum(-1)  # (H,)
            a = float(u @ values[(layer, "attention_output")][0].double())
            heads.append(per_head.tolist())
            attention.append(a)
            remainder.append(a - float(per_head.sum()))
            mlp.append(float(u @ values[(layer, "mlp_output")][0].double()))
        embedding = float(u @ embed.double())
        a_lp, c_lp = scored(m, self.forward.final[T - 1], (self.answer, self.contrast))
        return DirectLogitResult(
            position=T - 1, logit_diff=a_lp - c_lp, total=embedding + sum(attention) + sum(mlp), embedding=embedding,
            heads=heads, mlp=mlp, attention=attention, remainder=remainder, final_norm_scale=scale)

    def _wo(self, layer: int, wo: nn.Module) -> Tensor:
        """Block `layer`'s wo (D, H E) in float64 as the forward applied it: under the adapter, plus each of its o
        targets' scale * B A on that target's rows."""
        w = dense_weight(wo).double()
        for p in self.adapter.parts.get((layer, "o"), []) if self.adapter is not None else []:
            w[p.start : p.stop] += p.scale * (p.BT.double().T @ p.A.double())  # (stop - start, H E)
        return w
