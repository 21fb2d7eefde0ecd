"""Shared fixtures: tiny random HF LLaMA checkpoints, and the default model (ours and transformers' load of it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Under CI (`CI=true`, as .ci/run runs) nothing may skip silently: a skipped test is a test that did not run, so
# a missing browser, nginx, Prometheus or package fails the run. Only tests marked `gpu` (they need CUDA) may
# skip there. Without CI, skips stay skips, with their reason in the summary (`-ra`).
STRICT_SKIPS = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _skip_is_failure(report, cuda_only: bool) -> None:
    if STRICT_SKIPS and report.skipped and not cuda_only and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true (only tests marked gpu may skip there): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _skip_is_failure(outcome.get_result(), item.get_closest_marker("gpu") is not None)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield  # a module-level skip (`pytest.importorskip` of a missing test dependency) skips a whole file
    _skip_is_failure(outcome.get_result(), False)


def pytest_addoption(parser):
    parser.addoption("--image", default=None, metavar="TAG",
                     help="run the container tests (marked `image`: tests/deploy/test_image.py, tests/deploy/test_compose.py) "
                          "against this built image; without it they are not collected (`make image-test` passes it)")


def pytest_collection_modifyitems(config, items):
    """Tests marked `image` need a built image and a container engine: without `--image` they are deselected (not
    skipped: a plain `make test` has no image to run them on, and under CI=true a skip is a failure)."""
    if config.getoption("--image"):
        return
    keep = [i for i in items if i.get_closest_marker("image") is None]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("image") is not None])
        items[:] = keep


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    from model.loaders.checkpoint import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_gguf_dir(default_gguf, tmp_path_factory) -> Path:
    """A directory holding (a link to) the default GGUF, the form transformers' `gguf_file=` loading wants."""
    d = tmp_path_factory.mktemp("gguf")
    (d / default_gguf.name).symlink_to(default_gguf)
    return d


@pytest.fixture(scope="session")
def hf_gguf_model(hf_gguf_dir, default_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_gguf_dir, gguf_file=default_gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(hf_gguf_dir, default_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_gguf_dir, gguf_file=default_gguf.name)


@pytest.fixture(scope="session")
def default_model(default_gguf):
    from model.loaders.checkpoint import load_model

    return load_model(default_gguf, torch.float32, "cpu")


@pytest.fixture(scope="session")
def tiny_live():
    """The factory of live servers over a tiny random model: `with tiny_live(Settings(...), model) as live:`
    (tests/live_server.py's `tiny_live_server`)."""
    from live_server import tiny_live_server

    return tiny_live_server


@pytest.fixture(scope="session")
def server(default_model):
    """The service on the default model (loaded once per session), live on loopback."""
    from live_server import LiveServer
    from service.config import Settings
    from service.main import create_app

    app = create_app(Settings(max_waiting=512, max_num_seqs=16), loaded=default_model, wait_ready=True)
    with LiveServer(app) as live:
        yield live
