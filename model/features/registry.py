"""The per-row features, in the order the engine calls them: the one place that names them all
(model/features/protocol.py says what each is called for; docs/engine.md, "Per-row features").

`FEATURES` are the feature classes. Each engine makes one `EngineFeatures`, an instance of each bound to it (what
a feature keeps per engine lives there: loaded dictionaries, compiled grammars, counters); the stages that depend
on a request alone (`plain`, `block_key`) are the classes' own, asked through the functions below by the request
and the KV manager, which hold no engine.

The order is the order of their parts in a step: a path runs a step only when every part allows it
(`StepParts.allow`), and the attention recorder is the first part that records.
"""

from __future__ import annotations

from typing import Any

from model.features.interventions import Interventions
from model.features.kv_window import KVWindowFeature
from model.features.protocol import EngineView, Feature, StepParts, StepView
from model.features.sae.feature import SAEFeatures
from model.features.telemetry import Telemetry

FEATURES: tuple[type[Feature], ...] = (Interventions, KVWindowFeature, Telemetry, SAEFeatures)


def plain(options: Any) -> bool:
    """Whether a request's rows are plain decoders as far as the features go (model/engine/request.py)."""
    return all(f.plain(f.value(options)) for f in FEATURES)


def block_key(request: Any, start: int, end: int) -> bytes | None:
    """The features' share of the prefix-cache key of the request's block of positions [start, end): None where no
    feature changes it."""
    keys = [k for f in FEATURES if (s := request.state.get(f.name)) is not None
            and (k := f.block_key(s, start, end)) is not None]
    return b"".join(keys) if keys else None


def max_cached_tokens(seq: Any) -> int | None:
    """The most leading tokens of `seq` the prefix cache may supply (`Feature.max_cached`); None: no feature limits
    it."""
    state = seq.request.state
    limits = [m for f in FEATURES if (s := state.get(f.name)) is not None and (m := f.max_cached(s, seq)) is not None]
    return min(limits) if limits else None


def native_args(parts: StepParts | None) -> dict[str, Any]:
    """The fused native call's feature arguments (model/kernels/csrc/bindings.cpp, step_layers): each feature's
    empty values, overridden by the step's parts."""
    args = {k: v for f in FEATURES for k, v in f.native_defaults.items()}
    if parts:
        args.update(parts.native_args())
    return args


class EngineFeatures:
    """One engine's features: what the engine and its runner call at their fixed points."""

    def __init__(self, engine: EngineView) -> None:
        self.features = [f(engine) for f in FEATURES]

    def check(self, options: Any) -> None:
        """Each feature the request carries, checked against the engine (InvalidOption naming the request field)."""
        for f in self.features:
            value = f.value(options)
            if value is not None:
                f.check(value)

    def admit(self, request: Any, model_config: Any) -> None:
        """Each feature's per-request state, made once against the prompt, on `request.state` under its name."""
        for f in self.features:
            value = f.value(request.options)
            if value is not None:
                state = f.admit(value, len(request.prompt_token_ids), model_config)
                if state is not None:
                    request.state[f.name] = state

    def prefix_key(self, request: Any) -> bytes:
        """The features' share of the root of the request's prefix-cache keys (empty: the base model's)."""
        return b"".join(k for f in self.features if (k := f.prefix_key(request)) is not None)

    def prepare(self, step: StepView) -> StepParts:
        """The step's parts, one per feature whose rows are in it."""
        return StepParts([p for f in self.features if (p := f.prepare(step)) is not None])

    def metrics(self) -> dict[str, dict[str, float]]:
        return {f.name: m for f in self.features if (m := f.metrics())}
