"""Scale-out by replicas: the compose variant with nginx in front, the Kubernetes manifests (validated against the
Kubernetes JSON schemas shipped in the `kubernetes-validate` package), and a live run of two replicas behind a real
nginx (Debian's package) using the repo's proxy settings, with one replica killed mid-run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from benchmarks.tiny_checkpoint import write_tiny_checkpoint
from live_server import free_port, wait_until_ready

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
PROXY_CONF = ROOT / "deploy/nginx/llamascope-proxy.conf"
NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


def test_compose_replicas_variant():
    services = COMPOSE["services"]
    cpu = services["llamascope-cpu-replicas"]
    assert cpu["profiles"] == ["cpu-replicas"] and cpu["deploy"]["replicas"] == "${LLAMASCOPE_REPLICAS:-2}"
    gpus = {name: svc for name, svc in services.items() if name.startswith("llamascope-gpu-")}
    assert sorted(gpus) == [f"llamascope-gpu-{i}" for i in range(8)]  # one service per GPU (tests/deploy/test_deploy.py)
    for svc in [cpu, *gpus.values()]:
        assert "ports" not in svc  # only nginx publishes :8000
        assert "llamascope" in svc["networks"]["default"]["aliases"] and "/health" in " ".join(svc["healthcheck"]["test"])
    assert cpu["image"] == services["llamascope-cpu"]["image"]
    assert all(svc["image"] == services["llamascope-gpu"]["image"] for svc in gpus.values())
    for profile, n in (("gpu-replicas", 2), ("gpu-replicas-4", 4), ("gpu-replicas-8", 8)):
        assert sorted(name for name, svc in gpus.items() if profile in svc["profiles"]) == sorted(list(gpus)[:n])
    nginx = services["nginx"]
    replica_profiles = {p for name, svc in services.items() if "replicas" in name or name.startswith("llamascope-gpu-")
                        for p in svc["profiles"]}
    assert set(nginx["profiles"]) == replica_profiles and nginx["ports"] == ["8000:8000"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in nginx["volumes"])
    assert mounts["./deploy/nginx/llamascope-proxy.conf"] == "/etc/nginx/llamascope-proxy.conf"
    conf = (ROOT / "deploy/nginx/nginx.conf").read_text()
    assert "include /etc/nginx/llamascope-proxy.conf;" in conf and "least_conn;" in conf
    assert "server llamascope:8000 resolve" in conf and "resolver 127.0.0.11" in conf
    proxy = PROXY_CONF.read_text()
    for needle in ("proxy_buffering off;", "proxy_read_timeout 3600s;", "proxy_next_upstream error timeout http_502 http_503 non_idempotent;"):
        assert needle in proxy, needle


def test_kubernetes_manifests_validate():
    import kubernetes_validate

    kustomization = yaml.safe_load((ROOT / "deploy/k8s/kustomization.yaml").read_text())
    docs = {}
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((ROOT / "deploy/k8s" / name).read_text()):
            kubernetes_validate.validate(doc, "1.34.0", strict=True)  # raises on any unknown or mistyped field
            docs[doc["kind"]] = doc
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    svc = docs["Service"]
    assert svc["spec"]["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]
    hpa = docs["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    metrics = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert metrics == {"llamascope_num_requests_waiting", "llamascope_kv_cache_usage_ratio"}
    rules = yaml.safe_load(docs["ConfigMap"]["data"]["config.yaml"])["rules"]
    assert {r["name"]["matches"] for r in rules} == metrics  # the adapter serves exactly what the HPA asks for


def _strict(schema):
    """A CRD's structural schema as the API server applies it with `kubectl apply --validate=strict`: an object with
    `properties` and no `additionalProperties` or `x-kubernetes-preserve-unknown-fields` takes no other field
    (the server would prune it silently), and int-or-string fields take either."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def test_kuberay_rayservice_validates():
    """deploy/k8s/rayservice.yaml against KubeRay v1.7.0's RayService v1 schema (tests/data/kuberay_rayservice_v1_schema.json:
    the CRD's openAPIV3Schema from ray-operator/config/crd/bases/ray.io_rayservices.yaml, Apache-2.0, descriptions and
    `status` dropped), strictly; its pod templates against the Kubernetes 1.34 schemas; and its Serve config against
    deploy/ray/serve.yaml: the same application, only the engine flags and the replicas' resources differ."""
    import jsonschema
    import kubernetes_validate

    doc = yaml.safe_load((ROOT / "deploy/k8s/rayservice.yaml").read_text())
    schema = _strict(json.loads((ROOT / "tests/data/kuberay_rayservice_v1_schema.json").read_text()))
    errors = [f"{list(e.path)}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]
    assert errors == []
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    cluster = doc["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": group["template"]}
        kubernetes_validate.validate(pod_template, "1.34.0", strict=True)
    workers = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
    assert workers["limits"]["nvidia.com/gpu"] == 1
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["ray"] == [f"ray[serve]=={cluster['rayVersion']}"]

    serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
    local = yaml.safe_load((ROOT / "deploy/ray/serve.yaml").read_text())
    [app], [local_app] = serve["applications"], local["applications"]
    replica = next(d for d in app["deployments"] if d["name"] == "LlamascopeReplica")
    assert replica["ray_actor_options"]["num_gpus"] == 1 and app["args"]["engine_flags"]["device"] == "cuda"

    def shape(a):  # the application less what differs between one machine and a GPU cluster
        a = json.loads(json.dumps(a))
        a["args"].pop("engine_flags")
        for d in a["deployments"]:
            d.pop("ray_actor_options")
            d.pop("max_ongoing_requests", None)
            d.get("autoscaling_config", {}).pop("target_ongoing_requests", None)
        return a

    assert shape(app) == shape(local_app)
    # the RayService replaces the Deployment path, it is not applied with it
    assert "rayservice.yaml" not in yaml.safe_load((ROOT / "deploy/k8s/kustomization.yaml").read_text())["resources"]


def _start_replica(model_dir: Path, port: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMASCOPE_")}
    return subprocess.Popen([sys.executable, "-m", "service", "--model", str(model_dir), "--port", str(port), "--threads", "1",
                             "--kv-cache-bytes", str(8 << 20)], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    wait_until_ready(url, proc, lambda: proc.stderr.read().decode()[-2000:], timeout)


def _served(url: str) -> int:
    """Requests this replica answered, from its own /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if fam.name == "llamascope_requests":
            total += sum(int(s.value) for s in fam.samples if s.name.endswith("_total"))
    return total


def _nginx_conf(tmp: Path, listen: int, backends: list[int]) -> Path:
    for d in ("body", "proxy", "fastcgi", "uwsgi", "scgi", "logs"):
        (tmp / d).mkdir(exist_ok=True)
    servers = "\n".join(f"        server 127.0.0.1:{p} max_fails=1 fail_timeout=10s;" for p in backends)
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/logs/error.log warn;
events {{ worker_connections 256; }}
http {{
    client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy; fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
    log_format upstream '$status $upstream_addr $upstream_status';
    access_log {tmp}/logs/access.log upstream;
    upstream llamascope {{
        least_conn;
{servers}
        keepalive 16;
    }}
    server {{
        listen 127.0.0.1:{listen};
        include {PROXY_CONF};
    }}
}}
""")
    return conf


def _request(url: str, i: int) -> tuple[int, str]:
    """Alternating completions / chat, streamed and not; returns (status, text)."""
    chat, stream = i % 2 == 1, i % 4 >= 2
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": 8, "temperature": 0, "stream": stream}
    body |= {"messages": [{"role": "user", "content": f"hello {i}"}]} if chat else {"prompt": f"request {i}:"}
    try:
        with httpx.Client(timeout=60) as client:
            if not stream:
                r = client.post(url + path, json=body)
                return r.status_code, r.text
            with client.stream("POST", url + path, json=body) as r:
                text = "".join(r.iter_text())
                ok = r.status_code == 200 and text.rstrip().endswith("data: [DONE]") and '"error"' not in text
                return (r.status_code if ok else 599), text
    except httpx.HTTPError as e:  # the connection itself failed
        return 598, repr(e)


@pytest.mark.skipif(NGINX is None, reason="nginx not installed: Debian's `nginx` package (.ci/run installs it)")
def test_two_replicas_behind_nginx_survive_losing_one(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "model", seed=5)
    ports = [free_port(), free_port()]
    replicas = [_start_replica(model, p) for p in ports]
    nginx = None
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url, proc in zip(urls, replicas):
            _wait_healthy(url, proc)
        front_port = free_port()
        nginx = subprocess.Popen([NGINX, "-p", str(tmp_path), "-c", str(_nginx_conf(tmp_path, front_port, ports))],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        front = f"http://127.0.0.1:{front_port}"
        _wait_healthy(front, nginx, timeout=30)

        # 100 requests, 8 at a time; replica 0 is killed (SIGKILL: a crash, no drain) once 40 have finished
        results: dict[int, tuple[int, str]] = {}
        started_after_kill: set[int] = set()
        killed = threading.Event()
        lock = threading.Lock()

        def one(i: int) -> None:
            after = killed.is_set()
            res = _request(front, i)
            with lock:
                results[i] = res
                if after:
                    started_after_kill.add(i)
                if len(results) == 40 and not killed.is_set():
                    before = [_served(u) for u in urls]
                    replicas[0].send_signal(signal.SIGKILL)
                    replicas[0].wait(10)
                    killed.set()
                    results["served_before_kill"] = before  # type: ignore[index]

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(100)))
        served_before = results.pop("served_before_kill")  # type: ignore[call-overload]
        assert all(n > 0 for n in served_before), f"both replicas served before the kill: {served_before}"
        assert len(started_after_kill) >= 40
        failed_later = {i: results[i] for i in started_after_kill if results[i][0] != 200}
        assert failed_later == {}, list(failed_later.items())[:3]
        # requests in flight at the kill may fail, but none hangs and none other than those
        assert len(results) == 100
        assert sum(1 for s, _ in results.values() if s != 200) <= 8
        assert _served(urls[1]) >= len(started_after_kill)
    finally:
        if nginx is not None:
            nginx.send_signal(signal.SIGQUIT)
            nginx.wait(10)
        for proc in replicas:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
