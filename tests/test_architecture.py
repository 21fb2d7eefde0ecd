"""The import direction the design page draws holds in the code: `lint-imports` over the contracts in
pyproject.toml ([tool.importlinter]: model/ never imports the HTTP edge; the network never imports the engine,
tensor parallelism or the probes; the layers; per-row features never import the engine, nor each other; no route
imports another; the service imports only model/'s public names). And the routes stay thin: short functions, and
the engine reached only through `service/common/serving.py`."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout and "9 kept" in r.stdout, r.stdout


def test_a_broken_contract_is_reported(tmp_path):
    """The check can fail: a copy of the tree where the network imports the engine breaks a contract."""
    import shutil

    for name in ("model", "service", "pyproject.toml"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    attention = tmp_path / "model" / "attention.py"
    attention.write_text(attention.read_text() + "\nimport model.engine.scheduler  # noqa\n")
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and "BROKEN" in r.stdout, r.stdout + r.stderr


MAX_ROUTE_FUNCTION_LINES = 50


def route_files() -> list[Path]:
    """Every module of the service that declares routes (an `APIRouter`), in whichever face's folder it lives."""
    return [p for p in sorted((ROOT / "service").rglob("*.py")) if "= APIRouter(" in p.read_text()]


def test_route_files_are_found():
    """The two lists below can fail: the completions route is among the files they read."""
    assert ROOT / "service" / "api" / "openai" / "routes" / "completions.py" in route_files()


def test_the_route_independence_contract_names_every_route():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    [independence] = [c for c in contracts if c["type"] == "independence"]
    routes = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in route_files()}
    assert set(independence["modules"]) == routes


def test_route_functions_are_short():
    """Routes assemble named pieces (service/api/openai/prepare.py, the *_choices.py response builders,
    service/common/runner.py); a route function longer than this is doing their work."""
    long = []
    for path in route_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if node.end_lineno - first + 1 > MAX_ROUTE_FUNCTION_LINES:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - first + 1} lines)")
    assert not long, long


def test_the_service_reaches_the_engine_only_through_its_interface():
    """No `engine.engine`: the service asks the AsyncEngine (and routes ask `Serving`), never the Engine it runs."""
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "service").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if "engine.engine" in line]
    assert not found, found


def test_the_engine_names_lora_only_in_the_request_options():
    """LoRA lives in its feature's folder (model/features/lora/): the engine, its runner and its paths reach it
    through the per-row feature protocol, and name it only in the request's option (`RequestOptions.lora`)."""
    named = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "model" / "engine").rglob("*.py")
                   if "lora" in p.read_text().lower())
    assert named == ["model/engine/request_options.py"]
