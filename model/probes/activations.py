"""Massive activations (Sun et al. 2024) in one block's output: the entries far above the block's median magnitude."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from model.probes.options import ActivationEntry, ProbeOptions

@dataclass
class BlockActivations:
    max_abs: float
    median_abs: float
    top: list[ActivationEntry]
    massive: list[ActivationEntry]
    num_massive: int
    flagged: Tensor  # (N, 2) (token, dim) of every flagged entry


def massive_activations(h: Tensor, opts: ProbeOptions) -> BlockActivations:
    """h (T, D): one block's output."""
    mag = h.float().abs()  # (T, D)
    D = mag.shape[1]
    median = mag.median().item()  # over all tokens x dims, as in the paper's code (torch.median: the lower middle)
    flag = (mag > opts.massive_threshold) & (mag >= opts.massive_ratio * median)  # (T, D)

    def entries(flat_idx: Tensor) -> list[ActivationEntry]:
        out = []
        for i in flat_idx.tolist():
            t, d = divmod(i, D)
            value = h[t, d].item()
            out.append(ActivationEntry(t, d, value, abs(value) / median if median > 0 else None, bool(flag[t, d])))
        return out

    flat = mag.flatten()
    top = flat.topk(min(opts.massive_top_k, flat.numel())).indices
    flagged = flag.flatten().nonzero().squeeze(1)
    listed = flagged[flat[flagged].topk(min(opts.massive_max_entries, flagged.numel())).indices]  # largest first
    return BlockActivations(mag.max().item(), median, entries(top), entries(listed), flagged.numel(),
                            flag.nonzero().cpu())
