"""Native CPU kernels for the engine's step: C++ (AVX2 where the CPU has it), built by extension.py.

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
    lora_expand                           lora.cpp             LoRA's B product, one fused multiply-add order (model/features/lora/adapters.py)
    step_layers                           step_layers.cpp      every block of a step in one parallel region
    apply_edits, apply_clamps             interventions.cpp    a step's interventions on chosen rows (model/edits.py)
    gguf_convert                          gguf_convert.cpp     a GGUF matrix's blocks into the int4 / int6 / int8
                                                                layout, on every thread (model/loaders/gguf_blocks.py)

`native()` returns the loaded module (with `LLAMASCOPE_NATIVE_KERNELS=portable` the AVX2 build), or None where the
kernels are off (`LLAMASCOPE_NATIVE_KERNELS=0`, `disabled()`) or could not be built; every caller then keeps its
plain PyTorch path, which is also the reference the tests compare the kernels against.

The extension compiles once per machine (under a minute on 2 cores: every core at once; a C++ compiler) into
`LLAMASCOPE_KERNELS_DIR` (default ~/.cache/llamascope/kernels), under a name that hashes its sources, flags and
torch version. `make install` and the Docker image build it at install time (`python -m model.kernels`), so a
server start only imports the .so; where it is missing a first use builds it, and where it cannot be built (no
compiler: the image on a CPU of other flags than the one it was built on) loads the richest build of the same
sources that this CPU can run (`compatible_build`; the image carries PORTABLE ones).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

from model.kernels import extension

log = logging.getLogger(__name__)

# "0" turns them off (the PyTorch paths run instead); "portable" loads the build for any CPU with AVX2 (no VNNI,
# AVX-512 or AMX: compile_flags(avx2, [])) where this CPU has more, so the AVX2 paths run and are tested here too
ENV_VAR = "LLAMASCOPE_NATIVE_KERNELS"
NAME = "llamascope_kernels"
CSRC = Path(__file__).resolve().parent / "csrc"
# The kernels (plain C++, compiled with a build's instruction-set flags); the bindings, the one file with PyTorch's
# headers (compiled once for every build, without them); the entry point that names a build's module (extension.py).
SOURCES = ("elementwise.cpp", "paged_attention.cpp", "quant_linear.cpp", "float_linear.cpp", "step_layers.cpp",
           "interventions.cpp", "argmax.cpp", "gguf_convert.cpp", "lora.cpp")
BINDINGS = "bindings.cpp"
ENTRY = "module.cpp"

STALE_LOCK_SECONDS = 600
# The CPU feature (/proc/cpuinfo's name) each instruction-set flag of compile_flags asks for; None: asks for none.
# A build's recorded flags (build.json) say which CPUs may load it.
FLAG_FEATURES = {"-mavx2": "avx2", "-mfma": "fma", "-mf16c": "f16c", "-mavxvnni": "avx_vnni",
                 "-mavx512vnni": "avx512_vnni", "-mavx512vl": "avx512vl", "-mavx512bw": "avx512bw",
                 "-mamx-tile": "amx_tile", "-mamx-int8": "amx_int8", "-mprefer-vector-width=256": None}
_lock = threading.Lock()
_setting = os.environ.get(ENV_VAR, "1").strip().lower()
_enabled = _setting not in ("0", "false", "off", "no")
# The PORTABLE build a setting loads instead of this CPU's own (tests run the kernels' other paths on it); None: own.
PORTABLE_SETTINGS = {"portable": [], "portable-vnni": ["-mavxvnni"]}
_portable = PORTABLE_SETTINGS.get(_setting)
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


# The builds an image carries besides its build machine's own (`python -m model.kernels --portable`), each the
# vnni_flags of a family of CPUs: any with AVX2, FMA and F16C; those with AVX-VNNI too (256-bit `vpdpbusd`, no
# AVX-512: client CPUs); and those with AVX512-VNNI, -VL and -BW, which the build machine's own does not serve where
# it also asks for AVX-VNNI or AMX (docs/deployment.md names CPUs).
PORTABLE = ([], ["-mavxvnni"], ["-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256", "-mavx512bw"])


def portable_builds(tested_only: bool = False) -> list[list[str]]:
    """The PORTABLE builds this machine makes besides its own: those other than its own whose every flag its CPU
    has (so `python -m model.kernels --portable` can check each once built). `tested_only`: of those, the ones a
    PORTABLE_SETTINGS value loads (what the tests run; the others are for images)."""
    have, own = cpu_flags(), vnni_flags()
    return [v for v in PORTABLE if v != own and _features(v) <= have
            and (not tested_only or v in PORTABLE_SETTINGS.values())]


def _features(flags: list[str]) -> set[str]:
    """The CPU features compiler flags ask for (FLAG_FEATURES; each flag must be one of its keys)."""
    return {FLAG_FEATURES[f] for f in flags} - {None}


def _why(e: Exception) -> str:
    """An exception in one line for a log: its type and its message's last line (a compiler's error ends there)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def compile_flags(avx2: bool, vnni: list[str] | None = None) -> list[str]:
    """The compiler flags of a build for this CPU, or with `vnni` for a CPU with those of vnni_flags' (a portable
    build: [], AVX2, FMA and F16C alone)."""
    # -fopenmp at compile time only: at::parallel_for's OpenMP regions then run on the OpenMP runtime PyTorch
    # already loaded (linking a second libgomp would start a second thread pool beside torch's).
    # -fschedule-insns -fsched-pressure: GCC's scheduling before register allocation, pressure-aware; off by
    # default on x86, and without it the int4 tile's 32 independent maddubs are issued in source order with their
    # int16 sums spilled to the stack (docs/performance.md#native-cpu-kernels); same instructions, same results
    # (it reorders, never reassociates).
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fschedule-insns", "-fsched-pressure"]
    if not avx2:
        return flags
    return flags + ["-mavx2", "-mfma", "-mf16c"] + (vnni_flags() if vnni is None else vnni)


def loaded_vnni_flags() -> list[str]:
    """vnni_flags of the build native() loads: this CPU's, or a PORTABLE_SETTINGS one's."""
    return vnni_flags() if _portable is None else _portable


def instruction_set(flags: list[str]) -> str:
    """What a build's instruction-set flags (compile_flags' vnni part) are for, as /v1/models `execution` and the
    model-load line name it: "avx2" (AVX2, FMA and F16C alone: `LLAMASCOPE_NATIVE_KERNELS=portable`), "avx2+avx-vnni"
    (`portable-vnni`: 256-bit `vpdpbusd`, no AVX-512), "avx512-vnni" (the EVEX `vpdpbusd`, 512-bit tiles with
    AVX512-BW), "avx512-vnni+amx" (and AMX-INT8 tiles). The builds for a CPU of more flags are one of these too."""
    if "-mavx512vnni" in flags:
        return "avx512-vnni" + ("+amx" if "-mamx-int8" in flags else "")
    return "avx2+avx-vnni" if "-mavxvnni" in flags else "avx2"


def built_for() -> str | None:
    """instruction_set of the build native() loaded (as its build.json records it: a compatible_build loaded in place
    of this CPU's own says its own flags), "generic" for one without AVX2; None where the kernels are off or
    unavailable."""
    m = native()
    if m is None:
        return None
    if not m.avx2:
        return "generic"
    try:
        flags = json.loads((Path(m.__file__).parent / "build.json").read_text())["flags"]
    except (OSError, ValueError, KeyError, TypeError):
        flags = loaded_vnni_flags()
    return instruction_set(flags)


def build_dir() -> Path:
    return Path(os.environ.get("LLAMASCOPE_KERNELS_DIR") or Path.home() / ".cache" / "llamascope" / "kernels")


def _with_sources(h):  # a hashlib hash, updated with the sources' names and bytes
    for src in sorted(CSRC.iterdir()):
        h.update(src.name.encode() + src.read_bytes())
    return h


def sources_hash() -> str:
    return _with_sources(hashlib.sha256()).hexdigest()


def module_name(vnni: list[str] | None = None) -> str:
    """Names the build by what it is built from (sources, flags, torch version): a stale .so is never loaded.
    `vnni`: the build with those flags (compile_flags) instead of this CPU's."""
    avx2 = cpu_has_avx2()
    h = _with_sources(hashlib.sha256(" ".join(compile_flags(avx2, vnni) + [torch.__version__]).encode()))
    return f"{NAME}_{'avx2' if avx2 else 'generic'}_{h.hexdigest()[:12]}"


def _record(directory: Path, flags: list[str]) -> None:
    """build.json beside a build: what compatible_build matches another CPU against. Best effort: a build folder
    the server may not write (the image's) keeps the record its build wrote."""
    record = directory / "build.json"
    if record.is_file():
        return
    with contextlib.suppress(OSError):
        record.write_text(json.dumps({"sources": sources_hash(), "torch": torch.__version__, "flags": flags}) + "\n")


def build(verbose: bool = False, vnni: list[str] | None = None) -> ModuleType:
    """Compile the extension into `build_dir()` (a C++ compiler needed; extension.py: every core at once, the objects
    cached) and import it; `vnni`: for a CPU with those flags (compile_flags), not this one. `verbose`: the log
    has every compiler command too."""
    name = module_name(vnni)
    directory = build_dir() / name
    directory.mkdir(parents=True, exist_ok=True)
    # a build waits on another's lock file: one left by a killed build (no build takes 10 minutes) would hold up
    # every later start
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
        log.warning("removing a stale kernel build lock %s", lock)
        lock.unlink(missing_ok=True)
    flags = compile_flags(cpu_has_avx2(), vnni)
    module = extension.load(
        name=name,
        kernels=[CSRC / s for s in SOURCES],
        bindings=CSRC / BINDINGS,
        entry=CSRC / ENTRY,
        extra_cflags=flags,
        base_cflags=compile_flags(False),
        build_directory=str(directory),
        objects=build_dir() / "objects",
        verbose=verbose,
    )
    _record(directory, flags)
    return module


def compatible_build() -> Path | None:
    """The .so of the most capable build of these sources and this torch whose flags this CPU has, where its own is
    missing and cannot be made (an image has no compiler): an image carries the PORTABLE builds its build machine
    could make besides its own (`python -m model.kernels --portable`), so on a CPU without that one's flags it
    still serves on native kernels. None where there is no such build (or no CPU flags to match: not Linux)."""
    have, sources = cpu_flags(), sources_hash()
    best: tuple[int, Path] | None = None
    for record in sorted(build_dir().glob(f"{NAME}_avx2_*/build.json")):
        try:
            r = json.loads(record.read_text())
            flags = [f for f in r["flags"] if f.startswith("-m")]
            if r["sources"] != sources or r["torch"] != torch.__version__ or any(f not in FLAG_FEATURES for f in flags):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        needs = _features(flags)
        so = record.parent / f"{record.parent.name}.so"
        if needs <= have and so.is_file() and (best is None or len(needs) > best[0]):
            best = (len(needs), so)
    return best[1] if best else None


def import_built(path: Path) -> ModuleType:
    """Import a built extension from its .so (named by its file: builds of different sources load side by side)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(vnni: list[str] | None = None) -> ModuleType:
    """Import the built extension if this exact build exists (no compiler needed), else build it; where
    that fails, the most capable compatible build (compatible_build), else the build's error. `vnni`: the build
    for a CPU with those flags (compile_flags), with no fallback."""
    name = module_name(vnni)
    path = build_dir() / name / f"{name}.so"
    if path.is_file():
        module = import_built(path)
        _record(path.parent, compile_flags(cpu_has_avx2(), vnni))  # (a build made before builds were recorded)
        log.info("native CPU kernels: loaded %s", path)  # which build: the image's, or this machine's own
        return module
    log.info("native CPU kernels: no build at %s; building it (under a minute on 2 cores)", path)
    try:
        return build(vnni=vnni)
    except Exception as e:
        other = compatible_build() if vnni is None else None
        if other is None:
            raise
        log.warning("native CPU kernels: no build for this CPU's flags and none could be made (%s); loaded %s, "
                    "a build for a CPU with fewer of them", _why(e), other)
        return import_built(other)


def native() -> ModuleType | None:
    """The kernels module, loaded (or built) on first use; None when off or unavailable (then use PyTorch ops)."""
    global _module, _error, _tried
    if not _enabled:
        return None
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    _module = load() if _portable is None else load(_portable)
                except Exception as e:  # no compiler: serve on the PyTorch paths, and say why once
                    _error = _why(e)
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
