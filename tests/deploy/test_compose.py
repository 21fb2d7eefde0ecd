"""The compose stack's CPU profile, brought up from docker-compose.yml as written (podman-compose from PyPI): the
server from the built image, and Prometheus from an image built from Debian's `prometheus` package, swapped in
through the file's PROMETHEUS_IMAGE variable (deploy/prometheus/Dockerfile, `make prometheus-image`). Prometheus
finds the server through the `llamascope` network alias (DNS service discovery, deploy/prometheus/prometheus.yml)
and scrapes its `llamascope_*` series; the test reads them back through Prometheus's HTTP API.

Grafana is not started: its image cannot be fetched here. Its provisioning and every dashboard query are checked
against a real Prometheus in tests/service/test_prometheus.py.

Marked `image`: collected only with `--image llamascope:cpu` (`make image-test`)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from container import ENGINE, engine

pytestmark = pytest.mark.image

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "llamascope-compose-test"
PROMETHEUS_IMAGE = os.environ.get("PROMETHEUS_IMAGE") or "localhost/llamascope-prometheus:debian"
SERVER, PROMETHEUS = "http://127.0.0.1:8000", "http://127.0.0.1:9090"  # the ports the compose file publishes


def compose_command() -> list[str]:
    found = shutil.which("podman-compose") or str(Path(sys.executable).parent / "podman-compose")
    if ENGINE != "podman" or not Path(found).is_file():
        raise RuntimeError(f"this test drives podman-compose (the `test` extra installs it) and podman, not {ENGINE}")
    return [found, "-p", PROJECT]


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def compose(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "COMPOSE_PROFILES": "cpu", "PROMETHEUS_IMAGE": PROMETHEUS_IMAGE}
    return subprocess.run(compose_command() + list(args), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def stack(pytestconfig):
    image = pytestconfig.getoption("--image")
    assert image in ("llamascope:cpu", "localhost/llamascope:cpu"), \
        f"docker-compose.yml runs llamascope:cpu; this run was given {image}"
    assert engine("image", "exists", PROMETHEUS_IMAGE, check=False).returncode == 0, \
        f"no {PROMETHEUS_IMAGE}: build it with `make prometheus-image`"
    compose("down", "-t", "0", timeout=120)  # a stack left by an interrupted run
    taken = [p for p in (8000, 9090) if port_taken(p)]
    assert not taken, f"ports {taken} are in use: the compose file publishes 8000 and 9090"
    try:
        up = compose("up", "-d", "llamascope-cpu", "prometheus")  # grafana's image cannot be fetched here
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        yield
    finally:
        down = compose("down", "-t", "10", timeout=180)
        assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]


def server_container() -> str:
    return f"{PROJECT}_llamascope-cpu_1"


def wait_for(what: str, check, timeout: float, logs_of: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(2)
    logs = engine("logs", logs_of, check=False)
    raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last})\n{(logs.stdout + logs.stderr)[-3000:]}")


def prometheus_query(expr: str) -> list[dict]:
    r = httpx.get(PROMETHEUS + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", r.text
    return body["data"]["result"]


def test_prometheus_scrapes_the_server_found_through_its_alias(stack):
    wait_for("the server's /health", lambda: httpx.get(SERVER + "/health", timeout=5).status_code == 200, 300,
             server_container())
    # the compose file's healthcheck (its own command, not the image's) passes in the container
    assert engine("healthcheck", "run", server_container(), check=False, timeout=60).returncode == 0
    r = httpx.post(SERVER + "/v1/completions", json={"prompt": "One, two,", "max_tokens": 5, "ignore_eos": True},
                   timeout=120)
    assert r.status_code == 200, r.text

    # The server's address on the stack's network, as Prometheus's DNS discovery must have found it
    networks = engine("inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}",
                      server_container()).stdout.split()
    assert len(networks) == 1, networks
    instance = f"{networks[0]}:8000"

    def scraped():
        result = prometheus_query('llamascope_requests_total{job="llamascope",endpoint="completions",status="200"}')
        return [s for s in result if s["metric"]["instance"] == instance and float(s["value"][1]) >= 1]

    series = wait_for("llamascope_requests_total in Prometheus", scraped, 120, f"{PROJECT}_prometheus_1")
    assert len(series) == 1, series
    targets = httpx.get(PROMETHEUS + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    [target] = [t for t in targets if t["labels"]["job"] == "llamascope"]
    assert target["health"] == "up" and target["scrapeUrl"] == f"http://{instance}/metrics", target
    # every llamascope_* family the server exports reached Prometheus, not only the one asked for above
    names = httpx.get(PROMETHEUS + "/api/v1/label/__name__/values", timeout=10).json()["data"]
    exported = {n for n in names if n.startswith("llamascope_")}
    assert {"llamascope_generation_tokens_total", "llamascope_kv_cache_usage_ratio",
            "llamascope_time_to_first_token_seconds_bucket", "llamascope_num_requests_running"} <= exported, exported
    generated = prometheus_query('llamascope_generation_tokens_total{job="llamascope"}')
    assert generated and float(generated[0]["value"][1]) >= 5, generated
    print(f"Prometheus scraped {len(exported)} llamascope_* series names from {instance}")
