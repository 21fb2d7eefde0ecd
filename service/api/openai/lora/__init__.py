"""LoRA adapters as the OpenAI-compatible face serves them, as vLLM does: the adapters served by name (served.py:
--lora-modules at start, loads and unloads while serving, each a `model` a request can name) and vLLM's load and
unload routes (routes.py). The adapters themselves are the engine's LoRA feature (model/features/lora/)."""

from service.api.openai.lora.served import ServedAdapters

__all__ = ["ServedAdapters"]
