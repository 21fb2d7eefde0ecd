"""Attention telemetry as a per-row feature (model/features/protocol.py): the request's `telemetry` option, checked
against the engine, and each step's records (record.py) for the sampled rows that asked."""

from __future__ import annotations

from model.features.protocol import Feature, InvalidOption, StepView
from model.features.telemetry.options import TelemetryOptions
from model.features.telemetry.record import StepTelemetry, step_telemetry


class Telemetry(Feature):
    name = "telemetry"
    native_defaults = {"telemetry": []}  # step_layers' telemetry list: empty, nothing recorded

    def check(self, value: TelemetryOptions) -> None:
        if self.engine.distributed:
            raise InvalidOption("inspect", "attention telemetry is not supported with tensor parallelism")

    def prepare(self, step: StepView) -> StepTelemetry | None:
        return step_telemetry(step)
