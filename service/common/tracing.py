"""Request traces: one OpenTelemetry span per generation request, exported over OTLP/HTTP protobuf
(`--otlp-traces-endpoint`, vLLM's flag: vllm/tracing.py).

The span is made when the request ends (`runner.finish`), from what the request path already measured: the HTTP
edge's start and end, the engine's first admission (`Sequence.scheduled_time`) and first-token stamps, and the
time each choice's last output reached the edge. Its timings are vLLM's (`OutputProcessor.do_tracing`,
vllm/v1/engine/output_processor.py, over the timestamps of vllm/v1/metrics/stats.py `RequestStateStats`):

    start ── queue ── admitted ── prefill ── first token ── decode ── last token ── end
    |<───────── time_to_first_token ─────────>|
                      |<────────────── inference ──────────────────>|
    |<──────────────────────────────── e2e ─────────────────────────────────────────>|

Its other attributes are the GenAI semantic conventions' (open-telemetry/semantic-conventions,
docs/gen-ai/gen-ai-spans.md): the operation, the model, the request's sampling fields, token usage and finish
reasons; its parent is the caller's W3C Trace Context (`traceparent` / `tracestate` headers,
https://www.w3.org/TR/trace-context/), so the span joins the caller's trace.

Export never waits on the network: spans go to the SDK's BatchSpanProcessor, whose own thread batches and posts
them. The OpenTelemetry SDK and exporter (`pip install .[tracing]`) are imported only when the flag is given;
without it nothing here runs: no middleware, no span, one `is None` test per request.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from contextvars import ContextVar
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from service.common.runner import RunStats

log = logging.getLogger("llamascope.service")

# The trace context of the request being served, as its W3C headers (set by TraceContextMiddleware)
_TRACE_HEADERS = (b"traceparent", b"tracestate")
_trace_headers: ContextVar[dict[str, str] | None] = ContextVar("llamascope_trace_headers", default=None)

# gen_ai.operation.name by route (the semantic conventions' names); any other route is a chat
_OPERATIONS = {"completions": "text_completion", "inspect": "text_completion"}

# The OTLP/HTTP path of traces (opentelemetry-proto's opentelemetry/proto/collector/trace/v1/trace_service.proto,
# the OTLP specification's default for OTEL_EXPORTER_OTLP_ENDPOINT)
TRACES_PATH = "/v1/traces"
PACKAGES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")


def check_endpoint(url: str) -> str:
    """--otlp-traces-endpoint -> the URL spans are posted to: an http(s) URL, `/v1/traces` added where it has no
    path (a collector's OTLP/HTTP base, `http://host:4318`). ValueError for anything else, or where the
    OpenTelemetry packages are not installed: the server then refuses to start, naming the flag."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"an http:// or https:// URL of an OTLP/HTTP collector is needed (e.g. "
                         f"http://localhost:4318{TRACES_PATH}), got {url!r}")
    missing = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise ValueError(f"request traces need the OpenTelemetry SDK and its OTLP/HTTP exporter "
                         f"(pip install 'llamascope[tracing]'); not installed: {', '.join(missing)}")
    if parts.path in ("", "/"):
        parts = parts._replace(path=TRACES_PATH)
    return urlunsplit(parts)


class TraceContextMiddleware:
    """Pure ASGI: the request's `traceparent` / `tracestate` headers into a context variable that the span, made
    deep in the route, reads. Installed only with --otlp-traces-endpoint."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            found = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in _TRACE_HEADERS}
            if found:
                token = _trace_headers.set(found)
                try:
                    return await self.app(scope, receive, send)
                finally:
                    _trace_headers.reset(token)
        return await self.app(scope, receive, send)


def span_attributes(stats: RunStats, status: int, model: str, end: float) -> dict:
    """A finished request's span attributes: GenAI semantic conventions, vLLM's latency names (seconds), the HTTP
    status. `end`: time.perf_counter() at the request's end; `stats` times are on the same clock."""
    p = stats.params
    a: dict = {
        "gen_ai.operation.name": _OPERATIONS.get(stats.endpoint, "chat"),
        "gen_ai.request.model": model,
        "gen_ai.response.model": model,
        "gen_ai.request.id": stats.request_id,  # vLLM's; the response's id is it with the route's prefix
        "gen_ai.usage.input_tokens": stats.prompt_tokens,
        "gen_ai.usage.output_tokens": stats.completion_tokens,
        "gen_ai.response.finish_reasons": list(stats.finish_reasons),
        "gen_ai.latency.e2e": end - stats.start,
        "http.response.status_code": status,
    }
    if stats.cached_tokens:
        a["gen_ai.usage.cache_read.input_tokens"] = stats.cached_tokens
    if p is not None:
        a["gen_ai.request.max_tokens"] = p.max_tokens
        a["gen_ai.request.temperature"] = float(p.temperature)
        a["gen_ai.request.top_p"] = float(p.top_p)
        if p.top_k > 0:
            a["gen_ai.request.top_k"] = p.top_k
        if p.n != 1:
            a["gen_ai.request.choice.count"] = p.n
        if p.seed is not None:
            a["gen_ai.request.seed"] = p.seed
        if p.presence_penalty:
            a["gen_ai.request.presence_penalty"] = float(p.presence_penalty)
        if p.frequency_penalty:
            a["gen_ai.request.frequency_penalty"] = float(p.frequency_penalty)
        if p.stop:
            a["gen_ai.request.stop_sequences"] = list(p.stop)
        a["llamascope.request.stream"] = p.output_kind != "final"
    if stats.adapter is not None:
        a["llamascope.lora.adapter"] = stats.adapter
    scheduled, first = stats.scheduled_at, stats.first_token_at
    last = max(stats.last_token_at.values()) if stats.last_token_at else None
    if scheduled is not None:
        a["gen_ai.latency.time_in_queue"] = scheduled - stats.start
    if first is not None:
        a["gen_ai.latency.time_to_first_token"] = first - stats.start
        if scheduled is not None:
            a["gen_ai.latency.time_in_model_prefill"] = first - scheduled
        if last is not None:
            a["gen_ai.latency.time_in_model_decode"] = last - first
    if scheduled is not None and last is not None:
        a["gen_ai.latency.time_in_model_inference"] = last - scheduled
    if status != 200:
        a["error.type"] = str(status)
    return a


class RequestTracer:
    """The lifespan's tracer (ServerState.tracing): an SDK TracerProvider of its own (no global one is set, so
    several servers in one process stay apart) with a BatchSpanProcessor over the OTLP/HTTP protobuf exporter. The
    SDK reads the standard OTEL_* variables for what is not given here: OTEL_EXPORTER_OTLP_TRACES_HEADERS,
    _COMPRESSION, _TIMEOUT, OTEL_BSP_* (batching), OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES."""

    def __init__(self, endpoint: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
        self.provider = TracerProvider(resource=Resource.create({} if named else {"service.name": "llamascope"}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("llamascope")
        self.endpoint = endpoint
        self._propagator = TraceContextTextMapPropagator()
        self._server, self._error = SpanKind.SERVER, Status(StatusCode.ERROR)
        self._failed = False

    def record(self, stats: RunStats, status: int, model: str, end: float) -> None:
        """The request's span, parented by its `traceparent` (none, or a malformed one: a new trace). `end`:
        time.perf_counter() at its end. Never raises into the request: a failure is logged once."""
        try:
            now_ns = time.time_ns()  # the span's wall-clock ends; perf_counter stamps are placed back from here
            headers = _trace_headers.get()
            parent = self._propagator.extract(headers) if headers else None
            a = span_attributes(stats, status, model, end)
            span = self.tracer.start_span(f"{a['gen_ai.operation.name']} {model}", context=parent, kind=self._server,
                                          attributes=a, start_time=now_ns - int((end - stats.start) * 1e9))
            if status != 200:
                span.set_status(self._error)
            span.end(end_time=now_ns)
        except Exception:
            if not self._failed:
                self._failed = True
                log.exception("request trace not recorded (further failures are not logged)")

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Export every span recorded so far (tests; shutdown does it too)."""
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """The spans still queued are exported (within the exporter's timeout), then the processor's thread ends."""
        self.provider.shutdown()
