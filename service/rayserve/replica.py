"""One Ray Serve replica: the llamascope ASGI app (service/main.py `create_app`) with its own engine, run in-process.

Each forwarded `ReplicaCall` becomes one ASGI HTTP call into the unchanged app; the replica streams back the
response start (`{"status", "headers"}`) and then the body chunks as they come, so SSE streams pass event by event.
The app's lifespan runs here too: the model loads in the constructor (Ray counts the replica as starting until it
returns), and the engine stops in `__del__`, which Ray calls on a graceful replica shutdown.

Ray's health check asks `check_health`: a replica whose engine stopped (a failure it cannot recover from,
docs/development.md rule 9) fails it, and Ray replaces the replica, as Kubernetes restarts a pod whose /health is 503.

Two paths are answered here rather than by the app, for the per-replica metrics (service/rayserve/router.py routes
them): `GET /replicas` lists the replicas in Prometheus' HTTP service discovery format, each with the path that
reaches its own `/metrics`, and `GET /replicas/{id}/metrics` is that replica's `/metrics`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator

from ray import serve

from service.config import Settings
from service.common.errors import envelope
from service.main import create_app
from service.rayserve.call import ReplicaCall

log = logging.getLogger("ray.serve")  # Serve's logger: replica logs reach the `serve run` console and Ray's log files

REPLICA_HEADER = "x-llamascope-replica"  # which replica answered (its Ray Serve unique id)
_APP_EXIT_SECONDS = 10.0  # how long an abandoned call's app task gets to close before it is cancelled


class LlamascopeReplica:
    async def __init__(self, engine_flags: dict | None = None) -> None:
        """`engine_flags`: the server's settings by field name (`python -m service --help`, docs/configuration.md),
        as in the `serve run` config file; `LLAMASCOPE_*` environment variables apply beneath them."""
        self.settings = Settings(**(engine_flags or {}))
        self.app = create_app(self.settings, wait_ready=True)
        self.state = self.app.state.server
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        if not self.state.ready:  # the reason `python -m service` exits 1 with: Ray marks the replica failed
            await self._lifespan.__aexit__(None, None, None)
            raise RuntimeError(self.state.fatal_error or "the engine is not running")
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id if context is not None else "local"
        log.info("replica %s (pid %d) serving %s", self.replica_id, os.getpid(), self.state.model_name)

    def check_health(self) -> None:
        if self.state.fatal_error or not self.state.ready:
            raise RuntimeError(self.state.fatal_error or "the engine is not running")

    async def __del__(self) -> None:
        await self._lifespan.__aexit__(None, None, None)

    async def __call__(self, call: ReplicaCall) -> AsyncIterator[dict | bytes]:
        if call.replica_ids is not None:
            async for part in _json(200, self._listing(call)):
                yield part
            return
        path = call.path
        if call.target_replica is not None:
            if call.target_replica != self.replica_id:
                async for part in _json(404, envelope(404, f"no replica {call.target_replica!r}", code="replica_not_found")):
                    yield part
                return
            path = "/" + call.path.split("/", 3)[3]  # /replicas/{id}/metrics -> /metrics
        async for part in self._asgi(call, path):
            yield part

    def _listing(self, call: ReplicaCall) -> list[dict]:
        """Prometheus `http_sd_configs`: one target per replica, all through the address the caller used."""
        host = dict(call.headers).get(b"host", b"127.0.0.1:8000").decode("latin-1")
        return [{"targets": [host], "labels": {"__metrics_path__": f"{call.route_prefix}/replicas/{rid}/metrics", "replica": rid}}
                for rid in call.replica_ids]

    async def _asgi(self, call: ReplicaCall, path: str) -> AsyncIterator[dict | bytes]:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http", "root_path": "",
            "method": call.method, "path": path, "raw_path": path.encode(), "query_string": call.query_string,
            "headers": call.headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
        }
        messages: asyncio.Queue = asyncio.Queue()
        body_sent = False
        gone = asyncio.Event()  # the caller stopped reading (client disconnect, ingress cancelled): the app's
        # disconnect watch (service/common/runner.py) then aborts the request and frees its blocks

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": call.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await messages.put(message)

        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while True:
                message = await messages.get()
                if message is None:  # the app returned (or raised) without finishing its response
                    if not task.cancelled() and task.exception() is not None:
                        raise task.exception()
                    return
                if message["type"] == "http.response.start":
                    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                    yield {"status": message["status"], "headers": headers + [(REPLICA_HEADER, self.replica_id)]}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        return
        finally:
            gone.set()
            if not task.done():
                done, _ = await asyncio.wait({task}, timeout=_APP_EXIT_SECONDS)
                if not done:
                    task.cancel()


async def _json(status: int, payload) -> AsyncIterator[dict | bytes]:
    yield {"status": status, "headers": [("content-type", "application/json")]}
    yield json.dumps(payload).encode()
