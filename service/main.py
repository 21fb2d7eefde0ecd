"""The FastAPI app: `create_app(settings)` with a lifespan that owns the engine; `python -m service` runs it."""

from __future__ import annotations

import logging
import sys
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from service.config import Settings, allowed_origins, parse_cli
from service.state import ServingState

if TYPE_CHECKING:
    from fastapi import FastAPI

    from model.loaders import LoadedModel


def create_app(settings: Settings | None = None, loaded: LoadedModel | None = None, wait_ready: bool = False,
               state: ServingState | None = None) -> FastAPI:
    """`loaded`: an already loaded model (tests, embedding); `wait_ready`: start the engine before serving instead
    of loading in the background while /health says 503; `state`: one whose loading has already begun (`main`)."""
    # The web stack is imported here, not at the top: `main` starts loading the model before it (see there).
    from fastapi import FastAPI
    from starlette.middleware.cors import CORSMiddleware

    from service import errors, openapi
    from service.middleware import GuardMiddleware
    from service.routes import attribute, chat, completions, info, inspect, patch, vectors

    settings = settings or Settings()
    state = state or ServingState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.loader is None:  # else `main` began loading already
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
    for r in (completions.router, chat.router, info.router, inspect.router, patch.router, attribute.router,
              vectors.router):
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
    settings = parse_cli(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)
    # The model starts loading before the web stack (FastAPI, the routes, uvicorn: ~0.5 s of imports) is imported and
    # the server binds: the loader's conversion runs without the GIL, so the two overlap, and /health answers 503
    # from the moment the server listens until the engine runs, as before. The loader imports only modules of its
    # own (the GGUF and safetensors readers), none that the web stack imports too.
    state = ServingState(settings)
    state.start_in_background()
    from service.shutdown import serve

    return serve(create_app(settings, state=state), settings)
