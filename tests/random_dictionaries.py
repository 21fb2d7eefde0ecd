"""Random sparse autoencoders built in memory (model/features/sae/dictionary.py's `Dictionary`) for the steering
tests: every activation the encoder has, at any site, with the options that change its math (normalization,
`apply_b_dec_to_input`), scaled so a good share of features fire on a tiny random model's activations."""

from __future__ import annotations

import torch

from model.features.sae import Dictionary
from model.hook_names import Hook


def random_dictionary(activation: str, layer: int = 1, site: str = "block_output", dim: int = 64, n_features: int = 48,
                      seed: int = 0, normalize: str = "none", apply_b_dec: bool = False, k: int = 4,
                      input_scale: float = 1.0) -> Dictionary:
    """`input_scale`: the typical norm of the activations it will read (its encoder is scaled to give them
    pre-activations of order one)."""
    g = torch.Generator().manual_seed(seed)
    W_enc = torch.randn(dim, n_features, generator=g) / input_scale
    if normalize != "none":
        W_enc = torch.randn(dim, n_features, generator=g) / dim ** 0.5
    W_dec = torch.randn(n_features, dim, generator=g)
    W_dec = W_dec / W_dec.norm(dim=-1, keepdim=True)
    extra = {}
    if activation == "jumprelu":
        extra["threshold"] = torch.rand(n_features, generator=g) * 0.5
    if activation == "gated":
        extra["b_mag"] = torch.randn(n_features, generator=g) * 0.1
        extra["r_mag"] = torch.randn(n_features, generator=g) * 0.2
    if activation in ("topk", "groupmax"):
        extra["k"] = k
    hook = Hook(layer, site)
    return Dictionary(W_enc=W_enc, b_enc=torch.randn(n_features, generator=g) * 0.2, W_dec=W_dec,
                      b_dec=torch.randn(dim, generator=g) * 0.1, hook_in=hook, hook_out=hook, activation=activation,
                      apply_b_dec_to_input=apply_b_dec, normalize_activations=normalize, source="test", **extra)


def sometimes_active(d: Dictionary, x: torch.Tensor) -> int:
    """A feature of `d` active at some rows of x (T, D) and inactive at others (its clamp then both raises and
    lowers it): the one closest to half the rows."""
    on = (d.encode(x) > 0).float().mean(0)  # (F,)
    F = int((on - 0.5).abs().argmin())
    assert 0 < on[F] < 1, f"no feature of this dictionary is active at some rows only: {on}"
    return F


def save_saelens(folder, d: Dictionary, architecture: str, hook_name: str, hook_name_out: str | None = None):
    """`d` written in SAELens 6's format (cfg.json + sae_weights.safetensors, model/features/sae/saelens.py reads
    it), as a server's `--sae NAME=PATH` names it -> the folder."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"W_enc": d.W_enc, "b_enc": d.b_enc, "W_dec": d.W_dec, "b_dec": d.b_dec}
    if d.threshold is not None:
        tensors["threshold"] = d.threshold
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "sae_weights.safetensors")
    meta = {"hook_name": hook_name, "sae_lens_version": "6.54.12"}
    if hook_name_out is not None:
        meta["hook_name_out"] = hook_name_out
    cfg = {"architecture": architecture, "d_in": d.d_in, "d_sae": d.d_sae, "d_out": d.d_out, "k": d.k,
           "dtype": "float32", "apply_b_dec_to_input": d.apply_b_dec_to_input,
           "normalize_activations": d.normalize_activations, "metadata": meta}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder
