"""Schema fuzzing: schemathesis drives every operation of the server's own OpenAPI document, valid and invalid
requests alike, against a live server on a tiny model, with every check it has (tests/data/schemathesis.toml
says which one is off where, and why): no 5xx, statuses and content types as documented, every error in the
OpenAI envelope (the documented error schema), invalid input rejected, valid input accepted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from benchmarks.tiny_checkpoint import write_tiny_checkpoint
from live_server import LiveServer, idle_stats, is_idle
from model.loaders.checkpoint import load_model
from service.config import Settings
from service.main import create_app

DATA = Path(__file__).parents[1] / "data"
MAX_EXAMPLES = int(os.environ.get("LLAMASCOPE_SCHEMATHESIS_EXAMPLES", "20"))


def run_schemathesis(url: str, tmp_path: Path, *extra: str, examples: int = MAX_EXAMPLES,
                     phases: str = "examples,coverage,fuzzing") -> subprocess.CompletedProcess:
    cli = Path(sys.executable).with_name("schemathesis")
    cmd = [str(cli), "--config-file", str(DATA / "schemathesis.toml"), "run", url + "/openapi.json",
           "--max-examples", str(examples), "--seed", "7", "--workers", "2",
           "--phases", phases, "--request-timeout", "60", "--generation-database", "none",
           "--no-color", "--suppress-health-check", "all", "--report-dir", str(tmp_path), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)


def failures(out: str) -> str:
    return out[out.find("FAILURES"):][-12000:] if "FAILURES" in out else out[-3000:]


def summary(out: str) -> str:
    return out[out.rfind("SUMMARY"):] if "SUMMARY" in out else out[-3000:]


@pytest.mark.slow  # schemathesis in a process of its own over every operation: minutes on 2 cores
def test_schemathesis_finds_nothing(tmp_path):
    # A real tokenizer with a chat template, so chat requests get past the template and into the engine.
    loaded = load_model(write_tiny_checkpoint(tmp_path / "tiny-llama", max_seq_len=256))
    # a kv_window lifts the context limit: max_window_tokens bounds its run time. The body limit leaves room for the
    # coverage phase's 1,025-message arrays, every optional field filled (about 82 kB), so they are the 400s they
    # should be and not 413s
    settings = Settings(max_n=2, max_prompts=2, max_logprobs=3, max_model_len=256, max_body_bytes=128 << 10,
                        max_window_tokens=512)
    with LiveServer(create_app(settings, loaded=loaded, wait_ready=True)) as live:
        result = run_schemathesis(live.url, tmp_path)
        print(summary(result.stdout))
        assert result.returncode == 0, failures(result.stdout + result.stderr)
        tested = re.search(r"Tested: (\d+)", result.stdout)
        paths = httpx.get(live.url + "/openapi.json").json()["paths"]
        assert tested and int(tested.group(1)) == sum(len(ops) for ops in paths.values())  # every operation
        assert httpx.get(live.url + "/health").status_code == 200
        assert is_idle(idle_stats(live.app))


def test_schemathesis_with_an_api_key(tmp_path):
    """With a key, every operation but the open ones must refuse a request without it (ignored_auth)."""
    loaded = load_model(write_tiny_checkpoint(tmp_path / "tiny-llama", max_seq_len=128))
    settings = Settings(api_key="fuzz-key", max_n=2, max_prompts=2, max_model_len=128, max_body_bytes=64 << 10,
                        max_window_tokens=512)
    with LiveServer(create_app(settings, loaded=loaded, wait_ready=True)) as live:
        result = run_schemathesis(live.url, tmp_path, "-H", "Authorization: Bearer fuzz-key", "--checks",
                                  "ignored_auth,not_a_server_error,status_code_conformance", examples=10,
                                  phases="fuzzing")
        print(summary(result.stdout))
        assert result.returncode == 0, summary(result.stdout + result.stderr)
        assert "fuzz-key" not in result.stdout.replace("Bearer fuzz-key", "")
