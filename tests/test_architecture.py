"""The import direction the design page draws holds in the code: `lint-imports` over the contracts in
pyproject.toml ([tool.importlinter]: model/ never imports the HTTP edge; the network never imports the engine,
tensor parallelism or the probes; the layers; the service imports only model/'s public names)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout and "4 kept" in r.stdout, r.stdout


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
