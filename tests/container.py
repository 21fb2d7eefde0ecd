"""Containers for the image tests (tests/deploy/test_image.py, tests/deploy/test_compose.py): started with the machine's container
engine (podman, or docker with CONTAINER_ENGINE=docker), waited on through the image's own HEALTHCHECK, and always
removed. Every wait has a deadline; every failure says what the container logged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterable

import httpx

ENGINE = os.environ.get("CONTAINER_ENGINE") or "podman"


def engine(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """One engine command; a non-zero exit (with check) fails with its output."""
    if shutil.which(ENGINE) is None:
        raise RuntimeError(f"{ENGINE} is not installed (Debian: apt-get install podman runc)")
    r = subprocess.run([ENGINE, *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{ENGINE} {' '.join(args)} exited {r.returncode}:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return r


class Container:
    """`ENGINE run -d` of an image; `remove()` (or the with-block's end) stops and deletes it."""

    def __init__(self, image: str, name: str, args: Iterable[str] = (), command: Iterable[str] = ()) -> None:
        self.image, self.name = image, name
        engine("rm", "-f", "-t", "0", name, check=False)  # one left by an interrupted run
        engine("run", "-d", "--name", name, *args, image, *command, timeout=180)

    def __enter__(self) -> "Container":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        engine("rm", "-f", "-t", "0", self.name, check=False)

    def logs(self) -> str:
        r = engine("logs", self.name, check=False)
        return r.stdout + r.stderr

    def inspect(self) -> dict:
        return json.loads(engine("inspect", self.name).stdout)[0]

    def running(self) -> bool:
        return bool(self.inspect()["State"]["Running"])

    def health(self) -> str:
        state = self.inspect()["State"]
        return (state.get("Health") or state.get("Healthcheck") or {}).get("Status", "")

    def wait_healthy(self, timeout: float = 300) -> float:
        """Until the image's HEALTHCHECK command passes in the container; returns the seconds it took. podman runs
        healthchecks from systemd timers, which a machine without systemd lacks, so here `podman healthcheck run`
        runs the image's own command each round; docker runs it on its schedule and the status is read."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if not self.running():
                raise AssertionError(f"{self.name} exited before it was healthy:\n{self.logs()[-4000:]}")
            if ENGINE == "podman":
                if engine("healthcheck", "run", self.name, check=False, timeout=60).returncode == 0:
                    return time.monotonic() - t0
            elif self.health() == "healthy":
                return time.monotonic() - t0
            time.sleep(2)
        raise AssertionError(f"{self.name}: not healthy after {timeout:.0f} s:\n{self.logs()[-4000:]}")

    def exec(self, *command: str) -> str:
        return engine("exec", self.name, *command).stdout

    def signal(self, sig: str) -> None:
        engine("kill", "--signal", sig, self.name)

    def wait_exit(self, timeout: float) -> int:
        """The container's exit status, once it has exited (within `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.inspect()["State"]
            if not state["Running"] and state.get("Status", "").lower() in ("exited", "stopped", "dead"):
                return int(state["ExitCode"])
            time.sleep(0.2)
        raise AssertionError(f"{self.name} still running {timeout:.0f} s later:\n{self.logs()[-4000:]}")


def stream(url: str, body: dict, events: list, started: threading.Event) -> None:
    """A streamed completion: every `data:` payload appended to `events`; `started` set at the first token."""
    try:
        with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            events.append(("status", r.status_code))
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(("data", line[6:]))
                    started.set()
    except httpx.HTTPError as e:
        events.append(("error", repr(e)))
    finally:
        started.set()


def sse_chunks(events: list) -> tuple[list[dict], list[str]]:
    """The stream's JSON chunks and its choices' finish reasons; it must have ended with `data: [DONE]`."""
    assert ("status", 200) in events, events[:3]
    data = [e for kind, e in events if kind == "data"]
    assert data and data[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(d) for d in data[:-1]]
    return chunks, [ch["finish_reason"] for c in chunks for ch in c.get("choices", []) if ch["finish_reason"]]
