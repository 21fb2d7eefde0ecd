"""benchmarks/host_overhead.py and benchmarks/serve_throughput.py end to end at small sizes: the engine decodes every
stream every step under the stand-in (else the run is refused), the phases add up, a steady greedy step on the
simulated device path reads nothing back but its one copy, and the served run counts every output token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], tmp_path: Path, timeout: int = 300) -> dict:
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", *args, "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_host_overhead_measures_decode_steps(tmp_path):
    r = _run(["benchmarks.host_overhead", "--streams", "1", "8", "--steps", "12", "--device-ms", "1"], tmp_path)
    assert r["machine"]["commit"] and r["machine"]["date"]
    for n in (1, 8):
        m = r["by_streams"][str(n)]
        assert m["tokens_per_step"] >= n * 10 / 12  # (the run refuses fewer)
        assert m["host_reads"] == 0  # a steady greedy step waits for nothing but its event
        assert m["blocking_waits_per_step"] <= 1 and m["step_ms_median"] > 0
        phases = m["phases_us"]
        assert abs(sum(phases[k] for k in ("schedule", "prepare", "forward", "sample", "update")) - phases["core"]) \
            < 1e-6 * max(1.0, phases["core"])


def test_serve_throughput_counts_every_token(tmp_path):
    r = _run(["benchmarks.serve_throughput", "--tiny", "--concurrency", "3", "--requests-per-client", "2",
              "--max-tokens", "5", "--prompt-len", "4", "--clients", "httpx", "raw"], tmp_path)
    for key in ("3", "3_raw"):  # both clients, each over its own connections
        m = r["runs"]["this"][0]["closed_loop"][key]
        assert (m["requests"], m["output_tokens"]) == (6, 30) and m["tok_s"] > 0
    assert set(r["summary"]) == {"closed_loop_3_tok_s", "closed_loop_3_raw_tok_s"}
    assert r["machine"]["commit"]


@pytest.mark.slow
def test_serve_throughput_with_traces_exports_a_span_per_request(tmp_path):
    """--tracing: the same checkout without and with --otlp-traces-endpoint, the "on" server's spans counted by the
    OTLP sink: one per request, the warm-up's included; none from the "off" server."""
    r = _run(["benchmarks.serve_throughput", "--tiny", "--tracing", "--concurrency", "2", "--requests-per-client", "2",
              "--max-tokens", "3", "--prompt-len", "4"], tmp_path)
    assert [x["spans_exported"] for x in r["runs"]["off"]] == [0]
    assert [x["spans_exported"] for x in r["runs"]["on"]] == [2 * 2 + 1]
    assert set(r["summary"]["closed_loop_2_tok_s"]) == {"off", "on", "ratio"}
