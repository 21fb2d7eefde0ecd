"""A real uvicorn server on a free loopback port, in a thread, for tests that talk HTTP like a client does."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_ready(url: str, proc: subprocess.Popen, exit_log: Callable[[], str], timeout: float = 120,
                     path: str = "/health") -> None:
    """Poll `url + path` until it answers 200; fail with `exit_log()` if the process exits first (it is called
    only then: reading a live process's pipe would block)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, exit_log()
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url + path)


class LiveServer:
    def __init__(self, app, ready_path: str = "/health", timeout: float = 120.0) -> None:
        self.app = app
        # The listening socket is bound here and handed to uvicorn, never closed in between: a port picked free and
        # bound later can be taken meanwhile (a tensor-parallel server's workers open connections of their own).
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.ready_path, self.timeout = ready_path, timeout

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.__exit__()
        raise RuntimeError("server did not become ready")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@contextlib.contextmanager
def tiny_live_server(settings=None, model=None, **live_kw) -> Iterator[LiveServer]:
    """The service over a tiny random model and the byte tokenizer (tests/tiny.py), live on loopback: what most
    service tests run against (`tiny_live` in tests/conftest.py hands this out). `model`: another tiny model;
    `settings`: the server's (default `Settings()`). The LiveServer carries `app` and `model`."""
    from model.loaders.checkpoint import LoadedModel
    from service.config import Settings
    from service.main import create_app
    from tiny import byte_tokenizer, tiny_model

    loaded = LoadedModel(model if model is not None else tiny_model(), byte_tokenizer(), Path("tiny"), "tiny", 0.0)
    app = create_app(settings if settings is not None else Settings(), loaded=loaded, wait_ready=True)
    with LiveServer(app, **live_kw) as live:
        live.model = loaded.model
        yield live


def idle_stats(app, timeout: float = 30.0):
    """The engine's stats (`app.state.server.stats`, the snapshot its thread publishes) once nothing runs or waits
    and every KV block is free again; the last snapshot if that does not happen within `timeout`."""
    state = app.state.server
    deadline = time.monotonic() + timeout
    while True:
        s = state.stats
        if (s.num_running, s.num_waiting, s.num_free_blocks) == (0, 0, s.num_blocks) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def is_idle(stats) -> bool:
    return stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks


def engine_core(app):
    """The Engine under a live app's AsyncEngine, for its test hook only (`step_fault_hook`: called inside every
    step with its scheduled rows, it may raise; model/engine/engine.py). Everything else a test reads goes through
    the app's public handles (`app.state.server.stats`, the HTTP API)."""
    return app.state.server.engine.engine


@contextlib.contextmanager
def completions_beside(url: str, n: int) -> Iterator[tuple[str, list[str]]]:
    """`n` short greedy completions one after another on a thread while the block runs (other traffic in the same
    batches): yields (the completion's text alone, the texts of the `n`, all in once the block has ended)."""
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    texts: list[str] = []

    def traffic() -> None:
        for _ in range(n):
            texts.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"])

    t = threading.Thread(target=traffic)
    t.start()
    try:
        yield alone, texts
    finally:
        t.join()
