"""Large, long-lived CPU tensors (the weights, the KV pool) in memory backed by 2 MB pages.

A decode step reads every weight once: 96 MB a token for the default model served as int4. On 4 KB pages that is
24,000 pages a token, each one a TLB miss, and each one a fresh start for the hardware prefetchers, which stop at a
4 KB page boundary. Linux backs an anonymous mapping with transparent 2 MB pages where the mapping asks for them
(`madvise(MADV_HUGEPAGE)`; the kernel's `transparent_hugepage/enabled` is "madvise" on Debian and Ubuntu, and then
nothing else gets them), or moves written 4 KB pages onto them (`MADV_COLLAPSE`). llama.cpp leaves this to the OS
(its weights are a file mapping on 4 KB pages).

The weights are written on 4 KB pages and collapsed onto 2 MB ones by a background thread once loaded (`collapse`);
the KV pool is advised at once and faulted in by another (`populate_later`).

`python -m benchmarks.gemm` measures a one-row matmul streaming its weights from memory on both kinds of page
(docs/performance.md#native-cpu-kernels).

Where the kernel refuses (THP "never", no Linux, a failed mapping) the memory is ordinary and only the speed differs:
nothing here changes a value.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import logging
import mmap
import threading
import time
import weakref

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

PAGE = 2 << 20  # x86-64's transparent huge page
ALIGN = 64  # each tensor on a cache line of its own
MADV_POPULATE_WRITE = 23  # Linux 5.14+, uapi asm-generic/mman-common.h
MADV_COLLAPSE = 25  # Linux 6.1+, the same header
# Bytes faulted in per madvise call: one huge page. The call holds the process's mmap lock (read) while it faults
# its range in, and anything that maps memory meanwhile (a thread's stack, a large allocation) waits for it: on a VM,
# where a fresh page also costs the hypervisor a fault, large calls held thread starts and allocations (the engine's
# own among them) for as long as the call took. One huge page a call bounds that wait, and populates no slower.
POPULATE_CHUNK = PAGE


_mappings: dict[int, weakref.ref] = {}  # an arena's storage address -> its mapping, while the mapping lives
# The background threads (`populate_later`, `collapse_later`) while they run, and the flag that stops them between
# two madvise calls when the interpreter exits (`_stop_background`).
_background: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_exiting = threading.Event()


def arena(nbytes: int, huge_now: bool = True) -> Tensor:
    """(nbytes,) uint8 zeros starting on a 2 MB boundary, in an anonymous mapping advised for 2 MB pages (Linux);
    ordinary zeros where that is not available. The tensor keeps its mapping alive; a page is resident once written
    (or read). `huge_now=False`: not advised yet, so its pages fault in as 4 KB ones, to be moved onto 2 MB pages
    once written (`collapse_later`)."""
    if nbytes > 0 and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if huge_now:
                buf.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: pages are allocated at the first write
            whole = torch.frombuffer(buf, dtype=torch.uint8)
            skip = -whole.data_ptr() % PAGE
            for dead in [p for p, ref in _mappings.items() if ref() is None]:
                del _mappings[dead]
            _mappings[whole.data_ptr()] = weakref.ref(buf)
            return whole[skip : skip + nbytes]
        except (OSError, ValueError) as e:
            log.debug("no huge-page arena (%s): ordinary memory", e)
    return torch.zeros(nbytes, dtype=torch.uint8)


def _madvise():
    """libc's madvise through ctypes, which releases the GIL for the call (a populate runs for seconds), or None."""
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return f


_MADVISE = _madvise()


def populate(t: Tensor, threads: int = 1) -> bool:
    """Fault every page under `t` in, writable, without writing it (`madvise(MADV_POPULATE_WRITE)`), `threads` threads
    each a share of it, `POPULATE_CHUNK` bytes a call, the GIL released. A page already present keeps its bytes, so
    this may run beside a writer; a page faulted here reads as zeros, as one faulted by a first write would. On a
    VM a fresh page is a fault the hypervisor serves too, slowest for memory the guest had handed back to it.
    -> False where the kernel refuses (before Linux 5.14, not Linux): nothing happened, and the pages are faulted in
    as they are first written."""
    if _MADVISE is None or t.device.type != "cpu" or t.nbytes == 0:
        return False
    lo = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    hi = t.data_ptr() + t.nbytes
    bounds = [lo + (hi - lo) * i // threads // mmap.PAGESIZE * mmap.PAGESIZE for i in range(threads)] + [hi]
    refused: list[int] = []

    def run(a: int, b: int) -> None:
        for c in range(a, b, POPULATE_CHUNK):
            if _exiting.is_set():
                return
            if refused or _MADVISE(c, min(POPULATE_CHUNK, b - c), MADV_POPULATE_WRITE) != 0:
                refused.append(ctypes.get_errno())
                return

    workers = [threading.Thread(target=run, args=(a, b), daemon=True) for a, b in zip(bounds, bounds[1:]) if b > a]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if refused:
        log.debug("MADV_POPULATE_WRITE refused (errno %s): pages fault in as written", refused[0])
    return not refused


def on_huge_pages(t: Tensor) -> bool:
    """Whether `t` lies in an `arena` (which `place_weights` then leaves where it is)."""
    ref = _mappings.get(t.untyped_storage().data_ptr()) if t.device.type == "cpu" else None
    return ref is not None and ref() is not None


class WeightArena:
    """Served weights written in place by a loader: tensors carved one after another out of one arena of `capacity`
    bytes (the loader's estimate of the served weights, from the file's headers). Only written pages become
    resident, so an overestimate costs address space, not memory; past the capacity, ordinary tensors, which
    `place_weights` moves later. Writing the weights here once saves the copy `place_weights` would make: on a VM
    every fresh page costs a fault the hypervisor serves, seconds a GB when cold."""

    def __init__(self, capacity: int) -> None:
        self.base, self.used = arena(capacity, huge_now=False), 0  # (4 KB pages while loading: `collapse_later`)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An uninitialised (zero until written) tensor of `shape`, on a cache line of its own."""
        n = 1
        for d in shape:
            n *= d
        n *= torch.empty((), dtype=dtype).element_size()
        start = -(-self.used // ALIGN) * ALIGN
        if start + n > self.base.numel():
            return torch.empty(shape, dtype=dtype)
        self.used = start + n
        return self.base[start : start + n].view(dtype).view(shape)


def empty(shape: tuple[int, ...], dtype: torch.dtype, resident: bool = True) -> Tensor:
    """A zero-filled tensor of `shape` in its own huge-page arena (the KV pool), its pages faulted in now, on every
    torch thread (`populate`), as `torch.zeros` would leave them: a pool the machine cannot hold fails at start-up,
    not under load. `resident=False`: not yet (`populate_later`); a page is then faulted in by its first write, and
    reads zeros until written."""
    n = 1
    for s in shape:
        n *= s
    t = arena(n * torch.empty((), dtype=dtype).element_size()).view(dtype).view(shape)
    if resident and not populate(t, torch.get_num_threads()):
        t.zero_()  # (writing the zeros faults every page in)
    return t


def populate_later(tensors: list[Tensor]) -> threading.Thread:
    """One daemon thread, started, that faults in the pages of each tensor in turn (`populate`, one thread: the other
    cores stay the caller's) while the caller goes on; `.join()` waits for it."""
    worker = _background_thread(lambda: [populate(t) for t in tensors], "populate")
    worker.start()
    return worker


def _background_thread(target, name: str) -> threading.Thread:
    """A daemon thread running `target`, not started, that the interpreter's exit stops and waits for."""
    worker = threading.Thread(target=target, name=name, daemon=True)
    _background.add(worker)
    return worker


@atexit.register
def _stop_background() -> None:
    """Stop the background threads at their next madvise call and wait for them, before the interpreter finalizes.
    A daemon thread still running then is halted wherever it next takes the GIL, and where that is inside C++ code
    the process aborts ("terminate called without an active exception") instead of exiting with its own status: a
    process ending beside a freshly built engine did so now and then. Atexit functions run after the non-daemon
    threads are joined and before daemon threads are halted (Python's Py_FinalizeEx)."""
    _exiting.set()
    for worker in list(_background):
        worker.join()


def _collapse_ranges(tensors: list[Tensor]) -> list[tuple[int, int]]:
    """The whole 2 MB pages of the arenas under `tensors` that hold any of their bytes, merged: [(start, end), ...]."""
    chunks: set[int] = set()
    for t in tensors:
        if t.device.type != "cpu" or t.nbytes == 0 or not on_huge_pages(t):
            continue
        storage = t.untyped_storage()
        m0, m1 = storage.data_ptr(), storage.data_ptr() + storage.nbytes()  # the mapping
        lo, hi = t.data_ptr() // PAGE * PAGE, t.data_ptr() + t.nbytes
        chunks.update(c for c in range(lo, hi, PAGE) if c >= m0 and c + PAGE <= m1)
    ranges: list[tuple[int, int]] = []
    for c in sorted(chunks):
        if ranges and ranges[-1][1] == c:
            ranges[-1] = (ranges[-1][0], c + PAGE)
        else:
            ranges.append((c, c + PAGE))
    return ranges


def collapse(tensors: list[Tensor]) -> str:
    """Move the written pages under `tensors` (in arenas mapped with `huge_now=False`) onto 2 MB pages: advise them
    (`MADV_HUGEPAGE`), then `madvise(MADV_COLLAPSE)` one 2 MB page a call (Linux 6.1+; the call copies the page's 4
    KB pages into a fresh 2 MB one and swaps them under the mmap lock, so readers and writers meanwhile see the same
    bytes throughout), the GIL released. Why not 2 MB pages from the start: on a VM a fresh 2 MB page costs the
    hypervisor a fault, and where the guest handed its free memory back (free page reporting) those come in several
    times slower than fresh 4 KB pages (the guest reuses memory it has not reported first); loading into 4 KB pages
    and collapsing them afterwards moves that cost off the start-up (docs/performance.md#loading). -> "collapsed"
    (every page), "advised" (the kernel refused the collapse: khugepaged moves advised memory over time), or "" (not
    Linux, or no whole 2 MB page of an arena to move)."""
    return _collapse(_collapse_ranges(tensors))


def _collapse(ranges: list[tuple[int, int]]) -> str:
    """`collapse` over ranges `_collapse_ranges` found."""
    if _MADVISE is None or not ranges:
        return ""
    for a, b in ranges:
        _MADVISE(a, b - a, mmap.MADV_HUGEPAGE)
    failed = 0
    for a, b in ranges:
        for c in range(a, b, PAGE):
            if _exiting.is_set():
                return "advised"
            if _MADVISE(c, PAGE, MADV_COLLAPSE) != 0:
                if ctypes.get_errno() == errno.EINVAL:  # before Linux 6.1
                    return "advised"
                failed += 1  # EAGAIN / ENOMEM: that page stays on 4 KB pages
    if failed:
        log.debug("MADV_COLLAPSE left %d of the weights' 2 MB pages on 4 KB pages", failed)
    return "collapsed"


def collapse_later(tensors: list[Tensor]) -> threading.Thread:
    """One daemon thread, started, that runs `collapse(tensors)` while the caller goes on and logs how it went (the
    result in `.outcome`); `.join()` waits for it."""

    def run() -> None:
        start, ranges = time.perf_counter(), _collapse_ranges(tensors)
        worker.outcome = _collapse(ranges)
        if worker.outcome:
            log.info("%.0f MB of weights %s in %.1f s (the process holds %s MB on 2 MB pages)",
                     sum(b - a for a, b in ranges) / 2**20,
                     "moved onto 2 MB pages" if worker.outcome == "collapsed" else "advised for 2 MB pages",
                     time.perf_counter() - start, granted_mb())

    worker = _background_thread(run, "collapse")
    worker.outcome = None
    worker.start()
    return worker


def place_weights(model: nn.Module, min_bytes: int = 1 << 16) -> int:
    """Copy every CPU parameter and buffer of at least `min_bytes` (but those already in an arena, e.g. written
    there by a loader's `WeightArena`) into one huge-page arena and rebind the modules to the copies: the same values,
    contiguous; a tensor two modules share (tied embeddings) stays shared. Each
    original is released as soon as it is copied, so the peak is the arena plus the largest tensor, not twice the
    weights. Call it before anything keeps references to the weights (the native decode path, CUDA graphs).
    -> bytes placed."""
    slots: dict[int, list[tuple[nn.Module, str, str]]] = {}  # id(tensor) -> where the modules hold it
    sizes: dict[int, int] = {}
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(module, kind).items():
                if t is not None and t.device.type == "cpu" and t.nbytes >= min_bytes and not on_huge_pages(t):
                    slots.setdefault(id(t), []).append((module, kind, name))
                    sizes[id(t)] = -(-t.nbytes // ALIGN) * ALIGN
    total = sum(sizes.values())
    if total == 0:
        return 0
    base, offset = arena(total, huge_now=False), 0
    with torch.no_grad():
        for where in slots.values():
            module, kind, name = where[0]
            t = getattr(module, kind)[name]
            view = base[offset : offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
            new = nn.Parameter(view, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else view
            offset += sizes[id(t)]
            del t
            for module, kind, name in where:
                getattr(module, kind)[name] = new
    return total


def granted_mb() -> str:
    """The process's memory on transparent huge pages, in MB (Linux's AnonHugePages), or "?" where unreadable."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return str(int(line.split()[1]) // 1024)
    except (OSError, ValueError, IndexError):
        pass
    return "?"
