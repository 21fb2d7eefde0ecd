"""`RequestOptions`: everything a request carries beside its prompt and its sampling, in one typed record that
travels unchanged from the route to the runner (`AsyncEngine.add_requests` -> the inbox -> `Engine.add_request` ->
`Request.options`, where the scheduler, the runner and the output processor read it).

A per-row feature adds its field here and its folder under model/features/, registered in
model/features/registry.py (docs/engine.md, "Per-row features").
"""

from __future__ import annotations

from dataclasses import dataclass

from model.features.kv_window import KVWindow
from model.features.protocol import InvalidOption
from model.features.sae.options import FeatureReadOptions
from model.features.structured.spec import StructuredOutputSpec
from model.features.telemetry.options import TelemetryOptions
from model.interventions import HiddenStateRead, Intervention


@dataclass(frozen=True)
class RequestOptions:
    """Per request, for each of its choices. All optional: `RequestOptions()` is a plain completion."""

    # edits of the residual stream for this request's rows only (model/interventions.py)
    interventions: tuple[Intervention, ...] | None = None
    # the block outputs returned with its tokens
    hidden_states: HiddenStateRead | None = None
    # the attention telemetry each sampled token carries (model/features/telemetry/)
    telemetry: TelemetryOptions | None = None
    # a dictionary's features each token carries (model/features/sae/feature.py)
    features: FeatureReadOptions | None = None
    # the sink + window KV cache (model/features/kv_window/schedule.py)
    kv_window: KVWindow | None = None
    # constrained decoding (model/features/structured/): every token from those its grammar allows
    structured: StructuredOutputSpec | None = None
    # yields to other requests in the scheduler (an activation-patching sweep's rows, model/engine/scheduler.py)
    background: bool = False
    # speculative decoding (model/engine/speculative/): at most this many drafts a step for its rows, 0: none;
    # None: the server's --speculative-config
    num_speculative_tokens: int | None = None
    # the LoRA adapter its rows run under, by the name it was loaded with (model/features/lora/: `LoRA.add`); None:
    # the base model
    lora: str | None = None

    def __post_init__(self) -> None:
        if self.interventions is not None and not isinstance(self.interventions, tuple):
            object.__setattr__(self, "interventions", tuple(self.interventions) or None)

    def validate(self, n_layers: int) -> None:
        """Raise ValueError naming the first bad field (the interventions are checked against the prompt where the
        engine plans them, `model.interventions.InterventionPlan`)."""
        if self.hidden_states is not None:
            self.hidden_states.validate(n_layers)
        if self.kv_window is not None:
            self.kv_window.validate()
        if self.telemetry is not None:
            self.telemetry.validate()
        if self.features is not None:
            self.features.validate()
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutputSpec):
                raise ValueError(f"structured must be a StructuredOutputSpec or None, got {self.structured!r}")
            self.structured.validate()  # its errors name the request field it came from
        if not isinstance(self.background, bool):
            raise ValueError(f"background must be a boolean, got {self.background!r}")
        k = self.num_speculative_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
            raise ValueError(f"num_speculative_tokens must be a non-negative integer, got {k!r}")


__all__ = ["InvalidOption", "PLAIN", "RequestOptions"]

PLAIN = RequestOptions()
