"""One model's process: `python -m service --model PATH` on a free loopback port, as llama-server's router spawns
one `llama-server` per model (tools/server/server-models.cpp `server_models::load`: a free port, the child's
arguments, a thread reading its output). Its output goes to the router's stderr, each line prefixed with the
model's name; the last lines are kept to say why a load failed.

State, as llama-server's `/models` reports it: "unloaded" (no process), "loading" (started, /health not yet 200),
"loaded", "failed" (its process exited while loading: the exit code and its last lines). Requests in flight are
counted here, so an unload waits for them and the least recently used model is the one evicted.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from service.router.catalog import CatalogEntry

log = logging.getLogger("llamascope.router")

TAIL_LINES = 20
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def free_port() -> int:
    """A port the kernel has just handed out (llama-server's `get_free_port`: bind port 0, read it, close)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end_with_parent() -> None:
    """In the child before exec: SIGTERM it when the router dies, however it dies (prctl PR_SET_PDEATHSIG), so a
    killed router leaves no model processes holding memory and ports."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class Child:
    def __init__(self, entry: CatalogEntry) -> None:
        self.entry = entry
        self.status = "unloaded"
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.last_used = 0.0  # time.monotonic() of the last request routed to it
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.unloading = False  # draining: new requests wait for the unload, then load it again
        self.stopping = False  # the router stopped it: its exit is no crash
        self.exit_code: int | None = None
        self.failure: str | None = None  # why the last load failed (its last lines), while status is "failed"
        self.restarts = 0
        self.info: dict = {}  # the child's own /v1/models entry, read once it is loaded
        self.ready: asyncio.Future | None = None  # resolves when a load started now ends (loaded, or failed)
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def active(self) -> bool:
        """Has a process (loading or loaded): counts towards --models-max and the memory budget."""
        return self.status in ("loading", "loaded")

    def spawn(self, argv: list[str], env: dict[str, str]) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "service", *argv, "--model", str(self.entry.path), "--served-model-name",
               self.name, "--host", "127.0.0.1", "--port", str(self.port)]  # the last of a flag wins
        self.stopping, self.exit_code, self.failure, self.info = False, None, None, {}
        self.tail.clear()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=Path.cwd(), preexec_fn=_end_with_parent)
        self.status = "loading"
        self.ready = asyncio.get_running_loop().create_future()
        threading.Thread(target=self._relay, args=(self.proc,), name=f"router-log-{self.name}", daemon=True).start()
        log.info("model %s: starting on port %d (pid %d)", self.name, self.port, self.proc.pid)

    def _relay(self, proc: subprocess.Popen) -> None:
        """The child's output to ours, line by line, prefixed; ends when the child closes it (its exit)."""
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            sys.stderr.write(f"[{self.name}] {line}\n")
        proc.stdout.close()

    def acquire(self) -> None:
        self.in_flight += 1
        self.idle.clear()
        self.last_used = time.monotonic()

    def release(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    def exited(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    async def wait_healthy(self, client: httpx.AsyncClient, headers: dict[str, str], timeout: float) -> bool:
        """Poll /health until 200 (True) or the process exits (False); TimeoutError past `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.exited() is not None:
                return False
            try:
                r = await client.get(self.url + "/health", headers=headers, timeout=2)
                if r.status_code == 200:
                    models = await client.get(self.url + "/v1/models", headers=headers, timeout=5)
                    self.info = next((m for m in models.json()["data"] if m["id"] == self.name), {})
                    return True
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.05)
        raise TimeoutError(f"model {self.name} did not become ready in {timeout:.0f} s")

    async def stop(self, grace: float) -> None:
        """SIGTERM (the child drains as a single server does), SIGKILL past `grace` + 5 s."""
        proc, self.stopping = self.proc, True
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            deadline = time.monotonic() + grace + 5
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        self.exit_code, self.proc, self.status, self.info = proc.returncode, None, "unloaded", {}
        log.info("model %s: stopped (exit %s)", self.name, proc.returncode)

    def fail(self, reason: str) -> None:
        proc = self.proc
        self.exit_code = proc.poll() if proc is not None else None
        if proc is not None and proc.poll() is None:
            proc.kill()
        self.proc, self.status, self.info = None, "failed", {}
        last = [line for line in self.tail if line.strip()][-3:]
        self.failure = reason + (": " + " | ".join(last) if last else "")
        log.error("model %s: %s", self.name, self.failure)

    def describe(self) -> dict:
        """This model's `status` in /v1/models (llama-server's: `value`, and `failed` with `exit_code`)."""
        status: dict = {"value": self.status}
        if self.status == "failed":
            status.update(failed=True, exit_code=self.exit_code, reason=self.failure)
        if self.unloading:
            status["unloading"] = True
        if self.active:  # the process's own loopback port, as llama-server's router lists it
            status["port"] = self.port
        status.update(in_flight=self.in_flight, restarts=self.restarts,
                      memory_bytes=self.entry.memory_bytes)
        return status
