"""Attention telemetry streamed with every token (record.py), what a request asks of it (options.py), and the
feature the engine calls (feature.py)."""

from model.features.telemetry.feature import Telemetry
from model.features.telemetry.options import TelemetryOptions
from model.features.telemetry.record import StepTelemetry, TokenTelemetry

__all__ = ["StepTelemetry", "Telemetry", "TelemetryOptions", "TokenTelemetry"]
