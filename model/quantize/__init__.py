"""Weight-only int8 / int6 / int4 linear layers for CPU, and the swap that installs them after a model is loaded
(int8 and int4 for any checkpoint; int6 only for a GGUF's Q6_K matrices, kept as the file holds them).

Decode reads every weight once per token, so its speed is weight bytes / memory bandwidth: about 1 byte per weight
(int8), 0.82 (int6) or 0.56-0.63 (int4) instead of 4 (float32) moves that ceiling about 4x / 5x / 6-7x. Activations
stay in the model's dtype; only the matmul kernels see quantized weights.

Formats (ggml's blocks of 32 along the input dim, so a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks map without rounding):
    int8  w[n, k] = q[n, k] * d[n, b]               q int8 in [-127, 127], d float16, b = k // 32   (GGUF Q8_0)
    int4  w[n, k] = q[n, k] * d[n, b] + m[n, b]     q in [0, 15], two per byte, d and m
          float16 (GGUF Q4_1; Q4_0's w = d (q - 8) is m = -8 d, so a GGUF file's Q4_0 and Q4_1 blocks map exactly:
          model/loaders/gguf_blocks.py); or Q4_K's own scales, d = D sc and m = -(Dmin mn) with D, Dmin float16 per
          256 weights and sc, mn a byte per 32 (`int4_k_scales`: exact, 4.625 bits a weight)
    int6  w[n, k] = (d[n, B] sc[n, k / 16]) (q[n, k] - 32)    q in [0, 63], sc int8, d float16, B = k // 256
          (GGUF Q6_K as the file holds it, 6.5625 bits a weight: served only from such files, `Int6Linear`)
All are stored 8 output rows interleaved, as the native kernels read them (model/kernels/csrc/qgemm.h): int4 by
`int4_layout`, int8 in chunks of 4 weights per output (its rows padded with zeros to a multiple of 8), int6 by
`int6_layout`; each block's scales (and int4's offsets) for the 8 outputs side by side.

Kernels, by what the machine has:
    native  model/kernels (C++, AVX2) `int4_linear` / `int6_linear` / `int8_linear`: the formats above against
            activations rounded to int8 blocks (llama.cpp's scheme), exact integer block sums; one kernel for any
            number of rows (decode and prefill), so a row's result never depends on its step (batch invariance)
    torch   without the native kernels: PyTorch's packed int4 kernel (`_weight_int4pack_mm_for_cpu`, bfloat16
            activations) up to 16 rows, else the weight dequantized to float32 and one float32 GEMM

Files, one job each: layouts.py (the kernels' packed buffers), rounding.py (float -> blocks), layers.py (the
modules), convert.py (the swap after loading).
"""

from model.quantize.convert import QUANTIZATIONS, Quantization, decode_bytes, linear_weights, quantize_model
from model.quantize.layers import (Int4Linear, Int6Linear, Int8Linear, QuantEmbedding, QuantLinear, RowPaddedLinear,
                                   StackedLinear, stack)
from model.quantize.layouts import (GROUP_SIZE, int4_k_scales, int4_layout, int4_nibbles, int6_layout, int6_rows,
                                    int6_values, int8_layout, joined)
from model.quantize.rounding import by_rows, int4_groups, int8_blocks, round_activations

__all__ = [
    "GROUP_SIZE", "QUANTIZATIONS", "Int4Linear", "Int6Linear", "Int8Linear", "QuantEmbedding", "QuantLinear",
    "Quantization", "RowPaddedLinear", "StackedLinear", "by_rows", "decode_bytes", "int4_groups", "int4_k_scales",
    "int4_layout", "int4_nibbles", "int6_layout", "int6_rows", "int6_values", "int8_blocks", "int8_layout", "joined",
    "linear_weights", "quantize_model", "round_activations", "stack",
]

