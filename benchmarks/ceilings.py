"""What the machine allows, measured on the loaded weights: the matmuls alone, with nothing else around them.

Decode of one token must multiply by every weight once, so the time of those matmuls at batch 1 bounds
single-stream decode; their throughput at the step's token budget bounds prefill and, with the workload's total
FLOPs, the concurrent run. Measured with the same `F.linear` calls and weight layouts the model uses.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from model.transformer import Transformer


def _weights(model: Transformer) -> list[torch.Tensor]:
    ws: list[torch.Tensor] = []
    for layer in model.layers:
        att, ffn = layer.attention, layer.feed_forward
        ws += [att.wqkv] if att.wqkv is not None else [att.wq.weight, att.wk.weight, att.wv.weight]
        ws += [att.wo.weight]
        ws += [ffn.w13] if ffn.w13 is not None else [ffn.w1.weight, ffn.w3.weight]
        ws += [ffn.w2.weight]
    return ws + [model.output.weight]


def _time_matmuls(ws: list[torch.Tensor], rows: int, reps: int, device: torch.device) -> float:
    """Seconds for one pass of `rows` tokens through every weight matrix."""
    xs = {w.shape[1]: torch.randn(1, rows, w.shape[1], dtype=w.dtype, device=device) for w in ws}
    for w in ws:  # warm-up
        F.linear(xs[w.shape[1]], w)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        for w in ws:
            F.linear(xs[w.shape[1]], w)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


@torch.inference_mode()
def measure(model: Transformer, prefill_rows: int, reps: int) -> dict:
    device = model.device
    ws = _weights(model)
    flops_per_token = 2 * sum(w.numel() for w in ws)
    decode_s = _time_matmuls(ws, 1, reps, device)
    prefill_s = _time_matmuls(ws, prefill_rows, max(1, reps // 8), device)
    return {
        "method": "F.linear over the model's own weight matrices (fused as loaded), random activations",
        "weight_bytes_per_token": sum(w.nbytes for w in ws),
        "matmul_gflop_per_token": flops_per_token / 1e9,
        "decode_matmul_ms_per_token": decode_s * 1e3,
        "decode_ceiling_tok_s": 1 / decode_s,
        "decode_weight_read_gb_s": sum(w.nbytes for w in ws) / decode_s / 1e9,
        "prefill_rows": prefill_rows,
        "prefill_matmul_gflop_s": flops_per_token * prefill_rows / prefill_s / 1e9,
        "prefill_ceiling_tok_s": prefill_rows / prefill_s,
    }


def workload_bound(ceil: dict, prompt_tokens: int, output_tokens: int) -> dict:
    """Matmul FLOPs of a whole concurrent run at the prefill rate: a throughput no scheduler can beat here."""
    gflop = ceil["matmul_gflop_per_token"] * (prompt_tokens + output_tokens)
    seconds = gflop / ceil["prefill_matmul_gflop_s"]
    return {"matmul_gflop": gflop, "min_seconds": seconds, "ceiling_tok_s": output_tokens / seconds}
