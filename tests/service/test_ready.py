"""Ready means full speed: when /health first answers 200, the KV pool is already resident, so the first requests
do not decode beside the thread faulting it in (or fault pages in themselves). A real `python -m service` process,
its resident memory read at its first 200. (The speed itself, first streams against the same streams a minute
later: `python -m benchmarks.ready_speed`, docs/performance.md#ready-means-full-speed.)"""

from __future__ import annotations

from pathlib import Path

from benchmarks.load import ServedProcess
from benchmarks.tiny_checkpoint import write_tiny_checkpoint

POOL = 384 << 20  # large beside the tiny model and the interpreter, small beside the machine


def mappings(pid: int) -> list[tuple[int, int]]:
    """(size, resident) in bytes of each of the process's mappings of a MiB or more."""
    out, size = [], 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if line.startswith("Size:"):
            size = int(line.split()[1]) * 1024
        elif line.startswith("Rss:") and size >= 1 << 20:
            out.append((size, int(line.split()[1]) * 1024))
    return out


def test_the_kv_pool_is_resident_when_health_first_says_ready(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "tiny-llama", seed=2)
    server = ServedProcess(["--model", str(model), "--kv-cache-bytes", str(POOL), "--threads", "1"],
                           tmp_path / "server.log")  # returns at the first /health 200
    try:
        maps = mappings(server.proc.pid)
    finally:
        code = server.stop(30)
    # K and V are huge-page arenas of their own (model/huge_pages.py; the kernel may merge the two into one
    # mapping): mappings whose every page but the arenas' 2 MB alignment slack is resident hold the whole pool
    whole = sum(resident for size, resident in maps if resident >= size - (4 << 20))
    assert whole >= 0.95 * POOL, f"fully resident mappings: {whole >> 20} MiB; all: {[(s >> 20, r >> 20) for s, r in maps]}"
    assert code == 0, (tmp_path / "server.log").read_text()[-3000:]
