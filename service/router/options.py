"""Router mode's command line. `--model` given more than once, or `--models-dir`, asks for it; `--models-max` and
`--models-memory-bytes` bound it. Every other flag is a child's: validated here once (the same one-line errors as a
single server's), then given to each model's `python -m service` as it was typed, as llama-server's router passes
its own arguments on to each child less the ones it controls (tools/server/server-models.cpp: `--model`,
`--models-dir`, `--models-max`, `--port`, `--alias` are the router's)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from service.config import Settings, build_parser, parse_cli

# flags taking a value that the router keeps for itself (a child gets its model, name, host and port from the pool)
ROUTER_FLAGS = ("--model", "--models-dir", "--models-max", "--models-memory-bytes", "--host", "--port")
# what a child must not inherit from the router's environment: it would name another model, or make it a router
CHILD_ENV_DROPPED = ("LLAMASCOPE_MODEL", "LLAMASCOPE_MODELS_DIR", "LLAMASCOPE_MODELS_MAX",
                     "LLAMASCOPE_MODELS_MEMORY_BYTES", "LLAMASCOPE_SERVED_MODEL_NAME", "LLAMASCOPE_HOST",
                     "LLAMASCOPE_PORT")


@dataclass
class RouterOptions:
    models: list[str]  # --model values, in the order given
    settings: Settings  # the rest, as each child reads it (and the front's host, port, API key, body limit)
    child_argv: list[str] = field(default_factory=list)  # the command line each child gets, less the router's flags

    @property
    def models_dir(self) -> str | None:
        return self.settings.models_dir

    @property
    def models_max(self) -> int:
        return self.settings.models_max

    @property
    def memory_budget(self) -> int | None:
        return self.settings.models_memory_bytes


def _flag_values(argv: list[str], name: str) -> list[str]:
    out = []
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif a.startswith(name + "="):
            out.append(a.split("=", 1)[1])
    return out


def wants_router(argv: list[str], environ: dict[str, str] | None = None) -> bool:
    """Router mode: `--model` more than once, or a models directory (flag or LLAMASCOPE_MODELS_DIR)."""
    environ = os.environ if environ is None else environ
    return (len(_flag_values(argv, "--model")) > 1 or bool(_flag_values(argv, "--models-dir"))
            or bool(environ.get("LLAMASCOPE_MODELS_DIR")))


def _without(argv: list[str], names: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif not any(a.startswith(n + "=") for n in names):
            out.append(a)
    return out


def parse_router_cli(argv: list[str], prog: str = "python -m service") -> RouterOptions:
    """The router's options; a bad flag value exits 2 with one line, as `parse_cli` does for one model."""
    models = _flag_values(argv, "--model")
    rest = _without(argv, ("--model",))
    parser = build_parser(prog)
    if parser.parse_args(rest).model_path is not None:
        parser.error("in router mode name each model with --model (or put them in --models-dir)")
    settings = parse_cli(rest, prog)
    if settings.served_model_name is not None:
        parser.error("--served-model-name names one model; in router mode each model is named after its file or folder")
    if settings.model is not None and settings.model not in models:  # LLAMASCOPE_MODEL beside --models-dir
        models.insert(0, settings.model)
    if not models and not settings.models_dir:
        parser.error("router mode needs --model more than once or --models-dir")
    return RouterOptions(models, settings, _without(argv, ROUTER_FLAGS))


def child_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in CHILD_ENV_DROPPED}
