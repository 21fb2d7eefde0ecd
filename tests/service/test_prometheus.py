"""The Grafana dashboard against a real Prometheus: Debian's `prometheus` (.ci/run installs it) scrapes a live
server with the repo's scrape config (deploy/prometheus/prometheus.yml, its DNS discovery swapped for the test
server's loopback address), traffic goes through, and every PromQL expression of the dashboard
(deploy/grafana/dashboards/llamascope.json) is evaluated through Prometheus' HTTP API: each must return data, and
finite numbers. A panel whose query returns nothing shows "No data" in Grafana, which hides a broken query."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from live_server import free_port, wait_until_ready
from service.config import Settings

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
SCRAPE_INTERVAL = "1s"  # the repo's 5 s would make the test wait 20 s and more for rate() to see two samples
# Grafana's $__rate_interval = max($__interval + scrape interval, 4 x scrape interval): a window holding >= 4 scrapes
RATE_INTERVAL = "10s"

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="no prometheus on PATH: install Debian's `prometheus` package (.ci/run does)")


def dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads((ROOT / "deploy/grafana/dashboards/llamascope.json").read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]


def scrape_config(target: str) -> dict:
    """The repo's Prometheus config, scraping `target` instead of the compose network's `llamascope` alias."""
    cfg = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = SCRAPE_INTERVAL
    job = cfg["scrape_configs"][0]
    assert job.pop("dns_sd_configs")[0]["port"] == 8000  # what is replaced: DNS discovery of the servers
    job["static_configs"] = [{"targets": [target]}]
    return cfg


@pytest.fixture(scope="module")
def scraped_server(tiny_live):
    with tiny_live(Settings(max_num_seqs=4, kv_cache_bytes=4 << 20), timeout=60) as server:
        yield server


@pytest.fixture(scope="module")
def prometheus(scraped_server, tmp_path_factory):
    d = tmp_path_factory.mktemp("prometheus")
    (d / "prometheus.yml").write_text(yaml.safe_dump(scrape_config(f"127.0.0.1:{scraped_server.port}")))
    port = free_port()
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(d / "log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, proc, lambda: (d / "log").read_text()[-3000:], timeout=60, path="/-/ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def query(url: str, expr: str) -> list[dict]:
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert r["status"] == "success", (expr, r)
    return r["data"]["result"]


def send_traffic(url: str, seconds: float) -> None:
    """Completions (streamed and not, a repeated prompt for prefix-cache hits), chat and one 400, for `seconds`."""
    prompt = "a shared prefix that fills whole KV blocks, then some more text " * 2
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=url, timeout=60) as c:
        while time.monotonic() < deadline:
            assert c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "ignore_eos": True}).status_code == 200
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "stream": True, "ignore_eos": True})
            assert r.status_code == 200 and r.text.rstrip().endswith("[DONE]")
            assert c.post("/v1/completions", json={"prompt": ""}).status_code == 400
            time.sleep(0.1)


def test_every_dashboard_query_returns_data(scraped_server, prometheus):
    queries = dashboard_queries()
    assert len(queries) >= 20
    # Scrapes of the idle server first, then traffic across several scrapes, then one more scrape: every rate()
    # window at query time holds samples from before and after the traffic.
    deadline = time.monotonic() + 30
    while not query(prometheus, 'up{job="llamascope"} == 1'):
        assert time.monotonic() < deadline, query(prometheus, "up")
        time.sleep(0.5)
    send_traffic(scraped_server.url, 5.0)
    time.sleep(2.5)
    empty, not_finite = [], []
    for title, expr in queries:
        result = query(prometheus, expr.replace("$__rate_interval", RATE_INTERVAL))
        if not result:
            empty.append((title, expr))
        elif not all(math.isfinite(float(s["value"][1])) for s in result):
            not_finite.append((title, expr, [s["value"][1] for s in result]))
    assert empty == [] and not_finite == []
