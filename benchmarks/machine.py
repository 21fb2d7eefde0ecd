"""What the numbers were measured on (the host class, the commit, the date), and how much memory the process held.

RSS comes from /proc/self/status (VmRSS now, VmHWM the peak). The peak can be reset per phase by writing "5" to
/proc/self/clear_refs (Linux >= 4.0, proc(5)), so the serving phase's peak is not the loader's transient one; where
that is refused, `PeakRSS` says the peak is cumulative. ru_maxrss (getrusage(2), KiB on Linux) is the whole
process's peak, except that the kernel resets it with VmHWM; `PeakRSS` keeps the whole process's peak itself.
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

MB = 1 << 20


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_mb() -> float | None:
    kib = _status_kib("VmRSS")
    return kib / 1024 if kib is not None else None


def ru_maxrss_mb() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / MB if sys.platform == "darwin" else r / 1024  # bytes on macOS, KiB on Linux


class PeakRSS:
    """Peak RSS (and peak CUDA allocation) over one phase of the run."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.reset_ok = False
        self.process_peak_mb = 0.0  # over every phase so far: the resets below erase the kernel's own

    def _peak_mb(self) -> float:
        hwm = _status_kib("VmHWM")
        return hwm / 1024 if hwm is not None else ru_maxrss_mb()

    def reset(self) -> None:
        self.process_peak_mb = max(self.process_peak_mb, self._peak_mb())
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset_ok = True
        except OSError:
            self.reset_ok = False
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def read(self) -> dict:
        peak = self._peak_mb()
        self.process_peak_mb = max(self.process_peak_mb, peak)
        out = {
            "peak_rss_mb": peak,
            "peak_is_cumulative": not self.reset_ok,  # true: since process start, not since this phase began
            "ru_maxrss_mb": ru_maxrss_mb(),  # the same peak as getrusage sees it (reset along with VmHWM)
            "rss_mb": rss_mb(),
        }
        if self.cuda:
            out["cuda_peak_allocated_mb"] = torch.cuda.max_memory_allocated() / MB
            out["cuda_allocated_mb"] = torch.cuda.memory_allocated() / MB
        return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_mb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


# AMD's families and models by core generation (AMD's processor programming references; Linux's
# arch/x86/kernel/cpu/amd.c names the same ranges): what docs/performance.md calls a host class
_AMD_ZEN = [(0x17, range(0x00, 0x30), "Zen 1"), (0x17, range(0x30, 0x100), "Zen 2"), (0x19, range(0x00, 0x10), "Zen 3"),
            (0x19, range(0x20, 0x30), "Zen 3"), (0x19, range(0x40, 0x60), "Zen 3"),
            (0x19, range(0x10, 0x20), "Zen 4"), (0x19, range(0x60, 0x80), "Zen 4"),
            (0x19, range(0xA0, 0x100), "Zen 4"), (0x1A, range(0x00, 0x100), "Zen 5")]


def _cpuinfo() -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not line.strip():
                    break  # the first processor's entry says it for all
                out[key.strip()] = value.strip()
    except OSError:
        pass
    return out


def host_class() -> str:
    """The machine as docs/performance.md names it: "AMD Zen 3, AVX2, 2 cores", "Intel, AVX-512 + VNNI, 2 cores"."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    vendor = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(info.get("vendor_id", ""), platform.machine())
    name = vendor
    if vendor == "AMD":
        family, model = int(info.get("cpu family", "0")), int(info.get("model", "0"))
        name = next((f"AMD {zen}" for fam, models, zen in _AMD_ZEN if fam == family and model in models),
                    f"AMD family {family} model {model}")
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    if "avx512_vnni" in flags or "avx_vnni" in flags:
        isa += " + VNNI"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {isa}, {cores} cores"


def source_commit() -> str | None:
    """The commit of the checkout the benchmark runs from, "+dirty" when its tracked files differ from it."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def machine_info(device: torch.device | str, threads: int) -> dict:
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    info = {
        "host_class": host_class(),
        "commit": source_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mem_total_mb": _mem_total_mb(),
        "threads": threads,
        "torch_version": torch.__version__,
        "transformers_version": tf_version,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
    }
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(device_name=props.name, device_mem_mb=props.total_memory / MB, cuda_version=torch.version.cuda)
    return info
