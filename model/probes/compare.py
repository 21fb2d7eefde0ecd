"""One sequence inspected under two weight sets (the base model and a LoRA adapter, or two adapters): what the
adapter changed inside, block by block. Each side is an ordinary inspection (`ProbeRun`, with its block outputs
read); this compares them: how far the residual stream moved at every position (the norm of the difference, that
norm relative to the reference's, the cosine), how each selected head's attention map changed, and how far apart
the logit lens reads (nostalgebraist 2020: each block's output through the final norm and the head) as the KL
divergence KL(reference || other) of the two next-token distributions. Differences are other minus reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model.probes.options import AttentionMaps, ProbeResult
from model.transformer import Transformer


@dataclass
class LayerComparison:
    layer: int
    delta_norm: Tensor  # (P,) ||h_other - h_ref|| at each compared position
    relative: Tensor  # (P,) delta_norm / ||h_ref||
    cosine: Tensor  # (P,) cos(h_ref, h_other)
    lens_kl: Tensor  # (P,) KL(ref lens || other lens), nats
    maps: AttentionMaps | None = None  # the other's maps minus the reference's (same mode and layout), if read


class CompareRun:
    """An EngineJob (the lens needs the model's final norm and head, which only the engine thread may run): the
    reference's and each other inspection's block outputs at the same positions -> per other, a `LayerComparison`
    per selected block (`comparisons`). The reference's lens is read once for all of them."""

    def __init__(self, model: Transformer, ref: ProbeResult, others: list[ProbeResult]) -> None:
        for other in others:
            if ref.token_ids != other.token_ids or ref.hidden_positions != other.hidden_positions:
                raise ValueError("the inspections must read the same sequence at the same positions")
        if any(layer.hidden is None for r in (ref, *others) for layer in r.layers):
            raise ValueError("every inspection must read its block outputs (include hidden_states)")
        self.model, self.ref, self.others = model, ref, others
        self.comparisons: list[list[LayerComparison]] = [[] for _ in others]

    def _lens(self, h: Tensor) -> Tensor:  # (P, D) -> (P, V) log-probabilities
        return self.model.logits(h.to(self.model.device, self.model.dtype)).float().log_softmax(-1)

    @torch.inference_mode()
    def step(self, budget_s: float) -> bool:
        for i, a in enumerate(self.ref.layers):
            ha = a.hidden.float()  # (P, D)
            ref_norm, la = ha.norm(dim=-1), self._lens(ha)
            for out, other in zip(self.comparisons, self.others):
                b = other.layers[i]
                hb = b.hidden.float()
                delta = (hb - ha).norm(dim=-1)
                cosine = torch.nn.functional.cosine_similarity(ha, hb, dim=-1)
                kl = (la.exp() * (la - self._lens(hb))).sum(-1).clamp_min(0.0).cpu()
                maps = None
                if a.maps is not None and b.maps is not None:
                    maps = AttentionMaps(a.maps.mode, b.maps.values - a.maps.values, None, a.maps.rows)
                out.append(LayerComparison(a.layer, delta, delta / ref_norm.clamp_min(1e-30), cosine, kl, maps))
        return True
