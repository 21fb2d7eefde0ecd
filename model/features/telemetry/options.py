"""`TelemetryOptions`: what a request asks its tokens to carry (the computation is record.py beside it).
Torch-free, so the per-request record (model/engine/request_options.py) can hold it without the kernels."""

from __future__ import annotations

import math
from dataclasses import dataclass

from model.massive import MASSIVE_RATIO, MASSIVE_THRESHOLD

MAX_TOP_K = 32


@dataclass(frozen=True)
class TelemetryOptions:
    """What a request's tokens carry (`inspect: {"stream": true}` on a streamed completion)."""

    top_k: int = 5  # attended keys per head and layer
    massive_threshold: float = MASSIVE_THRESHOLD  # Sun et al.'s: |x| > 100 ...
    massive_ratio: float = MASSIVE_RATIO  # ... and |x| >= 1000 x the median |x|
    massive_top_k: int = 3  # largest |x| listed per layer, flagged or not

    def validate(self) -> None:
        for name, hi in (("top_k", MAX_TOP_K), ("massive_top_k", 64)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi:
                raise ValueError(f"telemetry.{name} must be an integer in [1, {hi}], got {v!r}")
        for name in ("massive_threshold", "massive_ratio"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"telemetry.{name} must be a positive finite number, got {v!r}")
