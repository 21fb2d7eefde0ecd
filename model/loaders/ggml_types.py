"""ggml's tensor types: their ids, block sizes, and dequantization to float32 for the types no kernel serves.

The ids and (elements, bytes) per block are ggml's (`ggml/include/ggml.h` `enum ggml_type`, `ggml/src/ggml.c`
`type_traits`), as the `gguf` package lists them (`gguf.constants.GGMLQuantizationType`, `GGML_QUANT_SIZES`; tests
check they agree). They are here rather than imported from that package because importing `gguf` runs its whole
`__init__` (its writer, metadata and YAML modules, imported under the GIL beside the web stack's imports),
and a load of the types the kernels serve needs none of it. The package's numpy reference dequantization
(`gguf.quants`, ggml's `ggml-quants.c` in numpy) is imported only when a tensor of another type is dequantized.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np


class GGMLQuantizationType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


T = GGMLQuantizationType
# (elements per block, bytes per block)
GGML_QUANT_SIZES: dict[GGMLQuantizationType, tuple[int, int]] = {
    T.F32: (1, 4), T.F16: (1, 2), T.Q4_0: (32, 18), T.Q4_1: (32, 20), T.Q5_0: (32, 22), T.Q5_1: (32, 24),
    T.Q8_0: (32, 34), T.Q8_1: (32, 40), T.Q2_K: (256, 84), T.Q3_K: (256, 110), T.Q4_K: (256, 144),
    T.Q5_K: (256, 176), T.Q6_K: (256, 210), T.Q8_K: (256, 292), T.IQ2_XXS: (256, 66), T.IQ2_XS: (256, 74),
    T.IQ3_XXS: (256, 98), T.IQ1_S: (256, 50), T.IQ4_NL: (32, 18), T.IQ3_S: (256, 110), T.IQ2_S: (256, 82),
    T.IQ4_XS: (256, 136), T.I8: (1, 1), T.I16: (1, 2), T.I32: (1, 4), T.I64: (1, 8), T.F64: (1, 8),
    T.IQ1_M: (256, 56), T.BF16: (1, 2), T.TQ1_0: (256, 54), T.TQ2_0: (256, 66), T.MXFP4: (32, 17),
    T.NVFP4: (64, 36), T.Q1_0: (128, 18),
}
del T


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """A tensor's data as the reader views it (float types as their elements, the rest as their blocks' bytes) ->
    float32 values, as `gguf.quants.dequantize` gives them. F32 and F16 (a model's norms) here; every other type
    through that package. Raises NotImplementedError for a type it cannot dequantize."""
    if qtype == GGMLQuantizationType.F32:
        return data.view(np.float32)
    if qtype == GGMLQuantizationType.F16:
        return data.view(np.float16).astype(np.float32)
    from gguf.quants import dequantize as reference

    return reference(data, qtype)


__all__ = ["GGMLQuantizationType", "GGML_QUANT_SIZES", "dequantize"]
