"""Steering by feature: clamping one feature of a sparse autoencoder to a value at the site it reads.

Templeton et al. 2024 ("Scaling Monosemanticity", the feature-steering experiments) clamp a feature by running the
SAE at the site, setting the feature's activation to v and decoding, while keeping the reconstruction error: the
site's activation x becomes x + decode(f with f_F = v) - decode(f). The decoder is affine in f, so that is

    x += (v - f_F(x)) * s(x) * d_F          d_F = W_dec[F] (D,), s(x) the dictionary's output rescaling:
                                            1 without normalization, |x| / sqrt(D) under "constant_norm_rescale",
                                            std(x) under "layer_norm" (SAELens sae.py `run_time_activation_norm_fn_out`)

with f_F(x) the dictionary's own activation of F at x (model/features/sae/dictionary.py's `encode`: normalization,
`apply_b_dec_to_input`, the threshold of a JumpReLU, a gated dictionary's magnitude path). Its value is a rank-1 read
of x, a = (normalize(x) - b_dec?) . W_enc[:, F], in float64 as model/edits.py's project_out takes its dot product:
an entry of the step's table (`table_entry`), applied by the native kernel on the CPU's paths (the fused step
included). TopK and GroupMax also decide whether F is selected at all, against the row's whole encode (every
feature, or F's group): the table names the dictionary's encoder for that (`encoder`), which the kernel reads in
float32. Either way a row's edit depends on that row alone, whatever else its step holds. `apply` is the PyTorch
definition, the full `encode` of each row.

A transcoder writes another site than it reads: clamping one of its features would need its output site's
activation replaced by its whole output, which the engine does not compute, so the API refuses it (`add` of a
transcoder's decoder row is an ordinary `add` at its output site).
"""

from __future__ import annotations

import hashlib
import math
import struct

import torch
from torch import Tensor

from model.features.sae.dictionary import Dictionary

ELEMENTWISE = ("relu", "jumprelu", "gated")
KIND = {"relu": 0, "jumprelu": 1, "gated": 2, "topk": 3, "groupmax": 4}  # the table's codes (model/edits.py,
# csrc/interventions.cpp)
NORM = {"none": 0, "constant_norm_rescale": 1, "layer_norm": 2}


def dictionary_digest(d: Dictionary) -> bytes:
    """A content hash of everything `encode` and `decode` read (the prefix cache's key for a clamp: two dictionaries
    with the same weights clamp alike). Computed once per dictionary object (its weights never change after load)."""
    cached = d.__dict__.get("_content_digest")
    if cached is not None:
        return cached
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{d.activation}|{d.k}|{d.apply_b_dec_to_input}|{d.normalize_activations}|{d.transcoder}|"
             f"{d.hook_in}|{d.hook_out}".encode())
    for name, t in sorted(d.tensors().items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    d.__dict__["_content_digest"] = h.digest()
    return d.__dict__["_content_digest"]


class FeatureClamp:
    """Feature `feature` of autoencoder `dictionary` held at `value` wherever the intervention applies."""

    def __init__(self, dictionary: Dictionary, feature: int, value: float) -> None:
        self.dictionary, self.feature, self.value = dictionary, feature, value
        dictionary_digest(dictionary)  # hashed here, where the request is read, not in the engine's thread
        self._on: dict[torch.device, tuple[Tensor, ...]] = {}  # the feature's float64 vectors, per device

    @property
    def width(self) -> int:
        return self.dictionary.d_in

    def validate(self, where: str) -> None:
        """ValueError naming the field (`where.feature`, `where.value`) for a clamp that cannot be served."""
        d = self.dictionary
        if d.transcoder:
            raise ValueError(f"{where}.feature: clamp needs an autoencoder; {d.source or 'this dictionary'} is a "
                             "transcoder (its output site is not the site it reads): steer it with op 'add'")
        if not isinstance(self.feature, int) or not 0 <= self.feature < d.d_sae:
            raise ValueError(f"{where}.feature.id: {self.feature!r} is out of range [0, {d.d_sae})")
        if not math.isfinite(self.value):
            raise ValueError(f"{where}.value: must be finite")

    @property
    def elementwise(self) -> bool:
        """Whether f_F reads x through F's encoder column alone; TopK and GroupMax also read the row's whole encode
        (`encoder`)."""
        return self.dictionary.activation in ELEMENTWISE

    def table_entry(self) -> tuple[list[Tensor], list[float]]:
        """The clamp as model/edits.py's table holds it: its vectors [w_F, d_F (, b_dec when applied to the input)]
        (D,) float32, and its parameters [activation, b_enc_F, threshold_F or b_mag_F or k, exp(r_mag_F) or the
        encoder's index in the step (set there), value, normalization, F] (csrc/interventions.cpp's `clamp_impl`
        reads them)."""
        d, F = self.dictionary, self.feature
        vectors = [d.W_enc[:, F].float().clone(), d.W_dec[F].float().clone()]
        if d.apply_b_dec_to_input:
            vectors.append(d.b_dec.float().clone())
        third = float(d.threshold[F]) if d.activation == "jumprelu" else float(d.b_mag[F]) if d.activation == "gated" \
            else float(d.k)
        er = math.exp(float(d.r_mag[F])) if d.activation == "gated" else 0.0
        return vectors, [float(KIND[d.activation]), float(d.b_enc[F]), third, er, float(self.value),
                         float(NORM[d.normalize_activations]), float(F)]

    def encoder(self, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor] | None:
        """(W_enc^T (F, D), b_enc (F,)) float32, contiguous, on `device`: what a TopK or GroupMax clamp reads to
        decide whether F is selected, a feature's encoder row after another (None for the elementwise activations),
        made once per dictionary and device (a step names it, never copies it)."""
        d = self.dictionary
        if self.elementwise:
            return None
        per_device = d.__dict__.setdefault("_clamp_encoder", {})
        device = torch.device(device)
        if device not in per_device:
            per_device[device] = (d.W_enc.detach().T.float().contiguous().to(device),
                                  d.b_enc.detach().float().contiguous().to(device))
        return per_device[device]

    def digest(self) -> bytes:
        return dictionary_digest(self.dictionary) + struct.pack("<qd", self.feature, self.value)

    def _vectors(self, device: torch.device) -> tuple[Tensor, ...]:
        # (w_F (D,), b_dec (D,) or empty, d_F (D,)) float64 and the per-feature scalars
        if device not in self._on:
            d, F = self.dictionary, self.feature
            w = d.W_enc[:, F].double()
            b_dec = d.b_dec.double() if d.apply_b_dec_to_input else torch.zeros(0, dtype=torch.float64)
            self._on[device] = (w.to(device), b_dec.to(device), d.W_dec[F].double().to(device))
        return self._on[device]

    def _normalized(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (n, D) float64 -> (normalize(x) (n, D), the output rescaling s(x) (n, 1)), as Dictionary._normalize."""
        mode = self.dictionary.normalize_activations
        if mode == "constant_norm_rescale":
            coeff = self.dictionary.d_in ** 0.5 / x.norm(dim=-1, keepdim=True)
            return x * coeff, 1.0 / coeff
        if mode == "layer_norm":
            x = x - x.mean(dim=-1, keepdim=True)
            std = x.std(dim=-1, keepdim=True)
            return x / (std + 1e-5), std  # dictionary.py's LAYER_NORM_EPS
        return x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)

    def activation(self, x: Tensor) -> Tensor:
        """x (n, D) -> f_F(x) (n,) float64, each row computed on its own."""
        d, F = self.dictionary, self.feature
        if d.activation not in ELEMENTWISE:  # topk, groupmax: F's value in the full encode, row by row
            return torch.stack([d.encode(x[i : i + 1].to(d.W_enc.device))[0, F] for i in range(x.shape[0])]
                               ).double().to(x.device)
        w, b_dec, _ = self._vectors(x.device)
        xn, _ = self._normalized(x.double())
        if b_dec.numel():
            xn = xn - b_dec
        a = (xn * w).sum(-1)  # (n,) the encoder's read without its bias, per row
        b = float(d.b_enc[F])
        if d.activation == "relu":
            return (a + b).clamp_min(0.0)
        if d.activation == "jumprelu":
            pre = a + b
            return pre.clamp_min(0.0) * (pre > float(d.threshold[F])).double()
        mag = (a * math.exp(float(d.r_mag[F])) + float(d.b_mag[F])).clamp_min(0.0)  # gated
        return (a + b > 0).double() * mag

    def apply(self, x: Tensor) -> None:
        """x (n, D) in place: x += (value - f_F(x)) s(x) d_F, in float64, rounded once to x's dtype."""
        _, _, d_F = self._vectors(x.device)
        xd = x.double()
        _, s = self._normalized(xd)
        delta = (self.value - self.activation(x))[:, None] * s  # (n, 1)
        x.copy_((xd + delta * d_F).to(x.dtype))
