"""A newcomer's paths from a fresh clone, as the README writes them: `make install` (the CPU build of PyTorch, the
package, the default model, the native kernels), then the `llamascope` command `pip install .` gives (`llamascope
serve --help`, `llamascope serve <gguf>`), then Ray Serve in the same venv (`pip install ".[ray]"`, `serve run
deploy/ray/serve-local.yaml`) answering a chat completion; and a replica whose model cannot load saying why
(`serve run` keeps running while Ray retries it).

One test, slow: it installs a virtual environment from nothing (minutes on 2 cores). It clones the repository's
committed state (HEAD), so what it tries is what a clone gets."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from live_server import free_port
from model.loaders import default_model_path

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def sh(cmd: str, cwd: Path, timeout: float = 1200, env: dict | None = None) -> str:
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, f"{cmd}\nexit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def wait_for(url: str, proc: subprocess.Popen, log: Path, timeout: float, ok=lambda r: r.status_code == 200):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            r = httpx.get(url, timeout=5)
            if ok(r):
                return r
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} not ready in {timeout:.0f} s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 120) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(30)


def test_the_readme_paths_from_a_fresh_clone(tmp_path):
    clone = tmp_path / "llamascope"
    sh(f"git clone --quiet {ROOT} {clone}", tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMASCOPE_", "VIRTUAL_ENV", "TORCH_SPEC"))}
    env["PYTHON"] = sys.executable if sys.prefix == sys.base_prefix else os.path.join(sys.base_prefix, "bin", "python3")
    started = time.monotonic()
    sh(f"make install PYTHON={env['PYTHON']}", clone, env=env)
    installed = time.monotonic() - started
    torch = sh(".venv/bin/python -c 'import torch; print(torch.__version__, torch.version.cuda)'", clone)
    assert "+cpu None" in torch, torch  # the CPU build, as the Makefile says

    # `pip install .` gives the `llamascope` command: the wheel it builds declares it, and make install's editable
    # install has it on the venv's PATH
    sh(".venv/bin/pip wheel --quiet --no-deps . -w dist", clone, env=env)
    [wheel] = (clone / "dist").glob("llamascope-*.whl")
    with zipfile.ZipFile(wheel) as z:
        entry_points = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "llamascope = service.cli:main" in entry_points, entry_points
    help_text = sh(".venv/bin/llamascope serve --help", clone)
    assert help_text.startswith("usage: llamascope serve") and "--quantization" in help_text and "MODEL" in help_text
    gguf = default_model_path()  # a GGUF file from disk (this suite's copy of the default model)
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(clone / ".venv/bin/llamascope"), "serve", str(gguf), "--port", str(port),
                                 "--kv-cache-bytes", str(16 << 20)], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        wait_for(f"http://127.0.0.1:{port}/health", proc, log, 300)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "abc", "max_tokens": 4,
                                                                       "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]

    # Ray Serve in the same venv, the README's two commands (the port moved off 8000, which may be taken here)
    sh('.venv/bin/pip install --quiet ".[ray]"', clone, env=env)
    config = clone / "deploy/ray/serve-local.yaml"
    port = free_port()
    config.write_text(config.read_text().replace("port: 8000", f"port: {port}"))
    log = tmp_path / "ray.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(clone / ".venv/bin/serve"), "run", "deploy/ray/serve-local.yaml"], cwd=clone,
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_for(f"http://127.0.0.1:{port}/health", proc, log, 600)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of Japan?"}], "temperature": 0,
            "max_tokens": 32})
        assert r.status_code == 200 and "Tokyo" in r.json()["choices"][0]["message"]["content"], r.text
    finally:
        stop(proc, signal.SIGINT, 180)  # serve run shuts Serve and its local cluster down on Ctrl-C

    # a replica whose model cannot load fails its deployment with the reason `python -m service` exits with
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    config.write_text(re.sub(r"model: null[^\n]*", f"model: {bad}", config.read_text()))
    log = tmp_path / "ray-broken.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(clone / ".venv/bin/serve"), "run", "deploy/ray/serve-local.yaml"], cwd=clone,
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:  # `serve run` itself keeps running (Ray retries the replica): the reason is in its log
        deadline = time.monotonic() + 600
        while not re.search(r"model failed to load: .*broken\.gguf", log.read_text()):
            assert proc.poll() is None or "broken.gguf" in log.read_text(), log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(2)
    finally:
        stop(proc, signal.SIGINT, 180)
    print(f"fresh clone: make install {installed:.0f} s; llamascope serve, Ray Serve and a failed load as documented")
