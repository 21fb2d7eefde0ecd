"""The per-row features, in the order the engine calls them: the one place that names them all
(model/features/protocol.py says what each is called for; docs/engine.md, "Per-row features").

`FEATURES` are the feature classes. Each engine makes one `EngineFeatures`, an instance of each bound to it (what
a feature keeps per engine lives there: loaded dictionaries, compiled grammars, counters); the stages that depend
on a request or a choice alone (`plain`, `block_key`, `accept`, `drafts`) are the classes' own, asked through the
functions below by the request, the KV manager, the end-of-sequence rule and speculative verification, which hold
no engine.

The order is the order of their parts in a step: a path runs a step only when every part allows it
(`StepParts.allow`), and the attention recorder is the first part that records.
"""

from __future__ import annotations

from typing import Any, Callable

from model.features.interventions import Interventions
from model.features.kv_window import KVWindowFeature
from model.features.lora import LoRA
from model.features.protocol import EngineView, Feature, GraphPart, StepParts, StepView
from model.features.sae.feature import SAEFeatures
from model.features.structured import Structured
from model.features.telemetry import Telemetry

FEATURES: tuple[type[Feature], ...] = (LoRA, Interventions, KVWindowFeature, Telemetry, Structured, SAEFeatures)


def plain(options: Any) -> bool:
    """Whether a request's rows are plain decoders as far as the features go (model/engine/request.py)."""
    return all(f.plain(f.value(options)) for f in FEATURES)


def block_key(request: Any, start: int, end: int) -> bytes | None:
    """The features' share of the prefix-cache key of the request's block of positions [start, end): None where no
    feature changes it."""
    keys = [k for f in FEATURES if (s := request.state.get(f.name)) is not None
            and (k := f.block_key(s, start, end)) is not None]
    return b"".join(keys) if keys else None


def accept(seq: Any, token: int) -> str | None:
    """`token`, just appended to a choice's output, advances each feature's state of the choice: "stop" or
    "length" where one ends the choice there (the first that does, each advanced), else None."""
    ends = [f.accept(state, token) for f in FEATURES if (state := seq.state.get(f.name)) is not None]
    return next((e for e in ends if e is not None), None)


def drafts(seq: Any, proposed: list[int]) -> list[int]:
    """The prefix of a choice's speculative drafts that every feature of the choice lets its rows verify."""
    for f in FEATURES:
        state = seq.state.get(f.name)
        if state is not None and proposed:
            proposed = f.drafts(state, seq, proposed)
    return proposed


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

    def feature(self, name: str) -> Feature:
        """The feature named `name` (the engine's per-engine calls of one, e.g. loading a LoRA adapter); KeyError."""
        for f in self.features:
            if f.name == name:
                return f
        raise KeyError(f"no per-row feature {name!r}")

    def listen(self, listener: Callable[[], None]) -> None:
        """Call `listener` whenever a feature's per-engine state changes (`Feature.changed`, between steps)."""
        for f in self.features:
            f.listeners.append(listener)

    def graph_parts(self, max_rows: int, device: Any) -> list[GraphPart]:
        """The features' shares of the CUDA graphs, made once (`Feature.graph_part`)."""
        return [p for f in self.features if (p := f.graph_part(max_rows, device)) is not None]

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

    def start(self, seq: Any) -> None:
        """Each feature's state of one choice of an admitted request, on `seq.state` under its name."""
        for f in self.features:
            request_state = seq.request.state.get(f.name)
            if request_state is not None:
                state = f.start(request_state)
                if state is not None:
                    seq.state[f.name] = state

    def prefix_key(self, request: Any) -> bytes:
        """The features' share of the root of the request's prefix-cache keys (empty: the base model's)."""
        return b"".join(k for f in self.features if (k := f.prefix_key(request)) is not None)

    def prepare(self, step: StepView) -> StepParts:
        """The step's parts, one per feature whose rows are in it."""
        return StepParts([p for f in self.features if (p := f.prepare(step)) is not None])

    def metrics(self) -> dict[str, dict[str, float]]:
        return {f.name: m for f in self.features if (m := f.metrics())}
