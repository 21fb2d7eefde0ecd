"""What the machine allows, measured on the loaded weights: the matmuls alone, with nothing else around them.

Decode of one token must multiply by every weight once, so the time of those matmuls at batch 1 bounds
single-stream decode; their throughput at the step's token budget bounds prefill and, with the workload's total
FLOPs, the concurrent run. Measured with the same kernels and weight layouts the model uses (`F.linear` over
float weights; a quantized layer's native kernel called directly, as the native decode step calls it from C++, or
its module where the native kernels are off). `read_bandwidth` measures the machine's own limit: a large-tensor
read.
"""

from __future__ import annotations

import time

import statistics

import torch

from model import kernels
from model.quantize import QuantLinear, StackedLinear, decode_bytes, linear_weights
from model.transformer import Transformer


def _in_features(w) -> int:
    return w.shape[1] if isinstance(w, torch.Tensor) else w.in_features


def _out_features(w) -> int:
    return w.shape[0] if isinstance(w, torch.Tensor) else w.out_features


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _matmul(w, native, rows: int):
    """x -> x W^T as a decode step runs it: the native kernel called directly where the step's native path calls
    it from C++ (no module call around it; a `StackedLinear`'s parts each by its own kernel, no concatenation, as the
    step writes each part's columns in place), else the model's own layer."""
    if native is not None and isinstance(w, QuantLinear) and rows <= w.kernel_row_limit(True):
        parts = list(w.parts) if isinstance(w, StackedLinear) else [w]
        if all(p.native_buffers() is not None for p in parts):
            calls = [(getattr(native, p.native_op), p.native_buffers()) for p in parts]
            return lambda x: [op(x.view(-1, w.in_features).float(), *buffers) for op, buffers in calls]
    return w


def time_matmuls(model: Transformer, rows: int, reps: int) -> float:
    """Seconds for one pass of `rows` tokens through every weight matrix, as the model multiplies by it."""
    ws, device = linear_weights(model), model.device
    xs = {k: torch.randn(1, rows, k, dtype=model.dtype, device=device) for k in {_in_features(w) for w in ws}}
    native = kernels.native() if device.type == "cpu" else None
    calls = [(_matmul(w, native, rows), xs[_in_features(w)]) for w in ws]
    with torch.inference_mode():
        for f, x in calls:  # warm-up
            f(x)
        _sync(device)
        start = time.perf_counter()
        for _ in range(reps):
            for f, x in calls:
                f(x)
        _sync(device)
    return (time.perf_counter() - start) / reps


def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights one decode token must read: every matrix once (quantized: what its kernel reads)."""
    return sum(decode_bytes(w) for w in linear_weights(model))


def read_bandwidth(device: torch.device | str = "cpu", mb: int = 512, reps: int = 5) -> float:
    """The machine's read bandwidth in GB/s, median of `reps` sums over a float32 tensor far larger than any cache."""
    device = torch.device(device)
    buf = torch.ones(mb * 2**20 // 4, device=device)
    buf.sum()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        buf.sum()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return buf.nbytes / statistics.median(times) / 1e9


def measure(model: Transformer, prefill_rows: int, reps: int) -> dict:
    ws = linear_weights(model)
    flops_per_token = 2 * sum(_in_features(w) * _out_features(w) for w in ws)
    decode_s = time_matmuls(model, 1, reps)
    prefill_s = time_matmuls(model, prefill_rows, max(1, reps // 8))
    return {
        "method": "the model's own weight matrices (fused as loaded, quantized if it is), random activations",
        "weight_bytes_per_token": weight_bytes_per_token(model),
        "matmul_gflop_per_token": flops_per_token / 1e9,
        "decode_matmul_ms_per_token": decode_s * 1e3,
        "decode_ceiling_tok_s": 1 / decode_s,
        "decode_weight_read_gb_s": weight_bytes_per_token(model) / decode_s / 1e9,
        "prefill_rows": prefill_rows,
        "prefill_matmul_gflop_s": flops_per_token * prefill_rows / prefill_s / 1e9,
        "prefill_ceiling_tok_s": prefill_rows / prefill_s,
    }


def workload_bound(ceil: dict, prompt_tokens: int, output_tokens: int) -> dict:
    """Matmul FLOPs of a whole concurrent run at the prefill rate: a throughput no scheduler can beat here."""
    gflop = ceil["matmul_gflop_per_token"] * (prompt_tokens + output_tokens)
    seconds = gflop / ceil["prefill_matmul_gflop_s"]
    return {"matmul_gflop": gflop, "min_seconds": seconds, "ceiling_tok_s": output_tokens / seconds}
