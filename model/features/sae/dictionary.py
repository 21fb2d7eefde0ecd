"""`Dictionary`: a sparse autoencoder or transcoder as served: its weights, its encoder's activation, and the maps
between a site's activations x (T, D_in) and feature activations f (T, F).

    x' = normalize(x)                      "constant_norm_rescale": x * sqrt(D_in) / |x|; "layer_norm": (x - mean)
                                           / (std + 1e-5) (SAELens sae.py `_setup_activation_normalization`)
    x' -= b_dec                            when `apply_b_dec_to_input` (autoencoders only; Bricken et al. 2023)
    pre = x' W_enc + b_enc                 (T, F)
    f = act(pre)
    out = denormalize(f W_dec + b_dec)     (T, D_out); + x W_skip^T for a skip transcoder (on the raw x)

Activations (`activation`):

    relu        max(pre, 0)                                 standard SAEs (SAELens standard_sae.py)
    jumprelu    relu(pre) * (pre > threshold)               Rajamanoharan et al. 2024, "Jumping Ahead"
                                                            (SAELens jumprelu_sae.py, Gemma Scope, Llama Scope)
    topk        the k largest pre, relu'd; the rest 0       Gao et al. 2024 (SAELens topk_sae.py; sparsify's
                                                            fused_encoder.py takes relu first: the same set)
    groupmax    each of k equal groups' largest relu(pre)   sparsify fused_encoder.py's "groupmax"
    gated       (pre > 0) * relu(x' W_enc e^r_mag + b_mag), pre with b_enc = SAELens' b_gate
                                                            Rajamanoharan et al. 2024, "Improving Dictionary
                                                            Learning with Gated SAEs" (SAELens gated_sae.py)

BatchTopK (Bussmann et al. 2024) selects the top k over a whole batch, which would make a row's features depend
on its neighbours; SAELens serves it as what it saves for inference, a JumpReLU whose threshold is the training
run's running minimum of the selected activations (batchtopk_sae.py `process_state_dict_for_saving_inference`), and
so does this class (the loaders convert). A TopK trained with `rescale_acts_by_decoder_norm` has its decoder norms
folded into the encoder at load, as SAELens does when it saves one for inference (topk_sae.py `_fold_norm_topk`).

A transcoder reads one site and writes another (`hook_in` != `hook_out`, D_out may differ from D_in): Dunefsky et
al. 2024, "Transcoders Find Interpretable LLM Feature Circuits"; a skip transcoder adds a linear map of its input
(Paulo et al. 2025, "Transcoders Beat Sparse Autoencoders for Interpretability"). Its input is never shifted by
b_dec (SAELens transcoder.py refuses `apply_b_dec_to_input`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from model.hook_names import Hook, parse_hook
from model.quantize.layers import Int8Linear
from model.quantize.layouts import GROUP_SIZE

ACTIVATIONS = ("relu", "jumprelu", "topk", "groupmax", "gated")
ENCODERS = ("int8", "float32")  # how a request's per-token reads encode (feature.py `Served`)
NORMALIZATIONS = ("none", "constant_norm_rescale", "layer_norm")
LAYER_NORM_EPS = 1e-5  # SAELens sae.py run_time_activation_ln_in's default


class DictionaryError(ValueError):
    """A dictionary that cannot be served (a malformed file, or one that does not fit the model): `field` names the
    configuration field or tensor at fault, as the API's error envelope reports it."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}")
        self.field = field


def hook_of(name: str, where: str, side: str | None = None) -> Hook:
    """parse_hook, its refusal as a DictionaryError naming `where`."""
    try:
        return parse_hook(name, side=side, where=where)
    except ValueError as e:
        raise DictionaryError(where, str(e).removeprefix(f"{where}: ")) from None


@dataclass(eq=False)
class Dictionary:
    """One dictionary's weights (float tensors of one dtype) and how it encodes. `hook_out` is `hook_in` for an
    autoencoder. `source` names the format it was read from (for logs and /v1/saes)."""

    W_enc: Tensor  # (D_in, F)
    b_enc: Tensor  # (F,); a gated dictionary's gate bias (SAELens' b_gate)
    W_dec: Tensor  # (F, D_out)
    b_dec: Tensor  # (D_out,)
    hook_in: Hook
    hook_out: Hook
    activation: str = "relu"
    threshold: Tensor | None = None  # (F,) jumprelu
    k: int = 0  # topk, groupmax
    b_mag: Tensor | None = None  # (F,) gated
    r_mag: Tensor | None = None  # (F,) gated
    W_skip: Tensor | None = None  # (D_out, D_in) skip transcoders
    apply_b_dec_to_input: bool = False
    normalize_activations: str = "none"
    source: str = ""
    transcoder: bool = False
    # per-token reads (a request's `features`) encode with W_enc in this precision; everything else (/inspect's
    # grid, attribution, steering, `encode` itself) in the dictionary's dtype
    encoder: str = "float32"
    meta: dict = field(default_factory=dict)  # the file's own description (model name, hook names as written)

    def __post_init__(self) -> None:
        self.validate()

    # --- shapes -----------------------------------------------------------------------------------------------
    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    @property
    def d_out(self) -> int:
        return self.W_dec.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    def tensors(self) -> dict[str, Tensor]:
        names = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "b_mag", "r_mag", "W_skip")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @property
    def nbytes(self) -> int:
        """Its tensors' bytes, and its int8 encoder's once made (`int8_encoder`): what it holds in memory."""
        q = getattr(self, "_int8", None)
        return sum(t.nbytes for t in self.tensors().values()) + (q.decode_bytes if q is not None else 0)

    def validate(self) -> None:
        """DictionaryError naming the field for weights that do not make one dictionary."""
        if self.W_enc.ndim != 2:
            raise DictionaryError("W_enc", f"expected (d_in, d_sae), got shape {tuple(self.W_enc.shape)}")
        D_in, F = self.W_enc.shape
        expect = {"b_enc": (F,), "W_dec": (F, self.W_dec.shape[-1]), "b_dec": (self.W_dec.shape[-1],),
                  "threshold": (F,), "b_mag": (F,), "r_mag": (F,),
                  "W_skip": (self.W_dec.shape[-1], D_in)}
        for name, t in self.tensors().items():
            if name in expect and tuple(t.shape) != expect[name]:
                raise DictionaryError(name, f"shape {tuple(t.shape)} does not fit W_enc's {(D_in, F)} "
                                            f"(expected {expect[name]})")
            if t.dtype != self.W_enc.dtype:
                raise DictionaryError(name, f"dtype {t.dtype} differs from W_enc's {self.W_enc.dtype}")
        if self.activation not in ACTIVATIONS:
            raise DictionaryError("architecture", f"unknown activation {self.activation!r}; served: {list(ACTIVATIONS)}")
        if self.encoder not in ENCODERS:
            raise DictionaryError("encoder", f"{self.encoder!r} is not served; choose from {list(ENCODERS)}")
        if self.normalize_activations not in NORMALIZATIONS:
            raise DictionaryError("normalize_activations", f"{self.normalize_activations!r} is not served; "
                                                           f"choose from {list(NORMALIZATIONS)}")
        need = {"jumprelu": ("threshold",), "gated": ("b_mag", "r_mag")}.get(self.activation, ())
        for name in need:
            if getattr(self, name) is None:
                raise DictionaryError(name, f"missing: a {self.activation} dictionary needs it")
        if self.activation in ("topk", "groupmax") and not 0 < self.k <= F:
            raise DictionaryError("k", f"{self.k} is out of range [1, {F}]")
        if self.activation == "groupmax" and F % self.k:
            raise DictionaryError("k", f"groupmax needs d_sae ({F}) divisible by k ({self.k})")
        if self.transcoder and self.apply_b_dec_to_input:
            raise DictionaryError("apply_b_dec_to_input", "a transcoder's input is never shifted by b_dec")
        if not self.transcoder and self.d_out != D_in:
            raise DictionaryError("W_dec", f"an autoencoder decodes to its input's width {D_in}, not {self.d_out}")

    def check_model(self, config) -> None:
        """DictionaryError naming the field when this dictionary does not fit the model (a ModelConfig): its layers
        and the widths of the sites it reads and writes."""
        for fname, hook, width in (("hook_name", self.hook_in, self.d_in), ("hook_name_out", self.hook_out, self.d_out)):
            if fname == "hook_name_out" and not self.transcoder:
                continue
            if not 0 <= hook.layer < config.n_layers:
                raise DictionaryError(fname, f"layer {hook.layer} is out of range [0, {config.n_layers})")
            if hook.width(config) != width:
                d = "d_in" if fname == "hook_name" else "d_out"
                raise DictionaryError(d, f"{width} does not match {hook.site} of layer {hook.layer}: "
                                         f"{hook.width(config)} wide ({hook.width_name()})")

    # --- the maps -----------------------------------------------------------------------------------------------
    def _normalize(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        # (T, D_in) -> (T, D_in) and what undoes it on the output side
        if self.normalize_activations == "constant_norm_rescale":
            coeff = self.d_in ** 0.5 / x.norm(dim=-1, keepdim=True)  # (T, 1)
            return x * coeff, (1.0 / coeff, torch.zeros_like(coeff))
        if self.normalize_activations == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            x = x - mu
            std = x.std(dim=-1, keepdim=True)  # unbiased, as SAELens' torch.std call
            return x / (std + LAYER_NORM_EPS), (std, mu)
        return x, None

    def pre_activations(self, x: Tensor) -> Tensor:
        """x (T, D_in) -> the encoder's pre-activations (T, F) (gated: the gate's; topk, groupmax: before the
        selection)."""
        x, _ = self._normalize(x.to(self.dtype))
        return self._pre(x)

    def _pre(self, x: Tensor) -> Tensor:
        if self.apply_b_dec_to_input:
            x = x - self.b_dec
        return x @ self.W_enc + self.b_enc  # (T, F)

    def encode(self, x: Tensor) -> Tensor:
        """x (T, D_in) at `hook_in` -> feature activations f (T, F), dense, in the dictionary's dtype."""
        x, _ = self._normalize(x.to(self.dtype))
        return self._activate(self._pre(x))

    def _activate(self, pre: Tensor) -> Tensor:  # (T, F) -> (T, F)
        if self.activation == "relu":
            return pre.relu()
        if self.activation == "jumprelu":
            return pre.relu() * (pre > self.threshold).to(pre.dtype)
        if self.activation == "gated":
            # the magnitude path shares W_enc, rescaled per feature: x W_enc e^r = (x W_enc) e^r, one matmul for both
            mag = ((pre - self.b_enc) * self.r_mag.exp() + self.b_mag).relu()
            return (pre > 0).to(pre.dtype) * mag
        if self.activation == "topk":
            values, ids = pre.topk(self.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter_(-1, ids, values.relu())
        values, ids = pre.relu().unflatten(-1, (self.k, -1)).max(dim=-1)  # groupmax: (T, k)
        ids = ids + torch.arange(0, self.d_sae, self.d_sae // self.k, device=pre.device)
        return torch.zeros_like(pre).scatter_(-1, ids, values)

    def decode(self, f: Tensor, x: Tensor | None = None) -> Tensor:
        """Feature activations f (T, F) -> the output (T, D_out) at `hook_out`. `x` (T, D_in), the input they were
        encoded from, is needed by input-dependent normalizations and by a skip transcoder's skip term."""
        out = f.to(self.dtype) @ self.W_dec + self.b_dec  # (T, D_out)
        if self.normalize_activations != "none" and not self.transcoder:  # SAELens transcoders never denormalize
            if x is None:
                raise ValueError(f"decode needs the input under normalize_activations={self.normalize_activations!r}")
            _, (scale, shift) = self._normalize(x.to(self.dtype))
            out = out * scale + shift
        if self.W_skip is not None:
            if x is None:
                raise ValueError("a skip transcoder's decode needs its input x")
            out = out + x.to(self.dtype) @ self.W_skip.T
        return out

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (T, D_in) -> (the reconstruction or transcoder output (T, D_out), features (T, F))."""
        f = self.encode(x)
        return self.decode(f, x), f

    def int8_encoder(self) -> Int8Linear | None:
        """W_enc^T (F, D_in) as an int8 layer (GGUF Q8_0: blocks of 32 inputs, a float16 scale each), made once and
        kept: what per-token reads multiply by where `encoder` is "int8" (feature.py `Served`). None where D_in is
        not whole blocks of 32 (those read in float32)."""
        if self.d_in % GROUP_SIZE:
            return None
        if getattr(self, "_int8", None) is None:
            self._int8 = Int8Linear.from_float(self.W_enc.detach().T.float().cpu())
        return self._int8

    def decoder_direction(self, feature: int) -> Tensor:
        """Feature `feature`'s decoder row (D_out,): what one unit of its activation adds at `hook_out`."""
        return self.W_dec[feature]

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> "Dictionary":
        self._int8 = None  # made again from the weights as they are now
        for name, t in self.tensors().items():
            setattr(self, name, t.to(dtype=dtype if t.is_floating_point() else None, device=device))
        return self


def top_features(f: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """f (T, F) -> each row's k largest activations (T, k) and their feature ids (T, k) int64, largest first (ties:
    torch.topk's order). Rows with fewer than k active features report zeros at the end."""
    values, ids = f.topk(min(k, f.shape[-1]), dim=-1, sorted=True)
    return values, ids
