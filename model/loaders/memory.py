"""What a checkpoint will take once served, known from its headers before any weight is read, and what the machine
can give: a checkpoint too large is refused with the figure it needs, not killed by the kernel half-way through."""

from __future__ import annotations

import math
import os
from pathlib import Path

from model.quantize import GROUP_SIZE

# Bytes per weight of the served formats (model/quantize/): int4 nibbles + float16 d and m per 32 (symmetric: d
# alone; Q4_K's scales: bytes sc and m per 32, float16 D and Dmin per 256); int8 + float16 d; int6 as Q6_K.
INT4_BYTES = 0.5 + 4 / GROUP_SIZE
INT4_SYMMETRIC_BYTES = 0.5 + 2 / GROUP_SIZE
INT4_K_BYTES = 0.5 + 2 / GROUP_SIZE + 4 / 256  # Q4_K's scales: a byte each for sc and m per 32, D and Dmin per 256
INT8_BYTES = 1 + 2 / GROUP_SIZE
INT6_BYTES = 0.75 + 1 / 16 + 2 / 256  # GGUF Q6_K's: 6-bit q, an int8 scale per 16, a float16 d per 256


def served_bytes(kind: str, rows: int, cols: int, float_bytes: int, layout: str = "") -> int:
    """Bytes a (rows, cols) matrix takes served as `kind` ("int4", "int6", "int8", or a float of `float_bytes`);
    `layout`: int4's scales layout (gguf_blocks.scales_layout: "sym", "k" or "")."""
    if kind == "int4":
        return math.ceil(rows * cols * {"sym": INT4_SYMMETRIC_BYTES, "k": INT4_K_BYTES}.get(layout, INT4_BYTES))
    if kind in ("int8", "int6"):
        return math.ceil(-(-rows // 8) * 8 * cols * (INT8_BYTES if kind == "int8" else INT6_BYTES))
    return rows * cols * float_bytes


def available_bytes() -> int | None:
    """Memory this process may still take: MemAvailable, lowered to the cgroup's limit less its usage where one is
    set (cgroup v2 `memory.max`, as a container runtime sets it). None where neither can be read."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    cg = Path("/sys/fs/cgroup")
    try:
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((cg / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_fits(parts: dict[str, int], what: str, advice: str, available: int | None = None, digits: int = 1) -> None:
    """Raise MemoryError naming the figures when `parts` (label -> bytes: the weights, a KV pool) together exceed
    what the machine has: "{what} T GiB ({label} A GiB + {label} B GiB) but C GiB is available: {advice}", `what`
    e.g. "model.gguf needs"."""
    available = available_bytes() if available is None else available
    total = sum(parts.values())

    def gib(n: int) -> str:
        return f"{n / 2**30:.{digits}f} GiB"

    if available is not None and total > available:
        raise MemoryError(f"{what} {gib(total)} ({' + '.join(f'{label} {gib(n)}' for label, n in parts.items())}) but "
                          f"{gib(available)} is available: {advice}")


def process_peak_bytes() -> int | None:
    """This process's peak resident set so far (VmHWM), or None off Linux."""
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
