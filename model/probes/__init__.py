"""Inspection: one capture forward over the serving weights that reports attention maps and sinks, massive
activations, residual norms and the logit lens; activation patching (patching.py), direct logit attribution
(direct_logit.py) and attribution patching (attribution_patching.py) over capture forwards (capture.py), and both
over a dictionary's features (feature_attribution.py). The
serving path never runs this code.

Definitions (each is what the request's thresholds and options refer to):
    Massive activation  Sun, Chen, Kolter, Liu, "Massive Activations in Large Language Models" (COLM 2024): an entry
                        of a block's output hidden state (the residual stream after both residual adds, before the
                        final norm) with |x| > `massive_threshold` (100) and |x| >= `massive_ratio` (1000) x the
                        median |x| of that block's whole hidden state (all tokens x all dims), as the paper's
                        `locuslab/massive-activations` code measures it (torch.median of the magnitudes). Signs kept.
    Attention sink      Xiao, Tian, Chen, Han, Lewis, "Efficient Streaming Language Models with Attention Sinks"
                        (ICLR 2024): attention mass the queries put on the first token. Query 0 is left out of it
                        and of every per-head mean here (entropy, mass received): it can only attend to itself.
    Feature grid        a dictionary's (sparse autoencoder's, transcoder's) features over the sequence, each token's
                        top_k and every reported feature's activations, max, mean, and the tokens its decoder
                        direction promotes and suppresses through the unembedding (feature_grid.py).
    Logit lens          nostalgebraist, "interpreting GPT: the logit lens" (2020): output(final_norm(h_l)) for the
                        block outputs h_l, read as a next-token distribution.

Notation as in transformer.py: T tokens, D width, H query heads, K KV heads, E head_dim, V vocabulary; Hs selected
heads, L selected layers.

Cost is bounded: attention probabilities are computed in blocks of query rows and reduced (sums, tiles, top-k,
chosen rows) at once, so no layers x heads x T x T tensor is ever held unless `full` maps were asked for (which the
service refuses beyond its byte budget, see `estimate_map_elements`). A `ProbeRun` advances by a bounded amount of
work per `step()` (chunks of query rows of a block; after the last block, the prediction's head calls over a few
positions each and the feature grid's slices), so the engine thread interleaves serving steps with it.
"""

from model.probes.activations import BlockActivations, massive_activations
from model.probes.attention import ProbeAttention
from model.probes.attribution_patching import AttributionPatchingRun
from model.probes.capture import CaptureRun, SiteCapture
from model.probes.compare import CompareRun, LayerComparison
from model.probes.direct_logit import DirectLogitResult, DirectLogitRun
from model.probes.feature_attribution import (FeatureAttributionRun, FeatureDirectLogitRun, FeatureNode,
                                              check_attributable, feature_sweep, hook_name)
from model.probes.feature_grid import FeatureGrid, FeatureGridResult, FeatureGridTooLarge, FeatureRequest
from model.probes.options import (
    DEFAULT_INCLUDES, INCLUDES, ActivationEntry, AttentionMaps, AttentionMode, HeadStats, LayerProbe, LensEntry, Prediction,
    ProbeOptions, ProbeResult,
    estimate_map_elements,
)
from model.probes.patching import Cell, PatchSweep, cell_interventions, grid, metric, normalise
from model.probes.run import ProbeRun, inspect

__all__ = [
    "DEFAULT_INCLUDES", "INCLUDES", "ActivationEntry", "AttentionMaps", "AttentionMode", "BlockActivations", "HeadStats",
    "LayerProbe", "Prediction",
    "LensEntry", "ProbeAttention", "ProbeOptions", "ProbeResult", "ProbeRun", "estimate_map_elements", "inspect",
    "massive_activations",
    "FeatureGrid", "FeatureGridResult", "FeatureGridTooLarge", "FeatureRequest",
    "AttributionPatchingRun", "CaptureRun", "Cell", "CompareRun", "LayerComparison", "DirectLogitResult", "DirectLogitRun",
    "FeatureAttributionRun", "FeatureDirectLogitRun", "FeatureNode", "check_attributable", "feature_sweep", "hook_name", "PatchSweep", "SiteCapture",
    "cell_interventions", "grid", "metric", "normalise",
]
