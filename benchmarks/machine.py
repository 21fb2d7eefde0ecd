"""What the numbers were measured on, and how much memory the process held.

RSS comes from /proc/self/status (VmRSS now, VmHWM the peak). The peak can be reset per phase by writing "5" to
/proc/self/clear_refs (Linux >= 4.0, proc(5)), so the serving phase's peak is not the loader's transient one; where
that is refused, `PeakRSS` says the peak is cumulative. ru_maxrss (getrusage(2), KiB on Linux) is the whole
process's peak, except that the kernel resets it with VmHWM; `PeakRSS` keeps the whole process's peak itself.
"""

from __future__ import annotations

import os
import platform
import resource
import sys

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


def machine_info(device: torch.device | str, threads: int) -> dict:
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    info = {
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
