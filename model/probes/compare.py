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
    """An EngineJob (the lens needs the model's final norm and head, which only the engine thread may run): both
    inspections' block outputs at the same positions -> a `LayerComparison` per selected block."""

    def __init__(self, model: Transformer, ref: ProbeResult, other: ProbeResult) -> None:
        if ref.token_ids != other.token_ids or ref.hidden_positions != other.hidden_positions:
            raise ValueError("the two inspections must read the same sequence at the same positions")
        if any(layer.hidden is None for layer in ref.layers + other.layers):
            raise ValueError("both inspections must read their block outputs (include hidden_states)")
        self.model, self.ref, self.other = model, ref, other
        self.layers: list[LayerComparison] = []

    @torch.inference_mode()
    def step(self, budget_s: float) -> bool:
        for a, b in zip(self.ref.layers, self.other.layers):
            ha, hb = a.hidden.float(), b.hidden.float()  # (P, D)
            delta = (hb - ha).norm(dim=-1)
            ref_norm = ha.norm(dim=-1)
            cosine = torch.nn.functional.cosine_similarity(ha, hb, dim=-1)
            dev, dtype = self.model.device, self.model.dtype
            la = self.model.logits(ha.to(dev, dtype)).float().log_softmax(-1)  # (P, V)
            lb = self.model.logits(hb.to(dev, dtype)).float().log_softmax(-1)
            kl = (la.exp() * (la - lb)).sum(-1).clamp_min(0.0).cpu()
            maps = None
            if a.maps is not None and b.maps is not None:
                maps = AttentionMaps(a.maps.mode, b.maps.values - a.maps.values, None, a.maps.rows)
            self.layers.append(LayerComparison(a.layer, delta, delta / ref_norm.clamp_min(1e-30), cosine, kl, maps))
        return True
