"""EleutherAI sparsify's format: a folder named after the HF module it hooks (relative to the base model:
`layers.6`, `layers.6.mlp`, `embed_tokens`), holding cfg.json and sae.safetensors, read as sparsify reads it
(sparsify/sparse_coder.py `SparseCoder.load_from_disk`, `encode`, `decode`, `forward`; sparsify/fused_encoder.py).

cfg.json: `d_in`, `num_latents` (0: `expansion_factor` * d_in), `k`, `activation` ("topk" or "groupmax"),
`transcode`, `skip_connection`, `normalize_decoder`. Weights: encoder.weight (F, D), encoder.bias (F,), W_dec (F, D),
b_dec (D,), W_skip (D, D) with a skip connection.

An autoencoder encodes x - b_dec and reads the module's output; a transcoder (`transcode`) encodes its input
unshifted, reads the module's input and predicts its output (sparsify/trainer.py's forward hook takes `inputs[0]`
and `outputs`); the skip connection adds x W_skip^T. The activation takes relu(pre) then the top k (or each group's
maximum), `fused_encoder`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from model.features.sae.dictionary import Dictionary, DictionaryError, hook_of
from model.features.sae.files import Reader, check_bytes, need, read_tensors, tensor_shapes

CFG, WEIGHTS = "cfg.json", "sae.safetensors"


def read_sparsify(reader: Reader, dtype: torch.dtype, max_bytes: int | None, hook_name: str | None = None,
                  hook_name_out: str | None = None) -> Dictionary:
    cfg = reader.json(CFG)
    weights = reader.file(WEIGHTS)
    check_bytes(tensor_shapes(weights), dtype, max_bytes, WEIGHTS)
    t = read_tensors(weights, dtype)
    enc_w, enc_b, W_dec, b_dec = need(t, "encoder.weight", "encoder.bias", "W_dec", "b_dec", file=WEIGHTS)
    activation = cfg.get("activation", "topk")
    if activation not in ("topk", "groupmax"):
        raise DictionaryError("activation", f"{activation!r} is not served; sparsify's are topk and groupmax")
    transcode = bool(cfg.get("transcode", False))
    d_in, F = cfg.get("d_in"), cfg.get("num_latents") or (cfg.get("d_in") or 0) * cfg.get("expansion_factor", 0)
    if d_in is not None and d_in != enc_w.shape[1]:
        raise DictionaryError("d_in", f"{CFG} says {d_in}, {WEIGHTS} holds {enc_w.shape[1]}")
    if F and F != enc_w.shape[0]:
        raise DictionaryError("num_latents", f"{CFG} says {F}, {WEIGHTS} holds {enc_w.shape[0]}")
    if not isinstance(cfg.get("k"), int):
        raise DictionaryError("k", f"{CFG} needs an integer k")
    # the folder's name is the module; a transcoder reads its input and writes its output
    module = reader.root.name
    hook_in = hook_of(hook_name or module, "hook_name", None if hook_name else ("input" if transcode else "output"))
    hook_out = hook_of(hook_name_out or module, "hook_name_out", None if hook_name_out else "output") \
        if transcode else hook_in
    return Dictionary(
        W_enc=enc_w.T.contiguous(), b_enc=enc_b, W_dec=W_dec.contiguous(), b_dec=b_dec, hook_in=hook_in,
        hook_out=hook_out, activation=activation, k=cfg["k"],
        W_skip=t.get("W_skip") if cfg.get("skip_connection") else None, apply_b_dec_to_input=not transcode,
        source=f"sparsify:{activation}{':transcoder' if transcode else ''}", transcoder=transcode,
        meta={"module": module},
    )


def is_sparsify(root: Path) -> bool:
    return (root / CFG).exists() and (root / WEIGHTS).exists()
