"""The FastAPI app: `create_app(settings)` with a lifespan that owns the engine; `python -m service` runs it."""

from __future__ import annotations

import logging
import sys
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from model.loaders import LoadedModel
from service import errors, openapi
from service.config import Settings, allowed_origins, parse_cli
from service.middleware import GuardMiddleware
from service.routes import chat, completions, info, inspect, patch, vectors
from service.state import ServingState


def create_app(settings: Settings | None = None, loaded: LoadedModel | None = None, wait_ready: bool = False) -> FastAPI:
    """`loaded`: an already loaded model (tests, embedding); `wait_ready`: start the engine before serving instead
    of loading in the background while /health says 503."""
    settings = settings or Settings()
    state = ServingState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if wait_ready:
            state.start(loaded)
        else:
            state.start_in_background(loaded)
        yield
        state.draining = True
        state.stop()

    app = FastAPI(title="llamascope", version="0.1.0", lifespan=lifespan)
    app.state.serving = state
    errors.install(app)
    openapi.install(app, state)
    for r in (completions.router, chat.router, info.router, inspect.router, patch.router, vectors.router):
        app.include_router(r)
    key = settings.api_key.get_secret_value() if settings.api_key else None
    app.add_middleware(GuardMiddleware, api_key=key, max_body_bytes=settings.max_body_bytes,
                       metrics_require_key=settings.metrics_require_key, requests_counter=state.metrics.requests)
    if origins := allowed_origins(settings):
        # Outermost (added last), as vLLM's --allowed-origins: a browser's preflight OPTIONS carries no API key and
        # must be answered before the key check, and refusals (401, 413) get the CORS headers the page needs to
        # read them. Bearer keys are not cookies, so no credentials mode.
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"], allow_headers=["*"])
    return app


def main(argv: list[str] | None = None) -> int:
    from service.shutdown import serve

    settings = parse_cli(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)
    return serve(create_app(settings), settings)
