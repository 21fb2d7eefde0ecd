"""The models together: a request naming a model that is not loaded loads it (`autoload`, as llama-server's router
does by default), first making room: while --models-max models have a process, or the new one's memory estimate
does not fit the budget, the least recently used one is unloaded, once the requests in flight on it have finished
(tools/server/server-models.cpp `unload_lru` before `load`). A load that still does not fit is refused with the
figures, before any process starts: never the host's out-of-memory killer half-way through a load.

A loaded model whose process exits on its own (a crash, the kernel's OOM killer) fails only the requests it had in
flight; the watcher starts it again. A process that exits while loading leaves the model "failed", with its exit
code and last lines; the next request or POST /models/load tries again.

Everything here runs on the front's event loop (one thread), so the counts need no locks; `_capacity` serializes
the decisions that free and take room.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from model.loaders.memory import available_bytes, check_fits
from service.common.errors import APIError
from service.router.catalog import CatalogEntry
from service.router.child import Child
from service.router.options import RouterOptions, child_environ
from service.router.upstream import Upstream

log = logging.getLogger("llamascope.router")

LOAD_TIMEOUT = 1800.0  # a large checkpoint's first load, kernels built on the way


class ModelPool:
    def __init__(self, catalog: dict[str, CatalogEntry], options: RouterOptions, metrics=None) -> None:
        self.children = {name: Child(entry) for name, entry in catalog.items()}
        self.options = options
        self.metrics = metrics
        self.client: httpx.AsyncClient | None = None  # the front's own calls: health, /v1/models, metrics, /inspect
        self.upstream = Upstream()  # proxied requests
        key = options.settings.api_key
        self.headers = {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}
        self._capacity = asyncio.Lock()
        self._watcher: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def default(self) -> str:
        """The model a request without a `model` field goes to: the first one given."""
        return next(iter(self.children))

    def get(self, name: str | None) -> Child:
        child = self.children.get(name or self.default)
        if child is None:
            raise APIError(404, f"model {name!r} is not served here; the models: {', '.join(self.children)}",
                           param="model", code="model_not_found")
        return child

    async def start(self) -> None:
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10), limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=64))
        self._watcher = asyncio.create_task(self._watch())

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        grace = self.options.settings.shutdown_grace_seconds
        await asyncio.gather(*(c.stop(grace) for c in self.children.values() if c.proc is not None))
        if self.client is not None:
            await self.client.aclose()
        self.upstream.close()

    # -- requests ----------------------------------------------------------------------------------------------

    async def acquire(self, name: str | None) -> Child:
        """The model's child, loaded, with this request counted in flight on it (`release` when done)."""
        child = self.get(name)
        while True:
            if child.status == "loaded" and not child.unloading:
                child.acquire()
                return child
            if child.unloading:  # evicted while this request came in: it loads again once gone
                await child.idle.wait()
                while child.unloading:
                    await asyncio.sleep(0.02)
                continue
            if child.status == "loading":
                await asyncio.shield(child.ready)
                continue
            await self.load(child.name)
            if child.status == "loading":
                await asyncio.shield(child.ready)
            if child.status == "failed":
                raise APIError(503, f"model {child.name} failed to load: {child.failure}", param="model",
                               code="model_load_failed")

    # -- loading and unloading ---------------------------------------------------------------------------------

    async def load(self, name: str) -> Child:
        """Start the model's process after making room (returns while it loads; `child.ready` resolves after)."""
        child = self.get(name)
        async with self._capacity:
            if child.active:
                return child
            await self._make_room(child)
            child.spawn(self.options.child_argv, child_environ())
            self._count("loads", child)
            self._track(self._await_ready(child))
        return child

    async def _make_room(self, child: Child) -> None:
        while sum(c.active for c in self.children.values()) >= self.options.models_max:
            victim = self._lru(exclude=child)
            if victim is None:
                raise APIError(503, f"{self.options.models_max} models are loading (--models-max); try again when one "
                                    "is loaded", code="models_max_reached", headers={"Retry-After": "5"})
            await self._unload(victim, "--models-max")
        while True:
            try:
                self._check_memory(child)
                return
            except MemoryError as e:
                victim = self._lru(exclude=child)
                if victim is None:
                    raise APIError(503, str(e), param="model", code="insufficient_memory") from None
                await self._unload(victim, "memory")

    def _check_memory(self, child: Child) -> None:
        """MemoryError naming the figures when the model does not fit: in --models-memory-bytes beside the models
        with a process (their estimates), or without a budget in the memory the machine has now."""
        e = child.entry
        parts = {"weights": e.weight_bytes, "KV pool": e.kv_bytes}
        budget = self.options.memory_budget
        if budget is not None:
            held = {c.name: c.entry.memory_bytes for c in self.children.values() if c.active and c is not child}
            room = budget - sum(held.values())
            where = f"{budget / 2**30:.2f} GiB --models-memory-bytes" + (
                f" less {sum(held.values()) / 2**30:.2f} GiB held by {', '.join(held)}" if held else "")
            check_fits(parts, f"model {e.name} needs", f"the budget is {where}: unload a model (POST /models/unload) or "
                       "raise --models-memory-bytes", available=room, digits=2)
        else:
            check_fits(parts, f"model {e.name} needs", "unload a model (POST /models/unload), lower --kv-cache-bytes "
                       "or set --quantization int4", available=available_bytes(), digits=2)

    def _lru(self, exclude: Child) -> Child | None:
        """The least recently used loaded model (a loading one is never evicted: its first request waits on it)."""
        loaded = [c for c in self.children.values() if c.status == "loaded" and c is not exclude and not c.unloading]
        return min(loaded, key=lambda c: c.last_used) if loaded else None

    async def unload(self, name: str) -> None:
        child = self.get(name)
        async with self._capacity:
            if child.active:
                await self._unload(child, "requested")

    async def _unload(self, child: Child, why: str) -> None:
        """Drain (the requests in flight finish; new ones wait), then stop the process."""
        log.info("model %s: unloading (%s) after %d request(s) in flight", child.name, why, child.in_flight)
        child.unloading = True
        try:
            if child.status == "loading":
                await asyncio.shield(child.ready)
            await child.idle.wait()
            await child.stop(self.options.settings.shutdown_grace_seconds)
            self.upstream.drop(child.port)
            self._count("unloads", child)
        finally:
            child.unloading = False

    async def _await_ready(self, child: Child) -> None:
        try:
            ok = await child.wait_healthy(self.client, self.headers, LOAD_TIMEOUT)
            if ok:
                child.status = "loaded"
                child.last_used = time.monotonic()
                log.info("model %s: loaded", child.name)
            else:
                child.fail(f"its process exited with status {child.exited()} while loading")
        except Exception as e:  # the timeout, or anything unforeseen: never a model stuck "loading"
            child.fail(str(e) or type(e).__name__)
        finally:
            if not child.ready.done():
                child.ready.set_result(None)

    # -- crashes -------------------------------------------------------------------------------------------------

    async def _watch(self) -> None:
        """A loaded model whose process exited on its own is started again (its requests in flight have failed)."""
        while True:
            await asyncio.sleep(0.1)
            for child in self.children.values():
                if child.status == "loaded" and not child.stopping and (code := child.exited()) is not None:
                    log.error("model %s: its process exited with status %s; starting it again", child.name, code)
                    child.restarts += 1
                    self.upstream.drop(child.port)
                    self._count("restarts", child)
                    child.spawn(self.options.child_argv, child_environ())
                    self._track(self._await_ready(child))

    def _track(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _count(self, what: str, child: Child) -> None:
        if self.metrics is not None:
            self.metrics.count(what, child.name)
