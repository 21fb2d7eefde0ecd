"""Native CPU kernels for the engine's step: C++ (AVX2 where the CPU has it), built with PyTorch's cpp_extension.

Eager PyTorch spends most of a small model's decode step outside the matmuls: about 200 aten calls per block
(RMSNorm alone is 8, RoPE 4, the paged cache write, gather and SDPA plumbing dozens), each a few microseconds of
dispatch and a temporary. These kernels do each of those in one call, on the same tensors the modules hold
(`csrc/`):

    rms_norm, silu_mul, rope_             elementwise.cpp      one pass per row instead of 4-8 ops
    paged_decode_attention(_telemetry),   paged_attention.cpp  rows attend over the block pool in place (with
    paged_write                                                 attention telemetry: attention_telemetry.h)
    int4_linear, int6_linear,             quant_linear.cpp     dequantize fused into the dot product (llama.cpp's
    int8_linear, round_activations                              int8-activation scheme; qgemm.h)
    int4_dequantize, int6_dequantize,     quant_linear.cpp     whole weights to float32 in one pass
    int8_dequantize
    float_linear                          float_linear.cpp     x @ W^T with one reduction order for any row count
    argmax_rows                           argmax.cpp           greedy picks, torch.argmax's index (ops.greedy_pick)
    lora_expand                           lora.cpp             LoRA's B product, one fused multiply-add order (model/lora.py)
    step_layers                           step_layers.cpp      every block of a step in one parallel region
    apply_edits                           interventions.cpp    a step's interventions on chosen rows (model/edits.py)
    gguf_convert                          gguf_convert.cpp     a GGUF matrix's blocks into the int4 / int6 / int8
                                                                layout, on every thread (model/loaders/gguf_blocks.py)

`native()` returns the loaded module, or None where the kernels are off (`LLAMASCOPE_NATIVE_KERNELS=0`,
`disabled()`) or could not be built; every caller then keeps its plain PyTorch path, which is also the reference
the tests compare the kernels against.

The extension compiles once per machine (about a minute on 2 cores; ninja and a C++ compiler) into
`LLAMASCOPE_KERNELS_DIR` (default ~/.cache/llamascope/kernels), under a name that hashes its sources, flags and
torch version. `make install` and the Docker image build it at install time (`python -m model.kernels`), so a
server start only imports the .so; where it is missing a first use builds it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

log = logging.getLogger(__name__)

ENV_VAR = "LLAMASCOPE_NATIVE_KERNELS"  # "0" turns them off (the PyTorch paths run instead)
NAME = "llamascope_kernels"
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("bindings.cpp", "elementwise.cpp", "paged_attention.cpp", "quant_linear.cpp", "float_linear.cpp",
           "step_layers.cpp", "interventions.cpp", "argmax.cpp", "gguf_convert.cpp", "lora.cpp")

STALE_LOCK_SECONDS = 600
_lock = threading.Lock()
_enabled = os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")
_module: ModuleType | None = None
_error: str | None = None
_tried = False


def cpu_has_avx2() -> bool:
    """AVX2, FMA and F16C: what the vector paths use (PyTorch's own dispatch reads the same CPU flags)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def cpu_flags() -> set[str]:
    """The kernel's CPU flags (Linux /proc/cpuinfo); empty elsewhere. PyTorch's capability names do not say VNNI."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def vnni_flags() -> list[str]:
    """The compiler flags for 256-bit `vpdpbusd` where the CPU has it (csrc/simd.h): AVX-VNNI (the VEX encoding),
    else AVX512-VNNI with AVX512-VL (the EVEX encoding); and with AVX512-VNNI, -VL and -BW, the quantized kernels'
    512-bit pair tiles (csrc/quant_linear.cpp), and beside them AMX-INT8 tiles where the CPU has those too."""
    flags = cpu_flags()
    out = ["-mavxvnni"] if "avx_vnni" in flags else []
    if {"avx512_vnni", "avx512vl"} <= flags:
        # The compiler's own vectors stay 256 bits wide: the flags make the EVEX form of the instruction available,
        # and (with AVX512-BW) the explicit 512-bit pair tiles.
        out += ["-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256"] + (["-mavx512bw"] if "avx512bw" in flags else [])
        if {"avx512bw", "amx_tile", "amx_int8"} <= flags:
            out += ["-mamx-tile", "-mamx-int8"]
    return out


def compile_flags(avx2: bool) -> list[str]:
    # -fopenmp at compile time only: at::parallel_for's OpenMP regions then run on the OpenMP runtime PyTorch
    # already loaded (linking a second libgomp would start a second thread pool beside torch's).
    # -fschedule-insns -fsched-pressure: GCC's scheduling before register allocation, pressure-aware; off by
    # default on x86, and without it the int4 tile's 32 independent maddubs are issued in source order with their
    # int16 sums spilled to the stack (docs/performance.md#native-cpu-kernels); same instructions, same results
    # (it reorders, never reassociates).
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fschedule-insns", "-fsched-pressure"]
    if not avx2:
        return flags
    return flags + ["-mavx2", "-mfma", "-mf16c"] + vnni_flags()


def build_dir() -> Path:
    return Path(os.environ.get("LLAMASCOPE_KERNELS_DIR") or Path.home() / ".cache" / "llamascope" / "kernels")


def module_name() -> str:
    """Names the build by what it is built from (sources, flags, torch version): a stale .so is never loaded."""
    avx2 = cpu_has_avx2()
    h = hashlib.sha256(" ".join(compile_flags(avx2) + [torch.__version__]).encode())
    for src in sorted(CSRC.iterdir()):
        h.update(src.name.encode() + src.read_bytes())
    return f"{NAME}_{'avx2' if avx2 else 'generic'}_{h.hexdigest()[:12]}"


def build(verbose: bool = False) -> ModuleType:
    """Compile the extension into `build_dir()` (ninja and a C++ compiler needed) and import it."""
    from torch.utils import cpp_extension

    name, directory = module_name(), build_dir() / module_name()
    directory.mkdir(parents=True, exist_ok=True)
    # cpp_extension serializes builds with a lock file and waits on it forever: one left by a killed build
    # (no build takes 10 minutes) would hang every later start.
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
        log.warning("removing a stale kernel build lock %s", lock)
        lock.unlink(missing_ok=True)
    return cpp_extension.load(
        name=name,
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=compile_flags(cpu_has_avx2()),
        build_directory=str(directory),
        verbose=verbose,
    )


def import_built(path: Path) -> ModuleType:
    """Import a built extension from its .so (named by its file: builds of different sources load side by side)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load() -> ModuleType:
    """Import the built extension if this exact build exists (no compiler or ninja needed), else build it."""
    name = module_name()
    path = build_dir() / name / f"{name}.so"
    if path.is_file():
        module = import_built(path)
        log.info("native CPU kernels: loaded %s", path)  # which build: the image's, or this machine's own
        return module
    log.info("native CPU kernels: no build at %s; building it (about a minute)", path)
    return build()


def native() -> ModuleType | None:
    """The kernels module, loaded (or built) on first use; None when off or unavailable (then use PyTorch ops)."""
    global _module, _error, _tried
    if not _enabled:
        return None
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    _module = load()
                except Exception as e:  # no compiler or ninja: serve on the PyTorch paths, and say why once
                    lines = str(e).strip().splitlines()
                    _error = f"{type(e).__name__}: {lines[-1] if lines else ''}"
                    log.warning("native CPU kernels unavailable, using PyTorch ops: %s", _error)
                _tried = True
    return _module


def status() -> str:
    """What decode runs on, for logs and benchmark reports: 'native (avx2)', 'off', or 'unavailable: why'."""
    if not _enabled:
        return "off"
    m = native()
    if m is None:
        return f"unavailable: {_error}"
    if not m.avx2:
        return "native (generic)"
    used = [f for f in ("vnni", "zmm") if getattr(m, f, False)] + (["amx"] if m.amx and m.amx_permitted() else [])
    return "native (" + ", ".join(["avx2"] + used) + ")"


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the PyTorch reference paths inside this block (tests compare the two)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def usable(x: torch.Tensor, *params: torch.Tensor) -> ModuleType | None:
    """`native()` when `x` is a CPU tensor of a dtype the kernels take (float32, bfloat16) and nothing needs
    autograd (the kernels have no backward), else None."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return None
    return native()
