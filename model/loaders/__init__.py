"""Checkpoint loaders: `load_model` is the entry point (HF directories, GGUF files, the default model)."""

from model.loaders.checkpoint import LoadedModel, default_model_path, load_model, served_weight_bytes
from model.loaders.errors import CheckpointError

__all__ = ["CheckpointError", "LoadedModel", "default_model_path", "load_model", "served_weight_bytes"]
