"""The native kernels' AVX2 and AVX-VNNI paths, on any CPU that can run them. Where this CPU has AVX-512 or AMX,
its own build never runs them (the 256-bit integer products, the quantized layers' one-group tiles), yet they are
all an AVX2-only CPU or a client CPU with AVX-VNNI has, and what an image built here loads on one
(`compatible_build`): the kernel tests run again on each portable build of kernels.PORTABLE_SETTINGS
(`LLAMASCOPE_NATIVE_KERNELS=portable`, compile_flags(avx2, []); `portable-vnni`, with -mavxvnni), which
`make install-test` builds with `python -m model.kernels --portable --tested`. Where the CPU's own build is one of them, the
two are one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from model import kernels

ROOT = Path(__file__).resolve().parents[2]
# the kernels against PyTorch op by op (the quantized layers, attention over 16-bit and int8 caches, the fused step),
# and end to end: batched rows bitwise as alone, an int8 cache through the engine
FILES = ["tests/model/test_native_kernels.py", "tests/model/test_kv_int8_kernels.py", "tests/model/test_quantize.py",
         "tests/model/test_gguf_kquants.py", "tests/engine/test_batch_invariance.py", "tests/engine/test_kv_int8.py"]


# each portable build this CPU can run, and what its status says
RUNNABLE = [(setting, ("native (avx2, vnni)" if flags else "native (avx2)") + f" {kernels.instruction_set(flags)}")
            for setting, flags in kernels.PORTABLE_SETTINGS.items()
            if kernels._features(flags) <= kernels.cpu_flags()]


@pytest.mark.slow  # (half a minute each with the builds made at install; a build here takes minutes)
@pytest.mark.parametrize("setting, want", RUNNABLE)
def test_the_kernel_tests_pass_on_the_portable_builds(setting, want):
    env = {**os.environ, "LLAMASCOPE_NATIVE_KERNELS": setting}
    probe = "from model import kernels; m = kernels.native(); print(kernels.status(), kernels.built_for(), m.zmm, m.amx)"
    status = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=900, check=True).stdout.strip()
    assert status == f"{want} False False", status
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, proc.stdout[-6000:]
    print(proc.stdout.strip().splitlines()[-1])
