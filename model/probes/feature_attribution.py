"""Feature attribution: direct logit attribution and attribution patching over a dictionary's features (a sparse
autoencoder at one site of the served model, model/features/sae/dictionary.py), with the dictionary's error kept as
its own node.

An autoencoder splits its site's activation x (W,) at a position into

    x = sum_i f_i s d_i  +  (s b_dec + t)  +  e,        f = encode(x),  e = x - decode(f)

with d_i = W_dec[i], and (s, t) the denormalisation of `normalize_activations` (s = 1, t = 0 without it). Marks,
Rager, Michaud, Belinkov, Bau, Mueller 2024, "Sparse Feature Circuits", section 2: the error e is a node of the
circuit like any feature, so that nothing the dictionary misses is silently left out.

Direct logit attribution (model/probes/direct_logit.py): the logit difference at the last position is linear in
the residual stream once the final norm's scale is frozen, u = g * s_final * (W_U[answer] - W_U[contrast]). A site
that writes into the residual stream (block_output, attention_output, mlp_output) reaches the logits directly
through u; head_output (the heads' concatenated outputs before wo) through wo, u_site = wo^T u. So

    feature i      f_i s (u_site . d_i)        bias   u_site . (s b_dec + t)        error   u_site . e

and their sum is the site's own direct contribution u_site . x (exactly, up to rounding: decode is affine in f).

Attribution patching over features (Marks et al. 2024, eq. 3, after Nanda 2023 and Syed et al. 2023): the effect
on the metric m of patching node a from the corrupted run into the clean one is, to first order,

    IE_atp(a) = grad_a m |clean . (a_corrupted - a_clean)

For a feature the node's value is f_i s d_i, so with g_t = dm/dx_t at the clean run (W,) at position t,

    feature i at t   (g_t . d_i) s_t (f_i(corrupted) - f_i(clean))        error at t   g_t . (e_corrupted - e_clean)

and the features, the error and (under input normalisation, whose scale differs between the runs) a remainder
sum to the site's own estimate g_t . (x_corrupted - x_clean). The gradient is attribution patching's
(model/probes/attribution_patching.py, the clean run as its target); `patch_vector` gives the exact patch the
estimate approximates, x_t += s_t (f_i(corrupted) - f_i(clean)) d_i, which the service runs through the engine's
real forward (`verify`).

Autoencoders only: a transcoder reads one site and writes another, and its nodes are not a split of one site's
activation. Dictionaries at sites the capture forward does not record (embeddings, resid_mid, the MLP's inside)
are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model.features.sae import Dictionary
from model.interventions import HeadShape, Intervention
from model.features.lora import LoRAAdapter
from model.probes.attribution_patching import AttributionPatchingRun
from model.probes.capture import SteppedJob
from model.probes.direct_logit import DirectLogitResult, DirectLogitRun
from model.probes.patching import PatchSweep
from model.transformer import Transformer

SITES = ("block_output", "attention_output", "mlp_output", "head_output")  # where a capture forward records


def check_attributable(d: Dictionary) -> None:
    """ValueError ("sae: ...") for a dictionary whose features cannot be attributed here."""
    if d.transcoder:
        raise ValueError("sae: a transcoder reads one site and writes another; feature attribution splits one site's "
                         "activation, so it takes an autoencoder")
    if d.hook_in.site not in SITES:
        raise ValueError(f"sae: the dictionary reads {d.hook_in.site} of layer {d.hook_in.layer}, which attribution "
                         f"does not record yet (it records {list(SITES)})")


def hook_name(d: Dictionary) -> str:
    return d.hook_in.transformer_lens_name()


def _flat(x: Tensor) -> Tensor:
    """(P, D) or (P, heads, E) -> (P, W) float64."""
    return x.reshape(x.shape[0], -1).double()


def _split(d: Dictionary, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x (P, W) float64 -> features f (P, F), the denormalisation scale s (P, 1) and shift t (P, 1) or (P, W), and
    the error e = x - decode(f) (P, W); all float64."""
    xd = x.to(d.dtype)
    f = d.encode(xd)  # (P, F)
    e = x - d.decode(f, xd).double()
    _, undo = d._normalize(xd)  # the dictionary's own (scale, shift), as decode applies them
    if undo is None:
        ones = torch.ones(x.shape[0], 1, dtype=torch.float64, device=x.device)
        return f.double(), ones, torch.zeros_like(ones), e
    return f.double(), undo[0].double(), undo[1].double(), e


@dataclass
class FeatureDirectLogit:
    """The split of the site's direct contribution at the last position; `features` [(id, activation,
    contribution)] for every active feature, largest |contribution| first."""

    position: int
    site_contribution: float  # u_site . x
    features: list[tuple[int, float, float]]
    features_sum: float
    bias: float
    error: float

    @property
    def total(self) -> float:
        return self.features_sum + self.bias + self.error


class FeatureDirectLogitRun(DirectLogitRun):
    """Direct logit attribution (DirectLogitRun's `result`) and, beside it, `features`: the split above of the
    dictionary's site at the last position."""

    def __init__(self, model: Transformer, token_ids: list[int], answer: int, contrast: int, dictionary: Dictionary,
                 adapter: LoRAAdapter | None = None) -> None:
        check_attributable(dictionary)
        if not 0 <= dictionary.hook_in.layer < model.config.n_layers:
            raise ValueError(f"sae: layer {dictionary.hook_in.layer} is not a layer of this model")
        self.dictionary = dictionary
        self.features: FeatureDirectLogit | None = None
        super().__init__(model, token_ids, answer, contrast, adapter, extra_sites=(dictionary.hook_in.site,))

    def _attribute(self) -> DirectLogitResult:
        result = super()._attribute()
        self.features = self._features()
        return result

    @torch.no_grad()
    def _features(self) -> FeatureDirectLogit:
        d, hook, u = self.dictionary, self.dictionary.hook_in, self.direction  # u (D,) float64
        if hook.site == "head_output":  # the heads reach the stream through wo: u_site = wo^T u (H E,)
            u = u @ self._wo(hook.layer, self.model.layers[hook.layer].attention.wo)
        x = _flat(self.forward.capture.values[(hook.layer, hook.site)])  # (1, W)
        f, s, t, e = _split(d, x)
        per_feature = f[0] * s[0, 0] * (d.W_dec.double() @ u)  # (F,)
        active = f[0].nonzero().flatten().tolist()
        order = sorted(active, key=lambda i: -abs(float(per_feature[i])))
        bias = float(u @ (s[0, 0] * d.b_dec.double() + t[0]))
        return FeatureDirectLogit(
            position=len(self.token_ids) - 1, site_contribution=float(u @ x[0]),
            features=[(i, float(f[0, i]), float(per_feature[i])) for i in order],
            features_sum=float(per_feature.sum()), bias=bias, error=float(u @ e[0]))


@dataclass
class FeatureNode:
    feature: int
    position: int
    clean: float  # f_i at the clean run
    corrupted: float
    estimate: float  # IE_atp: the estimated m(patched) - m(clean)


class FeatureAttributionRun(SteppedJob):
    """Attribution patching over `dictionary`'s features at `positions`, patching the corrupted run's feature values
    into the clean run (Marks et al.'s direction: the gradient is the clean run's). Once done: `baselines` (m(clean),
    m(corrupted)), `nodes` (every feature whose activation differs between the runs at a position, largest |estimate|
    first), and per position `site` (g . (x_corrupted - x_clean)), `error` and `rest` (what input normalisation
    leaves; zero up to rounding without it)."""

    def __init__(self, model: Transformer, dictionary: Dictionary, clean_ids: list[int], corrupted_ids: list[int],
                 answer: int, contrast: int | None, metric: str, positions: list[int],
                 adapter: LoRAAdapter | None = None) -> None:
        check_attributable(dictionary)
        self.dictionary, self.model = dictionary, model
        hook = dictionary.hook_in
        self.sweep = feature_sweep(model.config, dictionary, len(clean_ids), answer, contrast, metric, positions)
        self.positions = sorted(self.sweep.positions)
        self.inner = AttributionPatchingRun(model, self.sweep, corrupted_ids, clean_ids, qk_fix=False,
                                            keep_gradients=True, adapter=adapter)
        self.key = (hook.layer, hook.site)
        self.baselines: tuple[float, float] | None = None
        self.nodes: list[FeatureNode] = []
        self.site: list[float] = []
        self.error: list[float] = []
        self.rest: list[float] = []
        self.gradient: Tensor | None = None  # (P, W) float32: dm/dx at the clean run, the swept positions
        self.scale: Tensor | None = None  # (P, 1) float64: the clean run's denormalisation scale s
        self.done = False

    @staticmethod
    def held_bytes(sweep: PatchSweep, config, d_sae: int) -> int:
        """AttributionPatchingRun's, and the two runs' features, their difference and the estimates (P x F float64)."""
        return AttributionPatchingRun.held_bytes(sweep, config, False) + 4 * 8 * len(sweep.positions) * d_sae

    @property
    def gradient_precision(self) -> str:
        return self.inner.gradient_precision

    def unit(self) -> None:
        self.inner.unit()
        if self.inner.done:
            self._attribute()
            self.done = True

    @torch.no_grad()
    def _attribute(self) -> None:
        d, inner = self.dictionary, self.inner
        m_corrupted, m_clean = inner.baselines  # the inner run's source is the corrupted prompt, its target the clean
        self.baselines = (m_clean, m_corrupted)
        g = _flat(inner.gradients[self.key])  # (P, W)
        self.gradient = g.float()
        x_clean = _flat(inner.target.capture.values[self.key])  # (P, W)
        x_corr = _flat(inner.source.capture.values[self.key])
        f_clean, s_clean, _, e_clean = _split(d, x_clean)
        f_corr, _, _, e_corr = _split(d, x_corr)
        self.scale = s_clean  # (P, 1): the clean run's denormalisation, which a patched feature is decoded with
        delta = f_corr - f_clean  # (P, F)
        est = (g @ d.W_dec.double().T) * s_clean * delta  # (P, F)
        self.site = (g * (x_corr - x_clean)).sum(-1).tolist()
        self.error = (g * (e_corr - e_clean)).sum(-1).tolist()
        self.rest = [s - float(est[i].sum()) - self.error[i] for i, s in enumerate(self.site)]
        rows, cols = delta.nonzero(as_tuple=True)
        nodes = [FeatureNode(int(c), self.positions[int(r)], float(f_clean[r, c]), float(f_corr[r, c]),
                             float(est[r, c])) for r, c in zip(rows.tolist(), cols.tolist())]
        self.nodes = sorted(nodes, key=lambda n: -abs(n.estimate))
        inner.target.capture.values.clear()
        inner.source.capture.values.clear()

    def patch_vector(self, node: FeatureNode) -> Tensor:
        """What exact patching adds at the node's position: s (f_i(corrupted) - f_i(clean)) d_i, (W,) float32."""
        row = self.positions.index(node.position)
        return (float(self.scale[row, 0]) * (node.corrupted - node.clean) * self.dictionary.W_dec[node.feature].double()
                ).float()

    def interventions(self, node: FeatureNode) -> list[Intervention]:
        """The exact patch of `node` as the engine's interventions (model/interventions.py): an add at the node's
        position, one per head at head_output."""
        layer, site = self.key
        v = self.patch_vector(node)
        if site != "head_output":
            return [Intervention(layer, site, "add", (node.position,), vector=v)]
        hs = HeadShape.of(self.model.config)
        return [Intervention(layer, site, "add", (node.position,), vector=v[h * hs.head_dim: (h + 1) * hs.head_dim],
                             head=h) for h in range(hs.n_heads)]


def feature_sweep(config, d: Dictionary, num_tokens: int, answer: int, contrast: int | None, metric: str,
             positions: list[int]) -> PatchSweep:
    """The one-site sweep whose gradient feature attribution reads (ValueError naming the field)."""
    hook = d.hook_in
    sweep = PatchSweep([hook.site], [hook.layer], list(positions), num_tokens, answer, contrast, metric, "noise",
                       head_shape=HeadShape.of(config))
    sweep.validate(config.n_layers)
    return sweep
