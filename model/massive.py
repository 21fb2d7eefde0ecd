"""Sun et al. 2024 ("Massive Activations in Large Language Models", section 2): an activation is massive when
|x| > 100 and |x| >= 1000 x the median |x| of its hidden state. The two numbers every reader of that criterion
defaults to: /inspect (model/probes), the streamed telemetry (model/features/telemetry/) and the HTTP schemas."""

MASSIVE_THRESHOLD = 100.0
MASSIVE_RATIO = 1000.0
