"""SAELens' format: a folder with cfg.json and sae_weights.safetensors, read as SAELens 6 reads it
(sae_lens/saes/sae.py `SAE.load_from_disk`, sae_lens/loading/pretrained_sae_loaders.py `sae_lens_disk_loader`,
`read_sae_components_from_disk`, `handle_config_defaulting`).

Two layouts of cfg.json:
- SAELens 6 (its `sae_lens_version`, top-level or in `metadata`, is 6 or later): `architecture`, `d_in`, `d_sae`,
  `apply_b_dec_to_input`, `normalize_activations`, `reshape_activations`, the architecture's own fields (`k`,
  `rescale_acts_by_decoder_norm`, `d_out`), and `metadata` holding `hook_name` (and a transcoder's `hook_name_out`;
  `hf_hook_name` / `hf_hook_name_out` where the dictionary was trained on an HF module).
- Before 6 (`handle_pre_6_0_config`): `hook_name` (or `hook_point`) at the top level, `architecture` missing for a
  standard SAE, a TopK as `activation_fn` "topk" with `activation_fn_kwargs.k`, `normalize_activations` possibly a
  bool (true: "expected_average_only_in"), and a `scaling_factor` tensor that is all ones (dropped) unless
  `finetuning_scaling_factor` was used, which SAELens 6 no longer serves.

Weights (state-dict names of the SAELens classes): W_enc (D_in, F), b_enc (F,), W_dec (F, D_out), b_dec (D_out,);
jumprelu `threshold` (F,) or an older `log_threshold` (exp'd, jumprelu_sae.py `process_state_dict_for_loading`);
gated `b_gate`, `b_mag`, `r_mag`; skip transcoders `W_skip` (D_out, D_in); a BatchTopK training checkpoint's scalar
`topk_threshold` (served as SAELens saves it for inference: a JumpReLU, model/features/sae/dictionary.py).

`normalize_activations`: "constant_norm_rescale" and "layer_norm" act at run time; "expected_average_only_in" has no
run-time effect in SAELens (its trainer folds the factor into the weights before saving, and `from_pretrained`
folds a release's `norm_scaling_factor`): given `norm_scaling_factor`, it is folded here the same way
(`fold_activation_norm_scaling_factor`: W_enc * s, W_dec / s, b_dec / s).
"""

from __future__ import annotations

from pathlib import Path

import torch

from model.features.sae.dictionary import Dictionary, DictionaryError, hook_of
from model.features.sae.files import Reader, check_bytes, need, read_tensors, tensor_shapes

CFG, WEIGHTS = "cfg.json", "sae_weights.safetensors"
# architecture -> (activation, transcoder, skip)
ARCHITECTURES = {
    "standard": ("relu", False, False), "jumprelu": ("jumprelu", False, False), "topk": ("topk", False, False),
    "batchtopk": ("jumprelu", False, False), "gated": ("gated", False, False),
    "transcoder": ("relu", True, False), "skip_transcoder": ("relu", True, True),
    "jumprelu_transcoder": ("jumprelu", True, False), "jumprelu_skip_transcoder": ("jumprelu", True, True),
}
PRE_6_RENAMES = {"hook_point": "hook_name", "hook_point_head_index": "hook_head_index",
                 "activation_fn_str": "activation_fn"}


def _is_pre_6(cfg: dict) -> bool:
    version = cfg.get("sae_lens_version") or (cfg.get("metadata") or {}).get("sae_lens_version")
    try:
        return not version or int(str(version).split(".")[0]) < 6
    except ValueError:
        return True


def normalized_config(cfg: dict) -> dict:
    """cfg.json of either layout -> one dict with the SAELens 6 fields at the top level (metadata merged in)."""
    if _is_pre_6(cfg):
        cfg = {PRE_6_RENAMES.get(k, k): v for k, v in cfg.items()}
        cfg.setdefault("apply_b_dec_to_input", True)
        cfg.setdefault("architecture", "standard")
        kwargs = cfg.get("activation_fn_kwargs") or {}
        if cfg.get("activation_fn") == "topk" and kwargs.get("k") is not None:
            cfg["architecture"], cfg["k"] = "topk", kwargs["k"]
        if isinstance(cfg.get("normalize_activations"), bool):
            cfg["normalize_activations"] = "expected_average_only_in" if cfg["normalize_activations"] else "none"
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    out = {**meta, **{k: v for k, v in cfg.items() if k != "metadata"}}
    if out.get("normalize_activations") is None:
        out["normalize_activations"] = "none"
    return out


def fold_decoder_norm(W_enc: torch.Tensor, b_enc: torch.Tensor, W_dec: torch.Tensor):
    """A dictionary trained with `rescale_acts_by_decoder_norm` (pre-activations times |W_dec row|, the decoder
    used with unit rows) as the plain one it equals: SAELens topk_sae.py `_fold_norm_topk`."""
    norm = W_dec.norm(dim=-1)  # (F,)
    return W_enc * norm, b_enc * norm, W_dec / norm[:, None]


def read_saelens(reader: Reader, dtype: torch.dtype, max_bytes: int | None, hook_name: str | None = None,
                 hook_name_out: str | None = None, norm_scaling_factor: float | None = None) -> Dictionary:
    raw = reader.json(CFG)
    cfg = normalized_config(raw)
    arch = cfg.get("architecture")
    if arch not in ARCHITECTURES:
        raise DictionaryError("architecture", f"{arch!r} is not served; served: {sorted(ARCHITECTURES)}")
    activation, transcoder, skip = ARCHITECTURES[arch]
    weights = reader.file(WEIGHTS)
    if weights is None:
        raise DictionaryError(WEIGHTS, f"missing beside {CFG}")
    check_bytes(tensor_shapes(weights), dtype, max_bytes, WEIGHTS)
    t = read_tensors(weights, dtype)

    if "scaling_factor" in t:  # read_sae_components_from_disk: an all-ones one is a leftover, anything else unserved
        if not torch.all(t.pop("scaling_factor") == 1):
            raise DictionaryError("finetuning_scaling_factor", "a fine-tuning scaling factor is not served")
    if "log_threshold" in t:
        t["threshold"] = t.pop("log_threshold").exp()
    if cfg.get("hook_head_index") is not None:
        raise DictionaryError("hook_head_index", "a dictionary of one attention head is not served")
    norm = cfg.get("normalize_activations")
    if norm == "covariance_whitening":
        raise DictionaryError("normalize_activations", "covariance_whitening that was not folded into the weights "
                                                       "is not served")

    if activation == "gated":
        W_enc, b_enc, b_mag, r_mag, W_dec, b_dec = need(t, "W_enc", "b_gate", "b_mag", "r_mag", "W_dec", "b_dec",
                                                        file=WEIGHTS)
    else:
        W_enc, b_enc, W_dec, b_dec = need(t, "W_enc", "b_enc", "W_dec", "b_dec", file=WEIGHTS)
        b_mag = r_mag = None
    threshold = None
    if arch == "batchtopk":
        (topk_threshold,) = need(t, "topk_threshold", file=WEIGHTS)
        # BatchTopKTrainingSAEConfig inherits TopK training's default: rescale_acts_by_decoder_norm True
        if cfg.get("rescale_acts_by_decoder_norm", True):
            W_enc, b_enc, W_dec = fold_decoder_norm(W_enc, b_enc, W_dec)
        threshold = torch.full_like(b_enc, float(topk_threshold.reshape(())))
    elif activation == "jumprelu":
        (threshold,) = need(t, "threshold", file=WEIGHTS)
    elif arch == "topk" and cfg.get("rescale_acts_by_decoder_norm", False):
        W_enc, b_enc, W_dec = fold_decoder_norm(W_enc, b_enc, W_dec)

    if norm == "expected_average_only_in" and norm_scaling_factor is not None:
        s = float(norm_scaling_factor)
        W_enc, W_dec, b_dec = W_enc * s, W_dec / s, b_dec / s
        norm = "none"
    elif norm == "expected_average_only_in":
        norm = "none"  # no run-time effect, as SAELens' load_from_disk

    name_in = hook_name or cfg.get("hf_hook_name") or cfg.get("hook_name")
    if not name_in:
        raise DictionaryError("hook_name", f"{CFG} names no hook (metadata.hook_name)")
    hook_in = hook_of(name_in, "hook_name")
    hook_out = hook_in
    if transcoder:
        name_out = hook_name_out or cfg.get("hf_hook_name_out") or cfg.get("hook_name_out")
        if not name_out:
            raise DictionaryError("hook_name_out", f"{CFG} of a transcoder names no output hook "
                                                   "(metadata.hook_name_out)")
        hook_out = hook_of(name_out, "hook_name_out")
    for field, want, have in (("d_in", cfg.get("d_in"), W_enc.shape[0]), ("d_sae", cfg.get("d_sae"), W_enc.shape[1]),
                              ("d_out", cfg.get("d_out") if transcoder else None, W_dec.shape[1])):
        if want is not None and want != have:
            raise DictionaryError(field, f"{CFG} says {want}, {WEIGHTS} holds {have}")
    return Dictionary(
        W_enc=W_enc.contiguous(), b_enc=b_enc, W_dec=W_dec.contiguous(), b_dec=b_dec, hook_in=hook_in,
        hook_out=hook_out, activation=activation, threshold=threshold, k=int(cfg.get("k") or 0),
        b_mag=b_mag, r_mag=r_mag, W_skip=t.get("W_skip") if skip else None,
        apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)) and not transcoder,
        normalize_activations=norm, source=f"saelens:{arch}", transcoder=transcoder,
        meta={k: cfg.get(k) for k in ("model_name", "hook_name", "hook_name_out", "hf_hook_name", "dataset_path",
                                       "sae_lens_version") if cfg.get(k) is not None},
    )


def is_saelens(root: Path) -> bool:
    return (root / CFG).exists() and (root / WEIGHTS).exists()
