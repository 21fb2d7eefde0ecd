"""The native kernels' build: each C++ file compiled on its own, on every core at once, each object kept in a cache,
then linked into one Python extension (model/kernels/__init__.py names and loads it).

torch.utils.cpp_extension.load compiles every source with PyTorch's include flags under the module's name, in a
folder named by the build, so a build of new sources or another CPU's flags compiles everything again. Here only
csrc/bindings.cpp includes PyTorch (csrc/tensor.h says why); it is compiled without the instruction-set flags, so one
object serves every build (this CPU's own and the PORTABLE ones); each kernel file is compiled with its build's flags;
csrc/module.cpp gives the .so its importable name. An object is named by what made it (compiler, flags, its file and
the headers), so a change to one .cpp file recompiles that file alone (a header, every file). The flags and libraries
are cpp_extension's own (`include_paths`, `library_paths`); its lock file is kept too: a second build of the same
name waits for the first, and model/kernels/__init__.py clears a stale one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

log = logging.getLogger("model.kernels")

POLL_SECONDS = 0.5


def _cxx() -> str:
    return os.environ.get("CXX", "c++")


def _include_flags() -> list[str]:
    from torch.utils import cpp_extension

    return [f for p in cpp_extension.include_paths() + [sysconfig.get_paths()["include"]] for f in ("-isystem", p)]


def _link_flags() -> list[str]:
    from torch.utils import cpp_extension

    # the darwin linker needs consent to leave Python's symbols to the interpreter (cpp_extension adds the same)
    darwin = ["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else []
    return ["-shared"] + [f"-L{p}" for p in cpp_extension.library_paths()] + \
        ["-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"] + darwin


def jobs() -> int:
    """Compilers at once: MAX_JOBS (cpp_extension's variable) where set, else the cores this process may run on."""
    if os.environ.get("MAX_JOBS", "").isdigit():
        return max(1, int(os.environ["MAX_JOBS"]))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _object(cache: Path, source: Path, command: list[str], headers: bytes) -> Path:
    """Where `source` compiled by `command` is kept: named by the command (less the paths of its input and output),
    the file's bytes and every header's."""
    h = hashlib.sha256("\0".join(command).encode() + b"\0" + source.read_bytes() + b"\0" + headers)
    return cache / f"{source.stem}-{h.hexdigest()[:16]}.o"


def _compile(source: Path, command: list[str], obj: Path, verbose: bool = False) -> float:
    t0 = time.perf_counter()
    tmp = obj.with_name(f"{obj.name}.{os.getpid()}.tmp")
    run = [_cxx(), *command, "-c", str(source), "-o", str(tmp)]
    log.log(logging.INFO if verbose else logging.DEBUG, "%s", shlex.join(run))
    done = subprocess.run(run, capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compiling {source.name} failed:\n{done.stderr.strip()}")
    os.replace(tmp, obj)  # whole or not at all: a build running beside this one may take it
    return time.perf_counter() - t0


def _link(objects: list[Path], so: Path) -> None:
    tmp = so.with_name(f"{so.name}.{os.getpid()}.tmp")
    done = subprocess.run([_cxx(), *map(str, objects), *_link_flags(), "-o", str(tmp)], capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"linking {so.name} failed:\n{done.stderr.strip()}")
    os.replace(tmp, so)  # a process loading it meanwhile sees the whole file or none


def _lock(path: Path) -> bool:
    """Take the build's lock file (cpp_extension's FileBaton contract); False: another build holds it."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def _held(lock: Path, stale: float) -> bool:
    """Whether another build still holds `lock` (a lock older than `stale` seconds is a killed build's)."""
    try:
        return time.time() - lock.stat().st_mtime < stale
    except FileNotFoundError:
        return False


def load(name: str, kernels: list[Path], bindings: Path, entry: Path, extra_cflags: list[str], base_cflags: list[str],
         build_directory: str, objects: Path, verbose: bool = False):
    """Build `name` into build_directory/name.so, unless another build of it holds the lock (then wait for it), and
    import it. `kernels` are compiled with extra_cflags, `bindings` with base_cflags (the ones every build shares),
    `entry` with the module's name; objects are taken from, and kept in, `objects`. Progress goes to the log
    ("model.kernels", INFO; `python -m model.kernels` shows it), and with `verbose` every compiler command."""
    from model import kernels as _kernels  # import_built (no cycle: this runs after model.kernels is loaded)

    directory = Path(build_directory)
    directory.mkdir(parents=True, exist_ok=True)
    so = directory / f"{name}.so"
    lock = directory / "lock"
    if not _lock(lock):
        log.info("native kernels: another process is building %s; waiting for it", name)
        while _held(lock, _kernels.STALE_LOCK_SECONDS):
            time.sleep(POLL_SECONDS)
        if so.is_file():
            return _kernels.import_built(so)
        return load(name, kernels, bindings, entry, extra_cflags, base_cflags, build_directory, objects, verbose)
    try:
        t0 = time.perf_counter()
        objects.mkdir(parents=True, exist_ok=True)
        headers = b"".join(p.name.encode() + p.read_bytes() for p in sorted(bindings.parent.glob("*.h")))
        common = ["-fPIC", "-std=c++20", "-DTORCH_API_INCLUDE_EXTENSION_H"] + _include_flags()
        units = [(bindings, common + base_cflags)] + [(k, common + extra_cflags) for k in kernels]
        plan = [(src, cmd, _object(objects, src, cmd, headers)) for src, cmd in units]
        todo = [(src, cmd, obj) for src, cmd, obj in plan if not obj.is_file()]
        # the largest first (bindings.cpp, PyTorch's headers; then paged_attention.cpp): the last to finish is short
        todo.sort(key=lambda u: (u[0] != bindings, -u[0].stat().st_size))
        n = jobs()
        log.info("native kernels: compiling %d of %d C++ files (%d already compiled) on %d core(s): %s", len(todo),
                 len(plan), len(plan) - len(todo), n, name)
        with ThreadPoolExecutor(max_workers=n) as pool:
            futures = {pool.submit(_compile, src, cmd, obj, verbose): src for src, cmd, obj in todo}
            for i, future in enumerate(as_completed(futures), 1):
                log.info("native kernels: [%d/%d] %s (%.0f s)", i, len(todo), futures[future].name, future.result())
        entry_obj = directory / "module.o"
        _compile(entry, ["-fPIC", "-std=c++20", f"-DTORCH_EXTENSION_NAME={name}"], entry_obj)
        _link([entry_obj] + [obj for _, _, obj in plan], so)
        log.info("native kernels: linked %s in %.0f s", so, time.perf_counter() - t0)
    finally:
        lock.unlink(missing_ok=True)
    return _kernels.import_built(so)
