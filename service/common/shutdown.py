"""Graceful shutdown: on SIGTERM (or Ctrl-C) the server refuses new work with 503 at once, lets in-flight requests
finish for up to `shutdown_grace_seconds`, ends any still running just before that deadline with a clean error
(an SSE error event and `[DONE]`, or a 503 envelope), and exits 0.

uvicorn does the socket side: it stops listening, waits for open connections up to `timeout_graceful_shutdown`,
then runs the lifespan shutdown (which stops the engine). It also re-raises the signal it caught once it is done,
which under the default SIGTERM handler would kill the process with status -15; a no-op handler installed
beforehand makes that re-raise harmless, so a drained server exits 0.

If the model fails to load, or the engine thread ends on its own (a failure it cannot recover from, such as a
tensor-parallel rank lost inside a collective; every open request has already ended with an error), the server
stops and exits 1 with the reason (service/main.py), so a terminal shows it and an orchestrator restarts the
process, as `vllm serve` and `llama-server` do.
"""

from __future__ import annotations

import signal

import uvicorn
from fastapi import FastAPI

from service.config import Settings
from service.common.state import ServerState


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        self.state.begin_drain(self.state.settings.shutdown_grace_seconds)
        super().handle_exit(sig, frame)


def serve(app: FastAPI, settings: Settings) -> int:
    config = uvicorn.Config(app, host=settings.host, port=int(settings.port), log_level="info",
                            timeout_graceful_shutdown=settings.shutdown_grace_seconds)
    state: ServerState = app.state.server
    server = GracefulServer(config, state)
    # The model failed to load or the engine thread ended: stop serving and exit 1 (uvicorn's flag is polled by its
    # main loop: safe to set from any thread). Set before the check below, so a failure on the loading thread in
    # between is seen by one or the other.
    state.on_fatal = lambda: setattr(server, "should_exit", True)
    if state.fatal_error:  # it failed while the server was being set up (the model loads meanwhile: service/main.py)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)  # what uvicorn restores and re-raises into after its own handling
    server.run()
    return 1 if state.fatal_error else 0
