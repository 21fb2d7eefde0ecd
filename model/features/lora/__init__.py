"""LoRA adapters served per row: the adapters, read from PEFT's or llama.cpp's files, and their math (adapters.py);
the feature the engine calls, holding one engine's loaded adapters and each step's part on every path
(feature.py); and the adapters as static per-row slots a captured decode graph reads (graph.py). The native step's
kernel is model/kernels/csrc/lora.cpp, its arguments the step part's."""

from model.features.lora.adapters import (SITES, TARGETS, LoRAAdapter, LoRAPart, LoRARows, hf_module, load_adapter,
                                          load_gguf_lora, load_peft, target)
from model.features.lora.feature import LoRA, StepLoRA, step_rows

__all__ = ["SITES", "TARGETS", "LoRA", "LoRAAdapter", "LoRAPart", "LoRARows", "StepLoRA", "hf_module", "load_adapter",
           "load_gguf_lora", "load_peft", "step_rows", "target"]
