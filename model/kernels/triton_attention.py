"""Decode attention over the paged KV pool on CUDA, as a Triton kernel: no per-step gather of whole sequences.

The eager CUDA path gathers each decode group's blocks into a padded (B, S) copy every layer and step, then runs
SDPA with a length mask; this kernel instead walks each sequence's block table, one program per (decode row,
query head), with the online softmax of flash attention (Dao et al. 2022; PagedAttention's decode kernel, Kwon
et al. 2023). Same contract as the native CPU kernel (`model/kernels/csrc/paged_attention.cpp`):

    q (N, H, E) packed rows (token stride free, heads contiguous); k_pool, v_pool (NB, bs, K, E); rows (R,) the
    decode rows; tables (R, W) their block ids; lens (R,) their context lengths; out (N, H, E): rows `rows` written.

An int8 cache's pools are (NB, bs, K, E + 4): a block's rows of quants, then their float32 scales (model/kernels/
kv_int8.py); both kernels multiply a key's score by its scale and a value's weight by its own (INT8, a compile-time
switch), as the native kernel does.

`paged_prefill_attention` is its counterpart for a step's prefill chunks: one launch serves every chunk of the step
(tiles of up to 32 query rows of one chunk each, causal over the chunk's cached prefix and itself), instead of a
gather and an SDPA call per chunk per layer (vLLM's varlen attention over the block tables).

It needs Triton (shipped with PyTorch's CUDA builds) and a power-of-two block size. The test suite runs it on CPU
through Triton's interpreter (`TRITON_INTERPRET=1`, tests/model/test_triton_attention.py) against SDPA; no GPU has run
it yet in this project (see the README's performance section).

Importing Triton proves little: the first launch on a device compiles the kernel (ptxas) and builds a small C
launcher with the machine's C compiler, linked against the driver's libcuda.so (triton/runtime/build.py,
backends/nvidia/driver.py). PyTorch's CUDA runtime images ship no compiler, so there every first decode step would
raise. `available` therefore launches the kernel once per process, device and dtype on a tiny paged context and
compares it with SDPA; on any failure it logs one line and answers False, and the callers keep the gather + SDPA path.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import tempfile

import torch
import torch.nn.functional as F
from torch import Tensor

from model.kernels import kv_int8

try:  # Triton is optional: CPU-only installs do not have it, and the CUDA path then gathers as before
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None


log = logging.getLogger(__name__)

_checked: dict[tuple[str, torch.dtype, torch.dtype], bool] = {}  # (device, dtype, cache dtype) -> whether the
# one-off launch matched SDPA
FALLBACKS = {"triton_cache": 0}  # times this process moved Triton's cache (`ensure_cache_dir`); read by the engine


def available(q: Tensor, block_size: int, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether this kernel can serve `q`'s decode rows over a cache of `kv_dtype` (None: q's): Triton present, a CUDA
    tensor (or Triton's interpreter), a power-of-two block size (Triton's ranges are powers of two), and a first
    launch on q's device and dtype over such a cache that ran and matched SDPA (`_launch_check`, once per process)."""
    if triton is None or block_size & (block_size - 1):
        return False
    if not (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    key = (str(q.device), q.dtype, kv_dtype or q.dtype)
    if key not in _checked:
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            return True  # no launch + sync inside a graph capture; the capture itself fails (and falls back) if it must
        _checked[key] = _launch_check(q.device, q.dtype, block_size, kv_dtype or q.dtype)
    return _checked[key]


def _launch_check(device: torch.device, dtype: torch.dtype, block_size: int, kv_dtype: torch.dtype) -> bool:
    """One tiny launch against SDPA: 2 query heads on 1 KV head (GQA), a context of block_size + 3 tokens over two
    out-of-order blocks, the second partly filled; over a cache of `kv_dtype` (SDPA reads its values as stored)."""
    H, K, E, n, table = 2, 1, 16, block_size + 3, [2, 0]
    g = torch.Generator().manual_seed(0)
    k_pool, v_pool = (torch.randn(3, block_size, K, E, generator=g).to(device, dtype) for _ in range(2))
    if kv_dtype == torch.int8:
        k_pool, v_pool = kv_int8.pack(k_pool), kv_int8.pack(v_pool)  # (3, bs, K, E + 4)
    q = torch.randn(1, H, E, generator=g).to(device, dtype)  # (N=1, H, E)
    out = torch.zeros(1, H, E, dtype=dtype, device=device)
    try:
        if device.type == "cuda":
            ensure_cache_dir()
            _point_triton_at_libcuda()
        rows, lens = torch.tensor([0], device=device), torch.tensor([n], device=device)
        tables = torch.tensor([table], device=device)
        paged_decode_attention(q, k_pool, v_pool, rows, tables, lens, out, split=False)
        split = torch.zeros_like(out)  # the split-KV launch and its reduction too (one partition here)
        paged_decode_attention(q, k_pool, v_pool, rows, tables, lens, split, split=True)
        k = kv_int8.read(k_pool[table], torch.float32).reshape(-1, K, E)[:n].transpose(0, 1).expand(H, n, E)  # (H, n, E)
        v = kv_int8.read(v_pool[table], torch.float32).reshape(-1, K, E)[:n].transpose(0, 1).expand(H, n, E)
        # (over an int8 cache the kernel's query is rounded: kv_int8.round_query)
        qf, scale = (kv_int8.round_query(q), 1.0) if kv_dtype == torch.int8 else (q.float(), None)
        want = F.scaled_dot_product_attention(qf.transpose(0, 1), k, v, scale=scale)[:, 0]  # (H, 1, E) -> (H, E)
        err = max((out[0].float() - want).abs().max().item(), (split[0].float() - want).abs().max().item())
    except Exception as e:  # no C compiler, no libcuda.so, ptxas, an old GPU, ...: whatever it is, do not serve on it
        lines = str(e).strip().splitlines()
        log.warning("Triton paged decode attention failed its first launch on %s %s (cache %s) (%s: %s); decode "
                    "attention uses gather + SDPA", device, dtype, kv_dtype, type(e).__name__,
                    (lines[0] if lines else "")[:300])
        return False
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # as tests/triton_interpret_check.py (relative there; |v| ~ 1)
    if not err <= tol:  # NaN too
        log.warning("Triton paged decode attention differs from SDPA by %.2e on %s %s (tolerance %.0e); decode "
                    "attention uses gather + SDPA", err, device, dtype, tol)
        return False
    return True


def ensure_cache_dir() -> None:
    """Triton writes every compiled kernel to its cache directory (TRITON_CACHE_DIR, else $TRITON_HOME/.triton/cache,
    else ~/.triton/cache: triton/knobs.py) and fails the launch where it cannot. Under an arbitrary UID (OpenShift,
    `docker run --user`) the home directory is often not writable: then the cache moves to a private temporary
    directory, with a log line (the image sets a writable TRITON_CACHE_DIR itself: the Dockerfile)."""
    want = os.environ.get("TRITON_CACHE_DIR") or os.path.join(
        os.environ.get("TRITON_HOME") or os.path.expanduser("~"), ".triton", "cache")
    try:
        os.makedirs(want, exist_ok=True)
        with tempfile.TemporaryFile(dir=want):
            return
    except OSError as e:
        moved = tempfile.mkdtemp(prefix="llamascope-triton-")
        os.environ["TRITON_CACHE_DIR"] = moved
        FALLBACKS["triton_cache"] += 1
        log.warning("Triton's cache directory %s is not writable (%s); compiled kernels go to %s for this process "
                    "(set TRITON_CACHE_DIR to a writable directory to keep them)", want, type(e).__name__, moved)


def _libcuda_dirs() -> list[str]:
    """Directories holding libcuda.so.1, found as Triton 3.3 finds them (backends/nvidia/driver.py `libcuda_dirs`:
    the linker cache, then LD_LIBRARY_PATH), then where container runtimes and WSL put it."""
    dirs = []
    try:
        cache = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
        dirs = [os.path.dirname(line.split()[-1]) for line in cache.splitlines() if "libcuda.so.1" in line]
    except (OSError, subprocess.SubprocessError):
        pass
    dirs += os.environ.get("LD_LIBRARY_PATH", "").split(":")
    dirs += ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/local/nvidia/lib64",
             "/usr/lib/wsl/lib"]
    return [d for d in dict.fromkeys(dirs) if d and os.path.isfile(os.path.join(d, "libcuda.so.1"))]


def _point_triton_at_libcuda() -> None:
    """Triton links its launcher with `-lcuda`, which the linker resolves to libcuda.so only (not libcuda.so.1).
    Driver installs and the NVIDIA container toolkit put that symlink beside libcuda.so.1, but not every runtime
    does ("cannot find -lcuda"). So, unless TRITON_LIBCUDA_PATH is already set: point it at the directory holding
    both, or else at a private directory with a libcuda.so -> libcuda.so.1 symlink. The launcher still loads the
    driver by its soname, libcuda.so.1, at run time."""
    if os.environ.get("TRITON_LIBCUDA_PATH"):
        return
    dirs = _libcuda_dirs()
    if not dirs:
        return  # no driver library found: leave Triton to say so in its own words
    linked = next((d for d in dirs if os.path.exists(os.path.join(d, "libcuda.so"))), None)
    if linked is None:
        linked = tempfile.mkdtemp(prefix="llamascope-libcuda-")
        os.symlink(os.path.join(dirs[0], "libcuda.so.1"), os.path.join(linked, "libcuda.so"))
        log.info("no libcuda.so beside %s/libcuda.so.1: Triton links against a symlink in %s", dirs[0], linked)
    os.environ["TRITON_LIBCUDA_PATH"] = linked


if triton is not None:

    @triton.jit
    def _block_rows(block, offs_s, kh, K: tl.constexpr, E: tl.constexpr, ROW: tl.constexpr, BS: tl.constexpr):
        # (BS,) offsets of block `block`'s rows for KV head kh, and (an int8 cache's) of their scales, which follow
        # the block's bs * K rows of quants; an int8 cache's rows and scales are (head, position)-ordered, a float
        # cache's rows (ROW = E) (position, head)-ordered (kv_int8.py)
        base = block * (BS * K * ROW)
        if ROW == E:
            rows = base + (offs_s * K + kh) * E
        else:
            rows = base + (kh * BS + offs_s) * E
        return rows, base + BS * K * E + (kh * BS + offs_s) * 4

    @triton.jit
    def _row_scales(ptr, at, mask):
        # int8 rows' float32 scales at byte offsets `at` (BS,), assembled from their bytes (little-endian) and
        # reinterpreted: the pointer is an int8 one
        offs = tl.arange(0, 4)
        b = tl.load(ptr + at[:, None] + offs[None, :], mask=mask[:, None], other=0).to(tl.int32) & 0xFF
        return tl.sum(b << (8 * offs)[None, :], axis=1).to(tl.float32, bitcast=True)  # (BS,)

    @triton.jit
    def _merge(M, L, m, l):
        # two partial softmaxes (running max M, sum L; a partition's m, l) -> the merged max and each side's factor;
        # the same expressions in the one-program loop and the reduction, so both round alike (FlashDecoding)
        M2 = tl.maximum(M, m)
        a = tl.exp(M - M2)
        b = tl.exp(m - M2)
        return M2, L * a + l * b, a, b

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, rows_ptr, tables_ptr, lens_ptr, out_ptr,
        q_stride, W, scale, window,
        slot_ptr, sink_len_ptr, sink_ptr, top_pos_ptr, top_prob_ptr,
        part_m_ptr, part_l_ptr, part_acc_ptr, P,
        H: tl.constexpr, K: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, BS: tl.constexpr,
        TELEMETRY: tl.constexpr, TOP_K: tl.constexpr, TOP_PAD: tl.constexpr, ROW: tl.constexpr, INT8: tl.constexpr,
        PB: tl.constexpr, SPLIT: tl.constexpr,
    ):
        # The keys are taken in partitions of PB blocks: each partition's online softmax (m, l, acc) starts afresh,
        # and partitions are merged in order (`_merge`). SPLIT (a separate compilation): program (r, h, p) computes
        # partition p alone and writes its partial to part_* ((R, H, P), (R, H, P, E_PAD)); `_paged_decode_reduce`
        # merges them as the loop below does, so a row's output is the same split or not (flash-decoding, Dao et
        # al. 2023; vLLM's csrc/attention/attention_kernels.cu, paged_attention_v2_kernel + _reduce_kernel).
        # TELEMETRY (never split; a separate compilation: the plain kernel has none of it): the row's sink mass
        # rescaled along with the running sum, and its top-k scores merged block by block (softmax keeps the order
        # of the scores, so the top-k weights are the top-k scores' exp(s - M) / L once M and L are final).
        r = tl.program_id(0)
        h = tl.program_id(1)
        row = tl.load(rows_ptr + r)
        n = tl.load(lens_ptr + r)
        # a sliding window (Mistral): keys at positions < n - window are not attended, their blocks never read
        first = tl.where(window > 0, tl.maximum(n - window, 0), 0)
        b0, b1 = first // BS, tl.cdiv(n, BS)  # the row's blocks
        kh = h // (H // K)  # grouped-query attention: query head h reads KV head h / (H / K)
        offs_e = tl.arange(0, E_PAD)
        e_mask = offs_e < E
        q = tl.load(q_ptr + row * q_stride + h * E + offs_e, mask=e_mask, other=0.0).to(tl.float32) * scale  # (E,)
        offs_s = tl.arange(0, BS)
        M = tl.max(tl.full((BS,), float("-inf"), tl.float32), axis=0)  # merged max over the partitions so far
        L = tl.sum(tl.zeros((BS,), tl.float32), axis=0)  # merged sum of exp
        ACC = tl.zeros((E_PAD,), tl.float32)
        if TELEMETRY:
            j = tl.load(slot_ptr + r)
            n_sink = tl.load(sink_len_ptr + tl.maximum(j, 0))
            offs_t = tl.arange(0, TOP_PAD)
            best_v = tl.where(offs_t < TOP_K, float("-inf"), float("inf"))  # padding lanes are never displaced
            best_i = tl.full((TOP_PAD,), -1, tl.int32)
            SINK = tl.sum(tl.zeros((BS,), tl.float32), axis=0)
        if SPLIT:
            p0 = tl.program_id(2)
            p1 = p0 + 1
        else:
            p0 = b0 // PB
            p1 = tl.cdiv(b1, PB)
        for p in range(p0, p1):
            m_i = tl.max(tl.full((BS,), float("-inf"), tl.float32), axis=0)  # the partition's running max
            l_i = tl.sum(tl.zeros((BS,), tl.float32), axis=0)  # its running sum of exp
            acc = tl.zeros((E_PAD,), tl.float32)
            if TELEMETRY:
                sink_acc = tl.sum(tl.zeros((BS,), tl.float32), axis=0)
            for b in range(tl.maximum(p * PB, b0), tl.minimum(p * PB + PB, b1)):
                block = tl.load(tables_ptr + r * W + b)
                s_mask = (b * BS + offs_s < n) & (b * BS + offs_s >= first)
                kv, kv_scale = _block_rows(block, offs_s, kh, K, E, ROW, BS)  # (BS,) each
                mask = s_mask[:, None] & e_mask[None, :]
                k = tl.load(k_ptr + kv[:, None] + offs_e[None, :], mask=mask, other=0).to(tl.float32)  # (BS, E)
                dots = tl.sum(k * q[None, :], axis=1)  # (BS,)
                if INT8:  # the quants' dot product times the key's scale
                    dots = dots * _row_scales(k_ptr, kv_scale, s_mask)
                scores = tl.where(s_mask, dots, float("-inf"))  # (BS,)
                m_new = tl.maximum(m_i, tl.max(scores, axis=0))
                p_ = tl.exp(scores - m_new)
                alpha = tl.exp(m_i - m_new)
                v = tl.load(v_ptr + kv[:, None] + offs_e[None, :], mask=mask, other=0).to(tl.float32)  # (BS, E)
                pv = p_
                if INT8:  # a value's weight times its scale
                    pv = p_ * _row_scales(v_ptr, kv_scale, s_mask)
                acc = acc * alpha + tl.sum(pv[:, None] * v, axis=0)
                l_i = l_i * alpha + tl.sum(p_, axis=0)
                m_i = m_new
                if TELEMETRY:
                    sink_acc = sink_acc * alpha + tl.sum(tl.where(b * BS + offs_s < n_sink, p_, 0.0), axis=0)
                    cand = scores
                    for _ in tl.static_range(TOP_K):  # the block's best left, into the list if it beats the worst kept
                        cv = tl.max(cand, axis=0)
                        ci = tl.argmax(cand, axis=0, tie_break_left=True)
                        worst = tl.min(best_v, axis=0)
                        lane = tl.argmax(tl.where(best_v == worst, best_i, -2), axis=0, tie_break_left=True)  # latest
                        # strictly greater: an equal weight keeps the earlier key
                        lane = tl.where(cv > worst, lane, TOP_PAD)  # no lane when it does not beat the worst
                        best_v = tl.where(offs_t == lane, cv, best_v)
                        # int32 like best_i: b counts up to lens' int64, and compiled Triton (not its interpreter)
                        # refuses a loop-carried value that changes type
                        best_i = tl.where(offs_t == lane, (b * BS + ci).to(tl.int32), best_i)
                        cand = tl.where(offs_s == ci, float("-inf"), cand)
            if SPLIT:
                at = (r * H + h) * P + p0
                # a partition outside the row's keys is never read: not written either
                keep = (p0 >= b0 // PB) & (p0 < tl.cdiv(b1, PB))
                tl.store(part_m_ptr + at, m_i, mask=keep)
                tl.store(part_l_ptr + at, l_i, mask=keep)
                tl.store(part_acc_ptr + at * E_PAD + offs_e, acc, mask=tl.where(keep, offs_e, -1) >= 0)
            else:
                M, L, a, c = _merge(M, L, m_i, l_i)
                ACC = ACC * a + acc * c
                if TELEMETRY:
                    SINK = SINK * a + sink_acc * c
        if not SPLIT:
            out = ACC / L
            tl.store(out_ptr + (row * H + h) * E + offs_e, out.to(out_ptr.dtype.element_ty), mask=e_mask)
        if TELEMETRY:
            keep = j >= 0
            tl.store(sink_ptr + j * H + h, SINK / L, mask=keep)
            best_v = tl.where(offs_t < TOP_K, best_v, float("-inf"))
            base = (j * H + h) * TOP_K
            for t in tl.static_range(TOP_K):  # largest first, equal weights by key
                mv = tl.max(best_v, axis=0)
                lane = tl.argmin(tl.where(best_v == mv, best_i, 1 << 30), axis=0, tie_break_left=True)
                iv = tl.sum(tl.where(offs_t == lane, best_i, 0), axis=0)
                valid = mv > float("-inf")
                tl.store(top_prob_ptr + base + t, tl.where(valid, tl.exp(mv - M) / L, 0.0), mask=keep)
                tl.store(top_pos_ptr + base + t, tl.where(valid, iv, -1).to(tl.int64), mask=keep)
                best_v = tl.where(offs_t == lane, float("-inf"), best_v)
                best_i = tl.where(offs_t == lane, 1 << 30, best_i)

    @triton.jit
    def _paged_decode_reduce(
        rows_ptr, lens_ptr, out_ptr, window, part_m_ptr, part_l_ptr, part_acc_ptr, P,
        H: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, BS: tl.constexpr, PB: tl.constexpr,
    ):
        # One program per (decode row, query head): the row's partitions' partials merged in order, as the
        # one-program loop of `_paged_decode_kernel` merges them (vLLM's paged_attention_v2_reduce_kernel).
        r = tl.program_id(0)
        h = tl.program_id(1)
        row = tl.load(rows_ptr + r)
        n = tl.load(lens_ptr + r)
        first = tl.where(window > 0, tl.maximum(n - window, 0), 0)
        offs_e = tl.arange(0, E_PAD)
        M = tl.max(tl.full((16,), float("-inf"), tl.float32), axis=0)
        L = tl.sum(tl.zeros((16,), tl.float32), axis=0)
        ACC = tl.zeros((E_PAD,), tl.float32)
        for p in range(first // BS // PB, tl.cdiv(tl.cdiv(n, BS), PB)):
            at = (r * H + h) * P + p
            m = tl.load(part_m_ptr + at)
            l = tl.load(part_l_ptr + at)
            acc = tl.load(part_acc_ptr + at * E_PAD + offs_e)
            M, L, a, c = _merge(M, L, m, l)
            ACC = ACC * a + acc * c
        out = ACC / L
        tl.store(out_ptr + (row * H + h) * E + offs_e, out.to(out_ptr.dtype.element_ty), mask=offs_e < E)


if triton is not None:

    @triton.jit
    def _paged_prefill_kernel(
        q_ptr, k_ptr, v_ptr, tiles_ptr, tables_ptr, out_ptr, q_stride, W, scale,
        H: tl.constexpr, K: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, BS: tl.constexpr,
        BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr, ROW: tl.constexpr, INT8: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # DOT_PRECISION: how tensor cores take the float32 operands of `tl.dot`. Triton's default on Hopper and
        # Ampere is "tf32" (10 mantissa bits), which a float32 model's parity with the reference cannot afford,
        # while the interpreter multiplies exactly either way: the launcher says "ieee" for float32 queries, and
        # "tf32" for 16-bit ones, whose keys and values tf32 holds exactly (8 and 10 mantissa bits).
        # One program per (tile, query head): a tile is up to BLOCK_M consecutive rows of one chunk, at consecutive
        # positions from `first`; each row attends to the keys at positions up to its own (flash attention's online
        # softmax, per row, over the chunk's blocks in order).
        t = tl.program_id(0)
        h = tl.program_id(1)
        row0 = tl.load(tiles_ptr + t * 4)
        n_rows = tl.load(tiles_ptr + t * 4 + 1)
        c = tl.load(tiles_ptr + t * 4 + 2)
        first = tl.load(tiles_ptr + t * 4 + 3)
        kh = h // (H // K)
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < n_rows
        offs_e = tl.arange(0, E_PAD)
        e_mask = offs_e < E
        qmask = m_mask[:, None] & e_mask[None, :]
        q = tl.load(q_ptr + (row0 + offs_m)[:, None] * q_stride + h * E + offs_e[None, :], mask=qmask, other=0.0)
        q = q.to(tl.float32) * scale  # (M, E)
        pos = first + offs_m  # (M,) each row's position
        last = first + n_rows - 1
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, E_PAD), tl.float32)
        offs_s = tl.arange(0, BS)
        for b in range(0, last // BS + 1):
            block = tl.load(tables_ptr + c * W + b)
            key = b * BS + offs_s  # (BS,) the keys' positions
            kv, kv_scale = _block_rows(block, offs_s, kh, K, E, ROW, BS)
            kmask = (key <= last)[:, None] & e_mask[None, :]
            k = tl.load(k_ptr + kv[:, None] + offs_e[None, :], mask=kmask, other=0).to(tl.float32)  # (BS, E)
            if USE_DOT:
                scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (M, BS)
            else:
                scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
            if INT8:  # each key's column times its scale
                scores = scores * _row_scales(k_ptr, kv_scale, key <= last)[None, :]
            scores = tl.where(key[None, :] <= pos[:, None], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: every row's key 0 is in the first block
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + kv[:, None] + offs_e[None, :], mask=kmask, other=0).to(tl.float32)  # (BS, E)
            pv = p
            if INT8:  # (M, BS) the weights times their values' scales
                pv = p * _row_scales(v_ptr, kv_scale, key <= last)[None, :]
            if USE_DOT:
                acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PRECISION)
            else:
                acc = acc * alpha[:, None] + tl.sum(pv[:, :, None] * v[None, :, :], axis=1)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + ((row0 + offs_m)[:, None] * H + h) * E + offs_e[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=qmask)


PREFILL_TILE = 32  # query rows a tile (a program) of `paged_prefill_attention`


def prefill_tiles(chunks: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """A step's prefill chunks (first packed row, rows, first position), in table order -> the kernel's tiles
    (first packed row, rows, chunk index, first position), at most PREFILL_TILE rows each."""
    tiles = []
    for c, (row, n, first) in enumerate(chunks):
        for i in range(0, n, PREFILL_TILE):
            tiles.append((row + i, min(PREFILL_TILE, n - i), c, first + i))
    return tiles


def paged_prefill_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, tiles: Tensor, tables: Tensor,
                            out: Tensor, scale: float = 0.0) -> None:
    """q (N, H, E) packed rows (heads contiguous); pools (NB, bs, K, E) (E + 4: int8) already holding the chunks' keys
    and values; tiles (Tn, 4) int32 or int64 (`prefill_tiles`); tables (C, W) each chunk's blocks; writes the tiles'
    rows of out. `scale`: the attention scale (0: 1/sqrt(E)). Over an int8 cache the queries are first rounded as
    the native kernel rounds them (kv_int8.round_query)."""
    _check(q, k_pool, v_pool, out, "paged_prefill_attention")
    if tiles.shape[0] == 0:
        return
    if k_pool.dtype == torch.int8:
        q, scale = kv_int8.round_query(q, scale), 1.0
    (_, W), (_, H, E), (_, bs, K, row) = tables.shape, q.shape, k_pool.shape
    E_PAD = triton.next_power_of_2(E)
    _paged_prefill_kernel[(tiles.shape[0], H)](
        q, k_pool, v_pool, tiles, tables, out, q.stride(0), W, scale or 1.0 / math.sqrt(E),
        H=H, K=K, E=E, E_PAD=E_PAD, BS=bs, BLOCK_M=PREFILL_TILE, USE_DOT=bs >= 16 and E_PAD >= 16,
        ROW=row, INT8=k_pool.dtype == torch.int8, DOT_PRECISION=dot_precision(q.dtype),
    )


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input_precision for queries of `dtype` (the prefill kernel's DOT_PRECISION)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(q: Tensor, k_pool: Tensor, v_pool: Tensor, out: Tensor, who: str) -> None:
    E = q.shape[-1]
    if q.stride(-1) != 1 or q.stride(-2) != E or not (k_pool.is_contiguous() and v_pool.is_contiguous() and out.is_contiguous()):
        raise ValueError(f"{who}: heads of q, the pools and out must be contiguous")
    if k_pool.shape[-1] != kv_int8.row_width(E, k_pool.dtype) or v_pool.shape != k_pool.shape:
        raise ValueError(f"{who}: pools (NB, bs, K, {kv_int8.row_width(E, k_pool.dtype)}) for heads of {E}")


def paged_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, rows: Tensor, tables: Tensor, lens: Tensor,
                           out: Tensor, telemetry=None, window: int = 0, scale: float = 0.0,
                           split: bool | None = None) -> None:
    """`telemetry`: model/kernels/attention_telemetry.py's AttentionTelemetry for this call, or None. `window`: the
    model's sliding window (0: none); `scale`: the attention scale (0: 1/sqrt(E)). Over an int8 cache the queries are
    first rounded as the native kernel rounds them (kv_int8.round_query). `split`: `_launch`'s."""
    _check(q, k_pool, v_pool, out, "paged_decode_attention")
    if tables.shape[0] == 0:
        return
    if k_pool.dtype == torch.int8:
        q, scale = kv_int8.round_query(q, scale), 1.0
    _launch(q, k_pool, v_pool, rows, tables, lens, out, telemetry, window, scale, split)


PARTITION = 512  # keys a partition of the decode kernel (vLLM's PARTITION_SIZE in paged_attention_v2)
SPLIT_MAX_PROGRAMS = 512  # split the keys over programs when rows x heads are at most this (vLLM's v1 / v2 choice)


def partitions(bs: int, width: int) -> tuple[int, int]:
    """(blocks a partition, partitions a row of `width` blocks can have) for blocks of `bs` tokens."""
    pb = max(1, PARTITION // bs)
    return pb, -(-width // pb)


def split_kv(rows: int, heads: int, bs: int, width: int, telemetry: bool = False) -> bool:
    """Whether a decode launch of `rows` rows splits each row's keys over one program per partition, then reduces
    (flash-decoding): few rows leave most of a GPU's multiprocessors idle with one program per (row, head). Decided
    by shapes alone (the launch's rows and the tables' width, fixed within a CUDA graph); a row's output is the same
    either way (`_paged_decode_kernel`). Telemetry launches are never split."""
    return not telemetry and partitions(bs, width)[1] > 1 and rows * heads <= SPLIT_MAX_PROGRAMS


def _launch(q: Tensor, k_pool: Tensor, v_pool: Tensor, rows: Tensor, tables: Tensor, lens: Tensor, out: Tensor,
            telemetry=None, window: int = 0, scale: float = 0.0, split: bool | None = None) -> None:
    """`split`: force the split (True) or the one-program loop (False); None: `split_kv`'s choice."""
    (R, W), (_, H, E), (_, bs, K, row) = tables.shape, q.shape, k_pool.shape
    E_PAD = triton.next_power_of_2(E)
    pb, P = partitions(bs, W)
    if split is None:
        split = split_kv(R, H, bs, W, telemetry is not None)
    # without telemetry its pointers are never read (TELEMETRY is a compile-time switch): any tensor will do
    tel = telemetry if telemetry is not None else (lens,) * 5
    top_k = telemetry.top_pos.shape[-1] if telemetry is not None else 1
    scale = scale or 1.0 / math.sqrt(E)
    if split:  # (R, H, P) partial maxima and sums, (R, H, P, E_PAD) partial outputs
        part_m = torch.empty(R, H, P, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(R, H, P, E_PAD, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = lens  # never read
    _paged_decode_kernel[(R, H, P if split else 1)](
        q, k_pool, v_pool, rows, tables, lens, out,
        q.stride(0), W, scale, window, *tel, part_m, part_l, part_acc, P,
        H=H, K=K, E=E, E_PAD=E_PAD, BS=bs,
        TELEMETRY=telemetry is not None, TOP_K=top_k, TOP_PAD=triton.next_power_of_2(top_k),
        ROW=row, INT8=k_pool.dtype == torch.int8, PB=pb, SPLIT=bool(split),
    )
    if split:
        _paged_decode_reduce[(R, H)](rows, lens, out, window, part_m, part_l, part_acc, P,
                                     H=H, E=E, E_PAD=E_PAD, BS=bs, PB=pb)
