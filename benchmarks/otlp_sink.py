"""An OTLP/HTTP trace sink for benchmarks: accepts every export (POST /v1/traces, an ExportTraceServiceRequest,
opentelemetry-proto's trace_service.proto), counts its spans, and answers GET /count with the total. Run in its own
process, so that decoding spans takes no time from the measured client's.

    .venv/bin/python -m benchmarks.otlp_sink --port 4318
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


def serve(port: int) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                          ExportTraceServiceResponse)

    spans = 0
    empty = ExportTraceServiceResponse().SerializeToString()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            nonlocal spans
            req = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
            spans += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
            self._answer(empty, "application/x-protobuf")

        def do_GET(self):
            self._answer(json.dumps({"spans": spans}).encode(), "application/json")

        def _answer(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


class Sink:
    """The sink in a child process on a free port: `url` is the endpoint to give --otlp-traces-endpoint."""

    def __init__(self, python: str = sys.executable) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([python, "-m", "benchmarks.otlp_sink", "--port", str(self.port)])
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"
        deadline = time.monotonic() + 60
        while True:
            try:
                self.spans()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the OTLP sink did not start")
                time.sleep(0.1)

    def spans(self) -> int:
        return httpx.get(f"http://127.0.0.1:{self.port}/count", timeout=5).json()["spans"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.otlp_sink", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=4318)
    serve(p.parse_args(argv).port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
