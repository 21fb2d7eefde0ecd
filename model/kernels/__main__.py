"""Build the native kernels now (install time) and check them against PyTorch once:  python -m model.kernels

A build of exactly these sources, flags and torch already in the build folder (another checkout's, the same
commit's) is loaded as it is; else the C++ files compile on every core, each file's object kept
(kernels/extension.py: an edit to one file recompiles that one), with a line per file as it is done.
`--portable` builds the PORTABLE ones too (kernels.portable_builds: for any CPU with AVX2, with AVX-VNNI, and with
AVX-512 VNNI, each where this CPU has that and more), what an image built here loads on a CPU without this one's flags
(kernels.compatible_build); `--tested` with it: only those the tests load (kernels.PORTABLE_SETTINGS; an image needs
them all). `--allow-failure`: exit 0 when a build fails (the server then serves on PyTorch ops, or
on another build)."""

from __future__ import annotations

import logging
import sys
import time

import torch

from model import kernels


def main() -> int:
    logging.basicConfig(format="%(message)s")
    logging.getLogger("model.kernels").setLevel(logging.INFO)  # the build's progress (extension.py)
    t0 = time.perf_counter()
    try:
        m = kernels.build(verbose=True) if "-v" in sys.argv else kernels.load()
    except Exception as e:
        print(f"native kernels: build failed ({type(e).__name__}: {e}); the server will use PyTorch ops", file=sys.stderr)
        return 0 if "--allow-failure" in sys.argv else 1
    x, w = torch.randn(3, 64), torch.rand(64) + 0.5
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    err = (m.rms_norm(x, w, 1e-5) - ref).abs().max().item()
    ok = err < 1e-5
    print(f"native kernels: ready in {time.perf_counter() - t0:.1f} s, avx2={m.avx2}, rms_norm max |diff| {err:.1e}"
          f" {'ok' if ok else 'WRONG'}")
    portable = ok and "--portable" in sys.argv and m.avx2
    for vnni in kernels.portable_builds(tested_only="--tested" in sys.argv) if portable else []:
        t0, name = time.perf_counter(), " ".join(vnni) or "AVX2 alone"
        try:
            p = kernels.build(verbose=True, vnni=vnni) if "-v" in sys.argv else kernels.load(vnni=vnni)
        except Exception as e:
            print(f"native kernels: the portable build ({name}) failed ({type(e).__name__}: {e})", file=sys.stderr)
            return 0 if "--allow-failure" in sys.argv else 1
        err = (p.rms_norm(x, w, 1e-5) - ref).abs().max().item()
        good = err < 1e-5 and bool(p.vnni) == bool(vnni)
        ok = ok and good
        print(f"native kernels: the portable build ({name}) ready in {time.perf_counter() - t0:.1f} s, vnni={p.vnni},"
              f" rms_norm max |diff| {err:.1e} {'ok' if good else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
