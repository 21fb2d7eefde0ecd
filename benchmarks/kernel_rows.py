"""Where a quantized model's few-row kernels stop paying: a whole forward of M rows on the kernels vs on the
dequantize + float32 GEMM path, for each M (what `quantize.MAX_NATIVE_KERNEL_ROWS` is set from).

    .venv/bin/python -m benchmarks.kernel_rows [--quantization int4] [--rows 8 16 32 64 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from model import kernels
from model.loaders.checkpoint import load_model
from model.quantize import QUANTIZATIONS, QuantLinear


def forward_ms(model: torch.nn.Module, rows: int, kernel: bool, reps: int) -> float:
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.max_kernel_rows = (1 << 30) if kernel else 0
    ids = torch.randint(100, 5000, (1, rows))
    with torch.inference_mode():
        model(ids)  # warm-up
        start = time.perf_counter()
        for _ in range(reps):
            model(ids)
    return (time.perf_counter() - start) / reps * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernel_rows", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--quantization", choices=[q for q in QUANTIZATIONS if q != "none"], default="int4")
    p.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model, quantization=args.quantization).model
    print(f"{args.quantization}, {args.threads} threads, CPU kernels: {kernels.status()}; whole forward, ms")
    print(f"{'rows':>5} {'kernels':>9} {'dequant+GEMM':>13}")
    for rows in args.rows:
        print(f"{rows:>5} {forward_ms(model, rows, True, args.reps):>9.1f} {forward_ms(model, rows, False, args.reps):>13.1f}", flush=True)


if __name__ == "__main__":
    main()
