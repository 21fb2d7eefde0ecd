"""`serve run CONFIG` as a user runs it, for the Ray Serve test and benchmark, on one local Ray cluster sized for a
shared 2-core host: `python -m benchmarks.ray_cluster CONFIG` starts the cluster (2 CPUs, a 300 MB object store
instead of 30% of RAM, no dashboard) and then runs Ray's own `serve run` command in it, which deploys the config's
applications and blocks. SIGINT makes `serve run` shut Serve down, and the cluster ends with the process.

Ray's own processes (GCS, raylet, workers) are that process's descendants: they are found by walking /proc from its
pid, so whatever a hung shutdown leaves is ended by id, never by name.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deploy/ray/serve.yaml"
REPLICA_TITLE = "ray::ServeReplica:{app}:LlamascopeReplica"  # the process title Ray gives a replica's worker


def local_config(engine_flags: dict, port: int, apps: dict[str, str], replicas: int = 2,
                 replica_cpus: float = 0.25) -> dict:
    """deploy/ray/serve.yaml made local: loopback `port`, `engine_flags` over the file's, `replicas` fixed replicas of
    `replica_cpus` each; one application per entry of `apps` (route prefix -> router), named after its router.
    Ray's CPUs here are logical (the cluster has 2): they decide what fits, and every replica of both applications
    has to fit at once."""
    base = yaml.safe_load(CONFIG.read_text())
    config = {k: v for k, v in base.items() if k != "applications"}
    config["proxy_location"] = "HeadOnly"
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    template = base["applications"][0]
    config["applications"] = []
    for prefix, router in apps.items():
        app = copy.deepcopy(template)
        app["name"], app["route_prefix"] = router, prefix
        app["args"]["router"] = router
        if router != "prefix_aware":
            app["args"].pop("router_kwargs", None)
        app["args"]["engine_flags"] = {**app["args"]["engine_flags"], **engine_flags}
        for d in app["deployments"]:
            if d["name"] == "LlamascopeReplica":
                d.pop("autoscaling_config", None)
                d["num_replicas"] = replicas
                d["ray_actor_options"] = {"num_cpus": replica_cpus}
            else:
                d["ray_actor_options"] = {"num_cpus": 0.05}
        config["applications"].append(app)
    return config


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc: each process's parent)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class ServeRun:
    """`with ServeRun(config, workdir) as run:` a deployed config; `run.url` is Ray's HTTP proxy."""

    def __init__(self, config: dict, workdir: Path, ready_timeout: float = 240.0, env: dict | None = None) -> None:
        self.config, self.workdir, self.ready_timeout, self.extra_env = config, workdir, ready_timeout, env or {}
        self.url = f"http://127.0.0.1:{config['http_options']['port']}"
        self.proc: subprocess.Popen | None = None
        self.log = workdir / "serve_run.log"

    def __enter__(self) -> "ServeRun":
        path = self.workdir / "serve.yaml"
        path.write_text(yaml.safe_dump(self.config))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMASCOPE_", "RAY_"))}
        env |= {"RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT), **self.extra_env}  # replicas import this checkout
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.ray_cluster", str(path)], cwd=ROOT, env=env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def wait_ready(self) -> None:
        """Every application answers /health through the proxy, and lists all its replicas."""
        deadline = time.monotonic() + self.ready_timeout
        for app in self.config["applications"]:
            want = next(d["num_replicas"] for d in app["deployments"] if d["name"] == "LlamascopeReplica")
            base = self.url + app["route_prefix"].rstrip("/")
            while True:
                assert self.proc.poll() is None, f"serve run exited {self.proc.returncode}:\n{self.log_tail()}"
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{base} not ready in {self.ready_timeout:.0f} s:\n{self.log_tail()}")
                try:
                    if httpx.get(base + "/health", timeout=5).status_code == 200 and \
                            len(self.replicas(app["route_prefix"])) == want:
                        break
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(1)

    def replicas(self, prefix: str = "/") -> list[str]:
        """The application's replica ids, from its Prometheus service-discovery listing."""
        r = httpx.get(self.url + prefix.rstrip("/") + "/replicas", timeout=10)
        r.raise_for_status()
        return [t["labels"]["replica"] for t in r.json()]

    def replica_pids(self, app: str) -> list[int]:
        title = REPLICA_TITLE.format(app=app)
        return [p for p in descendants(self.proc.pid) if cmdline(p).startswith(title)]

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        tree = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # serve run: shut Serve down, then the cluster it started
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in tree):
            time.sleep(0.5)
        for pid in tree:  # what a slow or hung shutdown left: by id, only what this run started
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def main(argv: list[str] | None = None) -> None:
    import ray
    from ray.serve.scripts import cli

    [config] = argv if argv is not None else sys.argv[1:]
    ray.init(num_cpus=2, object_store_memory=300 << 20, include_dashboard=False, namespace="serve")
    cli(["run", config])  # ray's `serve run`: it finds Ray initialized and deploys into this cluster


if __name__ == "__main__":
    main()
