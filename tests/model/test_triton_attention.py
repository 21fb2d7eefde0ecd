"""The CUDA decode-attention kernel (model/kernels/triton_attention.py) on CPU, through Triton's interpreter: in a
subprocess, because TRITON_INTERPRET must be set before triton is imported (tests/triton_interpret_check.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton (a test dependency, shipped with PyTorch's CUDA builds) is not installed")


def test_triton_paged_decode_attention_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = Path(__file__).parents[1] / "triton_interpret_check.py"
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Triton path == gather path" in r.stdout
    assert "prefill tiles on cpu: Triton == SDPA" in r.stdout
    assert "fused elementwise on cpu: Triton == PyTorch's chains" in r.stdout
    assert "Triton's TELEMETRY variant == the reference" in r.stdout
    assert "kv_window engine with telemetry: Triton path == gather path" in r.stdout
    assert "families on the Triton path == gather path == the uncached forward" in r.stdout
    assert "kernel vs SDPA, window 11" in r.stdout
    assert "int8 cache on cpu: Triton == SDPA over the dequantized pools" in r.stdout
    assert "int8 cache engine tokens: Triton path == gather path, batched == alone" in r.stdout
    assert "split-KV decode at 32768 positions" in r.stdout and "split-KV decode at 8192 positions, window" in r.stdout


def _fresh(monkeypatch):
    """triton_attention with no launch checked yet, and CPU tensors eligible (as under the interpreter)."""
    from model.kernels import triton_attention as ta

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ta, "_checked", {})
    return ta


def test_a_failing_first_launch_falls_back_to_gather_with_one_log_line(monkeypatch, caplog):
    """What PyTorch's CUDA runtime image did on the first decode step (no C compiler for Triton's launcher): now the
    one-off launch in `available` meets it, logs once, and the gather + SDPA path serves."""
    import torch

    from model import kernels
    from model.kernels import ops

    ta = _fresh(monkeypatch)
    launches = []

    def no_compiler(*args):
        launches.append(args)
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    monkeypatch.setattr(ta, "_launch", no_compiler)
    q, pool = torch.zeros(3, 4, 16), torch.zeros(8, 16, 2, 16)  # (N, H, E), (NB, bs, K, E)
    with caplog.at_level(logging.INFO, logger=ta.__name__):
        assert not ta.available(q, 16)
        assert not ta.available(q, 16)  # once per process, device and dtype: no second launch, no second line
        with kernels.disabled():  # the engine's choice (native CPU kernel off): no in-place kernel, so gather + SDPA
            assert ops.decode_attention_backend(q, pool) == "torch"
    assert len(launches) == 1
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "failed its first launch" in record.message and "Failed to find C compiler" in record.message
    assert record.message.endswith("decode attention uses gather + SDPA")
    assert not ta.available(q.bfloat16(), 16) and len(launches) == 2  # another dtype: its own launch


def test_a_first_launch_with_wrong_numbers_falls_back(monkeypatch, caplog):
    ta = _fresh(monkeypatch)
    monkeypatch.setattr(ta, "_launch", lambda *args: None)  # "runs", writes nothing: out stays zeros
    import torch

    with caplog.at_level(logging.WARNING, logger=ta.__name__):
        assert not ta.available(torch.zeros(1, 2, 16), 16)
    assert "differs from SDPA" in caplog.records[0].message


def test_triton_is_pointed_at_a_linkable_libcuda(tmp_path, monkeypatch):
    """Triton links its launcher with -lcuda: it needs libcuda.so, not just the driver's libcuda.so.1."""
    from model.kernels import triton_attention as ta

    driver = tmp_path / "driver"
    driver.mkdir()
    (driver / "libcuda.so.1").write_bytes(b"")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(driver))
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", "")
    assert str(driver) in ta._libcuda_dirs()  # found as Triton finds it (the linker cache, then LD_LIBRARY_PATH)
    monkeypatch.setattr(ta, "_libcuda_dirs", lambda: [str(driver)])
    ta._point_triton_at_libcuda()  # only libcuda.so.1 there: a private directory with the symlink
    link = Path(os.environ["TRITON_LIBCUDA_PATH"]) / "libcuda.so"
    assert link.is_symlink() and os.readlink(link) == str(driver / "libcuda.so.1")
    (driver / "libcuda.so").symlink_to("libcuda.so.1")  # as driver installs and the NVIDIA container toolkit do
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", "")
    ta._point_triton_at_libcuda()
    assert os.environ["TRITON_LIBCUDA_PATH"] == str(driver)
    ta._point_triton_at_libcuda()  # set already (by the user or before): left alone
    assert os.environ["TRITON_LIBCUDA_PATH"] == str(driver)


def test_an_unwritable_triton_cache_moves_to_a_private_directory_with_a_log_line(tmp_path, monkeypatch, caplog):
    """Under an arbitrary UID the default ~/.triton/cache is often not writable, and Triton's first compile fails:
    the cache moves to a temporary directory, says so, and is counted (the engine's fallbacks); a writable one
    stays. (A path under a file is unwritable even to root.)"""
    ta = _fresh(monkeypatch)
    monkeypatch.setattr(ta, "FALLBACKS", {"triton_cache": 0})
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with caplog.at_level(logging.WARNING, logger=ta.__name__):
        ta.ensure_cache_dir()
    moved = os.environ["TRITON_CACHE_DIR"]
    assert moved != str(tmp_path / "file" / "cache") and os.access(moved, os.W_OK)
    assert "is not writable" in caplog.text and ta.FALLBACKS == {"triton_cache": 1}
    from model.kernels import ops

    assert ops.triton_fallbacks() == {"triton_cache": 1}
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "ok"))
    ta.ensure_cache_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "ok") and ta.FALLBACKS == {"triton_cache": 1}


@pytest.mark.parametrize("dtype,cache", [("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"), ("bf16", "i8"),
                                         ("fp32", "i8")])
@pytest.mark.parametrize("telemetry,split", [(False, False), (True, False), (False, True)])
def test_the_kernel_compiles_for_hopper(dtype, cache, telemetry, split):
    """Compiled ahead of time for sm_90 (Triton's own ptxas, no GPU needed): the interpreter above runs the kernel
    but does not type-check it, and an H200 run found the TELEMETRY variant refused at compile time (a loop-carried
    int32 re-assigned an int64). Over an int8 cache too (rows of E + 4: the quants, then the scale's bytes)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from model.kernels.triton_attention import _paged_decode_kernel as kernel

    names = list(inspect.signature(kernel.fn).parameters)
    ptrs = dict(q_ptr=f"*{dtype}", k_ptr=f"*{cache}", v_ptr=f"*{cache}", out_ptr=f"*{dtype}", rows_ptr="*i64",
                tables_ptr="*i64", lens_ptr="*i64", q_stride="i32", W="i32", scale="fp32", window="i32", slot_ptr="*i64",
                sink_len_ptr="*i64", sink_ptr="*fp32", top_pos_ptr="*i64", top_prob_ptr="*fp32", part_m_ptr="*fp32",
                part_l_ptr="*fp32", part_acc_ptr="*fp32", P="i32")
    consts = dict(H=8, K=2, E=64, E_PAD=64, BS=16, TELEMETRY=telemetry, TOP_K=5, TOP_PAD=8,
                  ROW=68 if cache == "i8" else 64, INT8=cache == "i8", PB=32, SPLIT=split)
    signature = {n: ptrs.get(n, "constexpr") for n in names}
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]


def test_the_split_kv_reduction_compiles_for_hopper():
    """The split-KV decode's reduction (`_paged_decode_reduce`), ahead of time for sm_90."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from model.kernels.triton_attention import _paged_decode_reduce as kernel

    names = list(inspect.signature(kernel.fn).parameters)
    types = dict(rows_ptr="*i64", lens_ptr="*i64", out_ptr="*bf16", window="i32", part_m_ptr="*fp32",
                 part_l_ptr="*fp32", part_acc_ptr="*fp32", P="i32")
    consts = dict(H=8, E=64, E_PAD=64, BS=16, PB=32)
    signature = {n: types.get(n, "constexpr") for n in names}
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


@pytest.mark.parametrize("dtype,cache", [("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "i8"), ("fp32", "fp32"),
                                         ("fp32", "i8")])
@pytest.mark.parametrize("use_dot", [False, True])
def test_the_prefill_kernel_compiles_for_hopper(dtype, cache, use_dot):
    """The prefill tiles' kernel likewise (the tensor-core `tl.dot` variant is what a 16-token block runs). Under
    float32 queries its products are IEEE float32 on the device as in the interpreter: Triton's default for a
    float32 `tl.dot` on sm_80+ is TF32 (10 mantissa bits), which would lose float32 parity on the GPU alone; so
    no TF32 instruction may appear in the float32 build, and the 16-bit builds keep theirs."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from model.kernels.triton_attention import PREFILL_TILE, _paged_prefill_kernel as kernel, dot_precision

    names = list(inspect.signature(kernel.fn).parameters)
    ptrs = dict(q_ptr=f"*{dtype}", k_ptr=f"*{cache}", v_ptr=f"*{cache}", out_ptr=f"*{dtype}", tiles_ptr="*i64",
                tables_ptr="*i64", q_stride="i32", W="i32", scale="fp32")
    precision = dot_precision(torch.float32 if dtype == "fp32" else torch.bfloat16)
    consts = dict(H=8, K=2, E=128, E_PAD=128, BS=16, BLOCK_M=PREFILL_TILE, USE_DOT=use_dot,
                  ROW=132 if cache == "i8" else 128, INT8=cache == "i8", DOT_PRECISION=precision)
    signature = {n: ptrs.get(n, "constexpr") for n in names}
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]
    tf32 = "tf32" in compiled.asm["ptx"]
    assert tf32 == (use_dot and dtype != "fp32"), "float32 dots must be IEEE; 16-bit ones keep the tensor cores"


@pytest.mark.parametrize("name", ["_rms_norm_kernel", "_silu_mul_kernel", "_rope_kernel"])
def test_the_elementwise_kernels_compile_for_hopper(name):
    """model/kernels/triton_elementwise.py's kernels, compiled ahead of time for sm_90 in bfloat16."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from model.kernels import triton_elementwise

    kernel = getattr(triton_elementwise, name)
    names = list(inspect.signature(kernel.fn).parameters)
    types = {n: ("*bf16" if n.endswith("_ptr") else "fp32" if n == "eps" else "i32") for n in names}
    consts = {"BLOCK": 128, "HALF": 64}
    signature = {n: ("constexpr" if n in consts else types[n]) for n in names}
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(n),): v for n, v in consts.items() if n in names})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]
