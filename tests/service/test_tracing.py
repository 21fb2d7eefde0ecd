"""Request traces (--otlp-traces-endpoint): a real OTLP/HTTP receiver in the test decodes what the server exports
with the protocol's own messages (opentelemetry-proto's ExportTraceServiceRequest), and finds one span per request,
parented by the request's W3C `traceparent`, whose attributes equal what the client was answered (usage, finish
reasons, the request id) and asked (model, max_tokens, temperature, top_p), and whose timings add up."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

from service.config import Settings

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra (pip install .[tracing]) is part of the test extra")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest, ExportTraceServiceResponse)
from opentelemetry.proto.trace.v1.trace_pb2 import Span  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
MAX_WAITING = 4
LATENCIES = ("time_in_queue", "time_to_first_token", "time_in_model_prefill", "time_in_model_decode",
             "time_in_model_inference", "e2e")


class Receiver:
    """An OTLP/HTTP trace receiver (the collector's side of opentelemetry-proto's trace_service.proto over HTTP):
    POST /v1/traces with an ExportTraceServiceRequest body, answered with an empty ExportTraceServiceResponse."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict, Span]] = []  # (resource attributes, span)
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                assert self.headers["Content-Type"] == "application/x-protobuf"
                req = ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    resource = attributes(rs.resource.attributes)
                    for ss in rs.scope_spans:
                        receiver.spans += [(resource, s) for s in ss.spans]
                receiver.paths.append(self.path)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def by_request_id(self) -> dict[str, tuple[dict, Span]]:
        out: dict[str, tuple[dict, Span]] = {}
        for resource, span in self.spans:
            rid = attributes(span.attributes)["gen_ai.request.id"]
            assert rid not in out, f"two spans for request {rid}"
            out[rid] = (resource, span)
        return out


def attributes(kvs) -> dict:
    """OTLP KeyValues -> a dict (string, bool, int, double and string-array values)."""
    out = {}
    for kv in kvs:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = [x.string_value for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
    return out


@pytest.fixture(scope="module")
def traced(tiny_live):
    receiver = Receiver()
    # no path: /v1/traces added; a short waiting queue for the refusal below
    settings = Settings(otlp_traces_endpoint=receiver.url, chat_template=TEMPLATE, max_waiting=MAX_WAITING)
    with tiny_live(settings, timeout=60) as live:
        live.receiver = receiver
        live.client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        yield live


def traceparent() -> tuple[str, str, str]:
    """A fresh W3C traceparent header (version 00, sampled) and its trace id and parent span id, in hex."""
    trace_id, span_id = f"{random.getrandbits(128):032x}", f"{random.getrandbits(64):016x}"
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def spans_for(live, ids: list[str]) -> dict[str, tuple[dict, Span]]:
    """The spans of these request ids, once the server's batch processor has exported them."""
    assert live.app.state.server.tracing.force_flush()
    deadline = time.monotonic() + 30
    while True:
        found = live.receiver.by_request_id()
        if all(i in found for i in ids) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_one_span_per_request_parented_by_traceparent(traced):
    c, model = traced.client, traced.app.state.server.model_name
    asked = dict(max_tokens=6, temperature=0.7, top_p=0.9, seed=3)
    sent: dict[str, dict] = {}  # request id -> what the client saw

    def headers():
        header, trace_id, parent = traceparent()
        return {"traceparent": header, "tracestate": "vendor=x"}, trace_id, parent

    h, trace_id, parent = headers()
    r = c.completions.create(model=model, prompt="the light of a harbour", extra_headers=h, **asked)
    sent[r.id.removeprefix("cmpl-")] = dict(op="text_completion", trace=trace_id, parent=parent, stream=False,
                                            usage=(r.usage.prompt_tokens, r.usage.completion_tokens),
                                            finish=[r.choices[0].finish_reason])
    h, trace_id, parent = headers()
    chunks = list(c.completions.create(model=model, prompt="a ship at night", stream=True, extra_headers=h,
                                       stream_options={"include_usage": True}, **asked))
    sent[chunks[0].id.removeprefix("cmpl-")] = dict(
        op="text_completion", trace=trace_id, parent=parent, stream=True,
        usage=(chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens),
        finish=[x.choices[0].finish_reason for x in chunks if x.choices and x.choices[0].finish_reason])
    messages = [{"role": "user", "content": "spray from the west"}]
    h, trace_id, parent = headers()
    r = c.chat.completions.create(model=model, messages=messages, extra_headers=h, **asked)
    sent[r.id.removeprefix("chatcmpl-")] = dict(op="chat", trace=trace_id, parent=parent, stream=False,
                                                usage=(r.usage.prompt_tokens, r.usage.completion_tokens),
                                                finish=[r.choices[0].finish_reason])
    h, trace_id, parent = headers()
    chunks = list(c.chat.completions.create(model=model, messages=messages, stream=True, extra_headers=h,
                                            stream_options={"include_usage": True}, **asked))
    sent[chunks[0].id.removeprefix("chatcmpl-")] = dict(
        op="chat", trace=trace_id, parent=parent, stream=True,
        usage=(chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens),
        finish=[x.choices[0].finish_reason for x in chunks if x.choices and x.choices[0].finish_reason])

    spans = spans_for(traced, list(sent))
    assert set(traced.receiver.paths) == {"/v1/traces"}
    for rid, want in sent.items():
        resource, span = spans[rid]
        a = attributes(span.attributes)
        assert resource["service.name"] == "llamascope"
        assert span.trace_id.hex() == want["trace"] and span.parent_span_id.hex() == want["parent"]
        assert span.trace_state == "vendor=x"
        assert span.kind == Span.SpanKind.SPAN_KIND_SERVER and span.name == f"{want['op']} {model}"
        assert a["gen_ai.operation.name"] == want["op"]
        assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == model
        assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"], a["gen_ai.request.top_p"],
                a["gen_ai.request.seed"]) == (6, 0.7, 0.9, 3)
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == want["usage"]
        assert a["gen_ai.response.finish_reasons"] == want["finish"] and len(want["finish"]) == 1
        assert a["llamascope.request.stream"] is want["stream"]
        assert a["http.response.status_code"] == 200 and "error.type" not in a
        lat = {k: a[f"gen_ai.latency.{k}"] for k in LATENCIES}
        assert all(v >= 0 for v in lat.values()), lat
        # the phases partition the request: queue + prefill = TTFT, prefill + decode = inference, and e2e holds them
        assert lat["time_in_queue"] + lat["time_in_model_prefill"] == pytest.approx(lat["time_to_first_token"], abs=1e-9)
        assert lat["time_in_model_prefill"] + lat["time_in_model_decode"] == pytest.approx(
            lat["time_in_model_inference"], abs=1e-9)
        assert lat["time_to_first_token"] + lat["time_in_model_decode"] <= lat["e2e"]
        assert (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 == pytest.approx(lat["e2e"], abs=1e-5)
        assert abs(span.end_time_unix_nano / 1e9 - time.time()) < 300  # wall-clock times, not perf_counter's


def test_without_a_valid_traceparent_the_span_starts_a_trace(traced):
    c, model = traced.client, traced.app.state.server.model_name
    ids = []
    for h in ({}, {"traceparent": "00-not-a-trace-01"}, {"traceparent": f"00-{'0' * 32}-{'1' * 16}-01"}):
        r = c.completions.create(model=model, prompt="stone pier", max_tokens=2, extra_headers=h)
        ids.append(r.id.removeprefix("cmpl-"))
    spans = spans_for(traced, ids)
    traces = set()
    for rid in ids:
        _, span = spans[rid]
        assert span.parent_span_id == b"" and span.trace_id != bytes(16)
        traces.add(span.trace_id)
    assert len(traces) == len(ids)  # each its own new trace


def test_a_refused_request_is_an_error_span(traced):
    """A request the engine refuses at submission (more choices than the waiting queue holds) still ends in one
    span, marked as an error with the HTTP status."""
    state = traced.app.state.server
    header, trace_id, _ = traceparent()
    r = httpx.post(traced.url + "/v1/completions", headers={"traceparent": header}, timeout=60,
                   json={"prompt": "x", "max_tokens": 1, "n": MAX_WAITING + 1})
    assert r.status_code == 429, r.text
    deadline = time.monotonic() + 30
    while True:
        state.tracing.force_flush()
        mine = [s for _, s in traced.receiver.spans if s.trace_id.hex() == trace_id]
        if mine or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(mine) == 1
    a = attributes(mine[0].attributes)
    assert a["http.response.status_code"] == 429 and a["error.type"] == "429"
    assert mine[0].status.code == mine[0].status.STATUS_CODE_ERROR


def test_an_unreachable_collector_never_holds_a_request(tiny_live):
    """Export is the batch processor's thread's business: with nothing listening at the endpoint, requests are
    answered as usual, and the server stops."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tiny_live(Settings(otlp_traces_endpoint=f"http://127.0.0.1:{port}/v1/traces"), timeout=60) as live:
        for _ in range(3):
            r = httpx.post(live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text


def test_off_by_default_nothing_of_the_sdk_is_imported():
    """Without the flag the app has no trace middleware and its process never imports the OpenTelemetry SDK, exporter
    or protobuf (FastAPI itself imports the API's context module)."""
    code = ("import sys\n"
            "from service.config import parse_cli\n"
            "from service.main import create_app\n"
            "import service.common.runner, service.api.openai.routes.chat, service.api.openai.routes.completions\n"
            "app = create_app(parse_cli([]))\n"
            "assert app.state.server.tracing is None\n"
            "assert not [m for m in app.user_middleware if m.cls.__name__ == 'TraceContextMiddleware']\n"
            "bad = [m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter', "
            "'opentelemetry.proto', 'google.protobuf'))]\n"
            "assert not bad, bad\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


def test_a_bad_endpoint_stops_the_server_naming_the_flag():
    run = subprocess.run([sys.executable, "-m", "service", "--otlp-traces-endpoint", "localhost:4318"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "--otlp-traces-endpoint 'localhost:4318'" in run.stderr and "http:// or https://" in run.stderr
    assert Settings(otlp_traces_endpoint="http://collector:4318").otlp_traces_endpoint == "http://collector:4318/v1/traces"
    assert Settings(otlp_traces_endpoint="https://c/x/traces").otlp_traces_endpoint == "https://c/x/traces"
