"""A loaded model's linear layers swapped for quantized ones (`quantize_model`, `--quantization`), and what a
decode token reads through them (`linear_weights`, `decode_bytes`: the benchmarks' bandwidth ceilings)."""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

from model.quantize.layers import Int4Linear, Int8Linear, QuantEmbedding, QuantLinear, StackedLinear, stack
from model.quantize.layouts import GROUP_SIZE
from model.transformer import FUSED_PARTS

Quantization = Literal["none", "int8", "int4"]
QUANTIZATIONS: tuple[str, ...] = ("none", "int8", "int4")
_QUANT_CLASSES: dict[str, type[QuantLinear]] = {"int8": Int8Linear, "int4": Int4Linear}


def _quantized(name: str, weight: Tensor, cls: type[QuantLinear], prequantized: dict[str, QuantLinear]) -> QuantLinear:
    """The quantized form of our module `name`: mapped from the file when it has it (a fused module from its parts,
    stacked as `transformer.FUSED_PARTS` says, the parts released as they are stacked), else rounded from the float
    weight."""
    layer_prefix, suffix = name.rsplit(".", 2)[0], ".".join(name.rsplit(".", 2)[1:])  # "layers.0", "attention.wqkv"
    parts = [f"{layer_prefix}.{p}" for p in FUSED_PARTS.get(suffix, ())]
    if parts and all(p in prequantized for p in parts):
        return stack([prequantized.pop(p) for p in parts])  # (parts of differing formats: a StackedLinear)
    if name in prequantized:
        return prequantized.pop(name)
    if weight.is_meta:
        raise ValueError(f"{name}: no weight to quantize")
    return cls.from_float(weight)


def quantize_model(model: nn.Module, mode: Quantization, prequantized: dict[str, QuantLinear] | None = None) -> nn.Module:
    """Swap the model's linear layers for weight-only quantized ones, in place (module by module: whatever
    `nn.Linear` the blocks hold); returns the model.

    Every block's projections take `mode`; the LM head takes int8 in both modes, as llama.cpp keeps the default
    model's tied head in Q8_0: it is the largest matrix and the most sensitive to rounding. The embedding table is
    kept quantized too (`QuantEmbedding`): the head itself when the embeddings are tied, else int8 rows. `prequantized`
    (our names of the file's matrices, e.g. "layers.0.attention.wq", "output" for the head, "tok_embeddings" for the
    table) supplies layers mapped straight from a file's blocks; it is emptied as they are installed.
    """
    if mode == "none":
        return model
    if mode not in _QUANT_CLASSES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if model.device.type != "cpu":
        raise ValueError(f"quantization {mode!r} runs CPU kernels; the model is on {model.device}")
    cls, pre, dtype = _QUANT_CLASSES[mode], prequantized if prequantized is not None else {}, model.dtype
    # (a matrix whose input is not whole blocks of 32 stays in float)
    linears = [(name, m) for name, m in model.layers.named_modules(prefix="layers")
               if isinstance(m, nn.Linear) and m.in_features % GROUP_SIZE == 0]
    for name, module in linears:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, _quantized(name, module.weight, cls, pre))
    head = pre.pop("output", None) or _quantized("output", model.output.weight, Int8Linear, {})
    table = pre.pop("tok_embeddings", None)
    if table is None:
        tied = model.config.tie_embeddings and head.out_features == model.config.vocab_size
        table = head if tied else _quantized("tok_embeddings", model.tok_embeddings.weight, Int8Linear, {})
    model.output, model.tok_embeddings = head, QuantEmbedding(table, dtype, model.config.vocab_size)
    model.quantization = mode
    return model


def linear_weights(model: nn.Module) -> list[nn.Module]:
    """Every matrix a decode token multiplies by, as the model holds it (a float `nn.Linear` or a quantized module)."""
    parts = {id(p) for m in model.layers.modules() if isinstance(m, StackedLinear) for p in m.parts}
    return [m for m in model.layers.modules()
            if isinstance(m, (nn.Linear, QuantLinear)) and id(m) not in parts] + [model.output]


def decode_bytes(layer: nn.Module) -> int:
    """Bytes one decode token streams through this layer: what its kernel reads."""
    return layer.decode_bytes if isinstance(layer, QuantLinear) else layer.weight.nbytes
