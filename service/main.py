"""The FastAPI app: `create_app(settings)` with a lifespan that owns the engine; `main` runs it (`python -m service`,
`llamascope serve`: service/cli.py)."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, NoReturn

from service.config import Settings, allowed_origins, parse_cli
from service.common.state import ServerState

if TYPE_CHECKING:
    from fastapi import FastAPI

    from model.loaders import LoadedModel


def create_app(settings: Settings | None = None, loaded: LoadedModel | None = None, wait_ready: bool = False,
               state: ServerState | None = None) -> FastAPI:
    """`loaded`: an already loaded model (tests, embedding); `wait_ready`: start the engine before serving instead
    of loading in the background while /health says 503; `state`: one whose loading has already begun (`main`)."""
    # The web stack is imported here, not at the top: `main` starts loading the model before it (see there).
    from fastapi import FastAPI
    from starlette.middleware.cors import CORSMiddleware

    from service.common import errors, health, openapi
    from service.common.middleware import GuardMiddleware
    from service.api.anthropic import route as anthropic
    from service.api.anthropic.errors import AnthropicErrors
    from service.api.openai.lora import routes as adapters
    from service.api.openai.routes import chat, completions, models, responses
    from service.microscope.routes import attribute, compare, inspect, patch, saes, vectors, viewer

    settings = settings or Settings()
    state = state or ServerState(settings)

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
    app.state.server = state
    errors.install(app)
    openapi.install(app, state)
    for r in (completions.router, chat.router, responses.router, health.router, models.router, inspect.router,
              compare.router, patch.router, attribute.router, vectors.router, saes.router, viewer.router,
              anthropic.router):
        app.include_router(r)
    if settings.enable_lora_runtime_updates:
        app.include_router(adapters.router)
    key = settings.api_key.get_secret_value() if settings.api_key else None
    app.add_middleware(GuardMiddleware, api_key=key, max_body_bytes=settings.max_body_bytes,
                       metrics_require_key=settings.metrics_require_key, requests_counter=state.metrics.requests)
    app.add_middleware(AnthropicErrors)  # around the guard: its 401 / 413 under /v1/messages in Anthropic's envelope
    if settings.otlp_traces_endpoint:  # the caller's traceparent, for the request's span (service/common/tracing.py)
        from service.common.tracing import TraceContextMiddleware

        app.add_middleware(TraceContextMiddleware)
    if origins := allowed_origins(settings):
        # Outermost (added last), as vLLM's --allowed-origins: a browser's preflight OPTIONS carries no API key and
        # must be answered before the key check, and refusals (401, 413) get the CORS headers the page needs to
        # read them. Bearer keys are not cookies, so no credentials mode.
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"], allow_headers=["*"])
    return app


def main(argv: list[str] | None = None, prog: str = "python -m service") -> int:
    """Serve until SIGTERM (exit 0) or a failure the server cannot recover from: a model that does not load, an
    engine thread that ended (exit 1, the reason as the last line on stderr; docs/development.md rule 9)."""
    from service.router.options import wants_router

    if wants_router(sys.argv[1:] if argv is None else argv):  # several models: the front of their processes
        from service.router.app import main as router_main

        return router_main(sys.argv[1:] if argv is None else argv, prog)
    settings = parse_cli(argv, prog)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)
    # The model starts loading before the web stack (FastAPI, the routes, uvicorn: a large import) is imported and
    # the server binds: the loader's conversion runs without the GIL, so the two overlap, and /health answers 503
    # from the moment the server listens until the engine runs, as before. The loader imports only modules of its
    # own (the GGUF and safetensors readers), none that the web stack imports too.
    state = ServerState(settings)
    state.start_in_background()
    from service.common.shutdown import serve

    code = serve(create_app(settings, state=state), settings)
    if state.fatal_error:  # after uvicorn's own shutdown lines: what a terminal or an orchestrator's log shows last
        print(f"{prog}: error: {state.fatal_error}", file=sys.stderr, flush=True)
    return code


def exit_now(code: int) -> NoReturn:
    """Exit with `code` once everything is stopped and flushed (uvicorn's shutdown, the lifespan's engine stop),
    skipping the interpreter's teardown of torch, which takes seconds on a busy machine: a SIGTERM'd server exits
    within its grace period."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
