"""The CUDA decode-attention kernel (model/kernels/triton_attention.py) on CPU, through Triton's interpreter: in a
subprocess, because TRITON_INTERPRET must be set before triton is imported (tests/triton_interpret_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton (a test dependency, shipped with PyTorch's CUDA builds) is not installed")


def test_triton_paged_decode_attention_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = Path(__file__).with_name("triton_interpret_check.py")
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Triton path == gather path" in r.stdout
