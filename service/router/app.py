"""The router's front: one port, the models' processes behind it (service/router/__init__.py says what each part
does). Its own endpoints are llama-server's router ones (tools/server/server.cpp: `GET /models`, `POST /models/load`,
`POST /models/unload`, `/v1/models` with each model's `status`), `/health`, `/metrics` (every model's, labelled) and
`/inspect/compare` across models; every other request goes to the process of the model its JSON body's `model`
field names (a GET or DELETE: its `model` query parameter), or to the first model when it names none."""

from __future__ import annotations

import logging
import signal
import sys
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict
from prometheus_client import CONTENT_TYPE_LATEST

from service.common import errors
from service.config import allowed_origins
from service.common.errors import APIError
from service.common.middleware import GuardMiddleware
from service.router.catalog import CatalogEntry, build_catalog
from service.router.compare import compare_models
from service.router.metrics import RouterMetrics, aggregate
from service.router.options import RouterOptions, parse_router_cli
from service.router.pool import ModelPool
from service.router.proxy import Front, forward
from service.microscope.schemas import CompareRequest

log = logging.getLogger("llamascope.router")


class ModelAction(BaseModel):
    """POST /models/load and /models/unload: `{"model": NAME}`, as llama-server takes them."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str


def create_router_app(options: RouterOptions, catalog: dict[str, CatalogEntry]):
    metrics = RouterMetrics()
    pool = ModelPool(catalog, options, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await pool.start()
        # the models named with --model load at start, as many as --models-max allows; --models-dir's on first use
        for name in [n for n, e in catalog.items() if str(e.path) in options.models or n in options.models][
                :options.models_max]:
            try:
                await pool.load(name)
            except APIError as e:  # over the memory budget: it stays unloaded, and says why when asked for
                log.error("model %s: not loaded at start: %s", name, e.message)
        yield
        await pool.close()

    # no /docs or /openapi.json of its own: those go to the first model's process, which documents the API
    app = FastAPI(title="llamascope router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    errors.install(app)

    @app.get("/health")
    async def health():
        return {"status": "ok", "models": {c.name: c.status for c in pool.children.values()}}

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        data = []
        for c in pool.children.values():
            entry = {"id": c.name, "object": "model", "created": 0, "owned_by": "llamascope", "root": str(c.entry.path)}
            entry.update({k: v for k, v in c.info.items() if k not in entry})  # the child's own: context, precision
            entry["status"] = c.describe()
            data.append(entry)
        return {"object": "list", "data": data}

    @app.post("/models/load")
    async def load(req: ModelAction):
        child = pool.get(req.model)
        if child.active and not child.unloading:
            raise APIError(400, f"model {req.model} is already {child.status}", param="model", code="invalid_value")
        await pool.load(req.model)
        return {"success": True}

    @app.post("/models/unload")
    async def unload(req: ModelAction):
        child = pool.get(req.model)
        if not child.active:
            raise APIError(400, f"model {req.model} is not loaded", param="model", code="invalid_value")
        await pool.unload(req.model)
        return {"success": True}

    @app.get("/metrics")
    async def metrics_text():
        body = await aggregate(pool.client, list(pool.children.values()), pool.headers, metrics)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.post("/inspect/compare")
    async def compare(req: CompareRequest, request: Request):
        names = [req.model or pool.default, *req.compare]
        if len(set(names)) > 1 and all(n in pool.children for n in names):
            return await compare_models(pool, req)
        return await _proxy(request, await request.body(), req.model)  # adapters of one model: its own route

    async def _proxy(request: Request, body: bytes, name: str | None) -> Response:
        child = await pool.acquire(name)
        return await forward(pool, child, request, body)

    # every other path is a model's: Front sends it on before the framework's layers (service/router/proxy.py),
    # and the guard checks key and body size before either
    own = {route.path for route in app.routes}
    front = Front(app, pool, own)
    s = options.settings
    key = s.api_key.get_secret_value() if s.api_key else None
    outer = GuardMiddleware(front, api_key=key, max_body_bytes=s.max_body_bytes,
                            metrics_require_key=s.metrics_require_key)
    if origins := allowed_origins(s):  # as service/main.py: outermost, preflights before the key check
        from starlette.middleware.cors import CORSMiddleware

        outer = CORSMiddleware(outer, allow_origins=origins, allow_methods=["GET", "POST"], allow_headers=["*"])
    return outer


def main(argv: list[str], prog: str = "python -m service") -> int:
    """Serve the models until SIGTERM: each child drains (its own grace period), then the router exits 0. A models
    directory with nothing to serve, or two models of one name, is a one-line error (exit 2)."""
    import uvicorn

    from model.loaders import CheckpointError

    options = parse_router_cli(argv, prog)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per proxied request otherwise
    try:
        catalog = build_catalog(options.models, options.models_dir, options.settings)
    except (ValueError, CheckpointError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    for e in catalog.values():
        log.info("model %s: %s (about %.2f GiB with its KV pool)", e.name, e.path, e.memory_bytes / 2**30)
    s = options.settings
    config = uvicorn.Config(create_router_app(options, catalog), host=s.host, port=int(s.port), log_level="info",
                            timeout_graceful_shutdown=s.shutdown_grace_seconds)
    for sig in (signal.SIGTERM, signal.SIGINT):  # what uvicorn re-raises into after its own handling (service/shutdown.py)
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(config).run()
    return 0

