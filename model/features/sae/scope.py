"""Llama Scope's and Gemma Scope's files, read as SAELens' converters read them
(sae_lens/loading/pretrained_sae_loaders.py).

Llama Scope (He et al. 2024, "Llama Scope"; `get_llama_scope_config_from_hf`, `llama_scope_sae_huggingface_loader`):
a folder with hyperparams.json and checkpoints/final.safetensors (final.safetensors beside it is accepted too).
hyperparams.json: `d_model`, `d_sae`, `hook_point_in`, `hook_point_out` (TransformerLens names), `act_fn`
"jumprelu" with one scalar `jump_relu_threshold`, `norm_activation` "dataset-wise" with
`dataset_average_activation_norm` {"in", "out"}. Weights: encoder.weight (F, D), encoder.bias, decoder.weight
(D, F), decoder.bias. Trained on inputs rescaled to norm sqrt(D) on average, the dataset-wise factor
s = sqrt(D) / norm_in is folded into the weights as SAELens folds a release's `norm_scaling_factor` (which for these
releases is that ratio): W_enc * s, W_dec / s, b_dec / s (`fold_activation_norm_scaling_factor`), and the threshold
times s, as the converter scales it. A transcoder (hook_point_out != hook_point_in) divides its decoder by its own
s_out = sqrt(D) / norm_out instead. `apply_b_dec_to_input` is off, as the converter sets it.

Gemma Scope (Lieberum et al. 2024; `gemma_2_sae_huggingface_loader`, `gemma_3_sae_huggingface_loader`):
- Gemma Scope 1: params.npz with W_enc (D, F), W_dec (F, D), b_enc, b_dec, threshold (JumpReLU). Where it reads
  comes from its path, as the converter takes it from the release's names: `layer_N` in a folder name, and the
  release's "res" (hook_resid_post), "mlp" (hook_mlp_out) or "att" (attn.hook_z, all heads).
- Gemma Scope 2: params.safetensors with w_enc, w_dec, b_enc, b_dec, threshold, and a skip transcoder's
  affine_skip_connection (D_in, D_out), transposed to W_skip. config.json beside it (when present) names the HF
  modules, `hf_hook_point_in` / `hf_hook_point_out` ("model.layers.N.output", ...); else the folder names say
  (`resid_post`, `attn_out`, `mlp_out`, `transcoder`). Cross-layer transcoders (`clt`) are not served.
Both: `apply_b_dec_to_input` off, no normalization. Gemma Scope's embedding SAEs read Gemma's embedding table before
Gemma's sqrt(D) multiplier, a place the LLaMA layout served here does not have: refused.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from model.features.sae.dictionary import Dictionary, DictionaryError, hook_of
from model.features.sae.files import Reader, check_bytes, need, read_tensors, tensor_shapes
from model.hook_names import Hook

LLAMA_SCOPE_CFG = "hyperparams.json"
LLAMA_SCOPE_WEIGHTS = ("checkpoints/final.safetensors", "final.safetensors")


def read_llama_scope(reader: Reader, dtype: torch.dtype, max_bytes: int | None, hook_name: str | None = None,
                     hook_name_out: str | None = None) -> Dictionary:
    hp = reader.json(LLAMA_SCOPE_CFG)
    weights = reader.file(*LLAMA_SCOPE_WEIGHTS)
    if weights is None:
        raise DictionaryError("final.safetensors", f"missing (looked for {', '.join(LLAMA_SCOPE_WEIGHTS)})")
    if hp.get("act_fn", "jumprelu") != "jumprelu":
        raise DictionaryError("act_fn", f"{hp.get('act_fn')!r} is not served; Llama Scope's are jumprelu")
    if hp.get("apply_decoder_bias_to_pre_encoder"):
        raise DictionaryError("apply_decoder_bias_to_pre_encoder", "not served (Llama Scope's releases have it off)")
    for key in ("d_model", "hook_point_in", "jump_relu_threshold"):
        if key not in hp:
            raise DictionaryError(key, f"missing from {LLAMA_SCOPE_CFG}")
    D = hp["d_model"]
    mode = hp.get("norm_activation", "dataset-wise")
    norms = hp.get("dataset_average_activation_norm") or {}
    if mode == "dataset-wise":
        if not all(isinstance(norms.get(s), (int, float)) and norms[s] > 0 for s in ("in", "out")):
            raise DictionaryError("dataset_average_activation_norm", "needs positive 'in' and 'out' norms")
        s_in, s_out = D ** 0.5 / norms["in"], D ** 0.5 / norms["out"]
    elif mode == "inference":  # lm-saes' name for weights already standardized
        s_in = s_out = 1.0
    else:
        raise DictionaryError("norm_activation", f"{mode!r} is not served (dataset-wise or inference)")
    check_bytes(tensor_shapes(weights), dtype, max_bytes, weights.name)
    t = read_tensors(weights, dtype)
    enc_w, enc_b, dec_w, dec_b = need(t, "encoder.weight", "encoder.bias", "decoder.weight", "decoder.bias",
                                      file=weights.name)
    hook_in = hook_of(hook_name or hp["hook_point_in"], "hook_name")
    out_name = hook_name_out or hp.get("hook_point_out") or hp["hook_point_in"]
    hook_out = hook_of(out_name, "hook_name_out")
    transcoder = hook_out != hook_in
    if not transcoder:
        s_out = s_in
    if hp.get("d_sae") not in (None, enc_w.shape[0]):
        raise DictionaryError("d_sae", f"{LLAMA_SCOPE_CFG} says {hp['d_sae']}, the weights hold {enc_w.shape[0]}")
    threshold = torch.full_like(enc_b, float(hp["jump_relu_threshold"]) * s_in)
    return Dictionary(
        W_enc=(enc_w.T * s_in).contiguous(), b_enc=enc_b, W_dec=(dec_w.T / s_out).contiguous(), b_dec=dec_b / s_out,
        hook_in=hook_in, hook_out=hook_out, activation="jumprelu", threshold=threshold,
        source="llama_scope" + (":transcoder" if transcoder else ""), transcoder=transcoder,
        meta={"hook_point_in": hp["hook_point_in"], "hook_point_out": hp.get("hook_point_out")},
    )


_GEMMA_SITES = (("resid_post", "block_output"), ("attn_out", "head_output"), ("mlp_out", "mlp_output"))
_GEMMA_1_RELEASES = (("res", "block_output"), ("mlp", "mlp_output"), ("att", "head_output"))


def _gemma_layer(root: Path) -> int:
    for part in reversed(root.parts):
        if m := re.search(r"layer_(\d+)", part):
            return int(m.group(1))
    raise DictionaryError("hook_name", f"no layer_N in {root}: give the hook name")


def read_gemma_scope(reader: Reader, dtype: torch.dtype, max_bytes: int | None, hook_name: str | None = None,
                     hook_name_out: str | None = None) -> Dictionary:
    root = reader.root
    parts = [p.lower() for p in root.parts]
    if any("embedding" in p for p in parts) and hook_name is None:
        raise DictionaryError("hook_name", "Gemma Scope's embedding SAEs read Gemma's unscaled embedding table, "
                                           "which the LLaMA layout served here does not have")
    if any("clt" in p for p in parts[-2:]):
        raise DictionaryError("architecture", "cross-layer transcoders are not served")
    weights = reader.file("params.safetensors", "params.npz")
    check_bytes(tensor_shapes(weights), dtype, max_bytes, weights.name)
    t = {("W_" + k[2:] if k.startswith("w_") else k): v for k, v in read_tensors(weights, dtype).items()}
    W_enc, b_enc, W_dec, b_dec, threshold = need(t, "W_enc", "b_enc", "W_dec", "b_dec", "threshold", file=weights.name)
    skip = t.get("affine_skip_connection")
    cfg = reader.json("config.json") if reader.file("config.json") is not None else {}
    if cfg.get("architecture", "jump_relu") != "jump_relu":
        raise DictionaryError("architecture", f"{cfg.get('architecture')!r} is not served; Gemma Scope's is jump_relu")
    hook_in = hook_out = None
    if hook_name:
        hook_in = hook_of(hook_name, "hook_name")
    elif cfg.get("hf_hook_point_in"):
        hook_in = hook_of(cfg["hf_hook_point_in"], "hf_hook_point_in")
    if hook_name_out:
        hook_out = hook_of(hook_name_out, "hook_name_out")
    elif cfg.get("hf_hook_point_out"):
        hook_out = hook_of(cfg["hf_hook_point_out"], "hf_hook_point_out")
    if hook_in is None:
        layer = _gemma_layer(root)
        if weights.suffix == ".npz":  # Gemma Scope 1: the release's name says the site
            release = next((p for p in parts if p.startswith("gemma-scope")), "")
            site = next((s for key, s in _GEMMA_1_RELEASES if key in release.split("-")), None)
        else:
            site = next((s for key, s in _GEMMA_SITES if any(key in p for p in parts)), None)
            if any("transcoder" in p for p in parts):
                site, hook_out = "mlp_input", hook_out or Hook(layer, "mlp_output")
        if site is None:
            raise DictionaryError("hook_name", f"cannot tell the site from {root}: give the hook name")
        hook_in = Hook(layer, site)
    transcoder = hook_out is not None and hook_out != hook_in
    return Dictionary(
        W_enc=W_enc.contiguous(), b_enc=b_enc, W_dec=W_dec.contiguous(), b_dec=b_dec, hook_in=hook_in,
        hook_out=hook_out if transcoder else hook_in, activation="jumprelu", threshold=threshold,
        W_skip=skip.T.contiguous() if skip is not None else None, source=f"gemma_scope:{weights.name}",
        transcoder=transcoder or skip is not None, meta={k: v for k, v in cfg.items() if isinstance(v, (str, int))},
    )


def is_llama_scope(root: Path) -> bool:
    return (root / LLAMA_SCOPE_CFG).exists()


def is_gemma_scope(root: Path) -> bool:
    return (root / "params.npz").exists() or (root / "params.safetensors").exists()
