"""Checkpoint loaders: `checkpoint.load_model` is the entry point (HF directories, GGUF files, the default model).

Kept import-free so `model.config` can use `loaders.errors` without pulling in the loaders themselves.
"""
