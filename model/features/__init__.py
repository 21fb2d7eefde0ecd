"""Per-row features: each in a folder of its own, plugged into the engine through one protocol (protocol.py) and
listed in one registry (registry.py): lora/, interventions/, kv_window/, telemetry/, structured/, and sae/ (sparse
autoencoders and transcoders: the dictionaries, their file formats, and the `features` each token carries).
Import direction: model.engine -> model.features -> the network."""

from model.features.protocol import EngineView, Feature, InvalidOption, Part, StepParts, StepRow, StepView
from model.features.kv_window import KVWindow
from model.features.structured import StructuredOutputSpec
from model.features.telemetry import TelemetryOptions, TokenTelemetry

__all__ = ["EngineView", "Feature", "InvalidOption", "KVWindow", "Part", "StepParts", "StepRow", "StepView",
           "StructuredOutputSpec", "TelemetryOptions", "TokenTelemetry"]
