"""Attention telemetry: what a decode row's softmax put on the sink tokens and on its top-k keys, recorded by the
decode attention kernels from the probabilities they compute anyway (csrc/attention_telemetry.h for the native
kernel, `triton_attention`'s TELEMETRY variant on CUDA); `reference` is the PyTorch definition the tests hold both to.

The quantities are /inspect's (model/probes): the sink mass of a row is its attention on its first `sink_len` keys
(token 0, Xiao et al.'s attention sink, or a kv_window's sink tokens); its top-k are the k largest weights, largest
first, ties to the earlier key, positions -1 and weights 0 past a context shorter than k. Only the rows whose `slot`
is >= 0 record anything; a decode call without telemetry runs the kernels' plain variant (no cost at all).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class AttentionTelemetry(NamedTuple):
    """One layer's telemetry outputs for a decode call over R rows, Rt of which record (Rt <= R)."""

    slot: Tensor  # (R,) int64: each decode row's slot j in the outputs, or -1
    sink_len: Tensor  # (Rt,) int64: leading keys counted as sinks, per slot
    sink_mass: Tensor  # (Rt, H) float32
    top_pos: Tensor  # (Rt, H, k) int64: key positions within the row's block table (cache positions)
    top_prob: Tensor  # (Rt, H, k) float32


def record(p: Tensor, lens: Tensor, tel: AttentionTelemetry) -> None:
    """p (R, H, S) the rows' softmax over S >= max(lens) keys (zero past each row's length) -> writes `tel`."""
    k = tel.top_pos.shape[-1]
    want = (tel.slot >= 0).nonzero().squeeze(1)  # decode rows that record
    if want.numel() == 0:
        return
    j, pr = tel.slot[want], p[want].float()  # (n,), (n, H, S)
    S = pr.shape[-1]
    keys = torch.arange(S, device=p.device)
    sinks = keys < tel.sink_len[j].unsqueeze(1)  # (n, S)
    tel.sink_mass[j] = (pr * sinks[:, None]).sum(-1)
    if S < k:
        pr = torch.nn.functional.pad(pr, (0, k - S))
    order = torch.sort(pr, dim=-1, descending=True, stable=True)  # stable: equal weights keep the earlier key
    top_p, top_i = order.values[..., :k], order.indices[..., :k]
    valid = top_i < lens[want].view(-1, 1, 1)
    tel.top_prob[j] = torch.where(valid, top_p, 0.0)
    tel.top_pos[j] = torch.where(valid, top_i, -1)


def reference(q: Tensor, k: Tensor, lens: Tensor, tel: AttentionTelemetry, first: Tensor | None = None,
              offset: int = 0, scale: float = 0.0) -> None:
    """The definition: q (R, H, E) the decode rows' queries, k (R, S, K, E) their gathered keys (cache positions
    offset..offset+S-1), lens (R,) -> softmax(scale q k^T) (scale 0: 1/sqrt(E)) over each row's keys [first[r],
    lens[r]) (first None: 0; a sliding window's), recorded into `tel` by cache position."""
    R, H, E = q.shape
    K = k.shape[2]
    kh = k.float().repeat_interleave(H // K, dim=2)  # (R, S, H, E): query head h reads KV head h // (H / K)
    scores = torch.einsum("rhe,rshe->rhs", q.float(), kh)  # (R, H, S)
    scores = scores * scale if scale else scores / E**0.5
    if offset:  # positions below the gathered ones: weight 0, so `record` indexes cache positions
        scores = torch.nn.functional.pad(scores, (offset, 0), value=float("-inf"))
    pos = torch.arange(scores.shape[-1], device=q.device)
    mask = (pos < lens.view(-1, 1, 1)) & (pos >= (first if first is not None else torch.zeros_like(lens)).view(-1, 1, 1))
    record(scores.masked_fill(~mask, float("-inf")).softmax(-1), lens, tel)
