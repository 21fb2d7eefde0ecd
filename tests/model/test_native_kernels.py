"""model/kernels: each native op against the PyTorch math it replaces, the whole native decode step against the
module-by-module path, and the fall-back when the kernels are off or cannot be built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import kernels
from model.kernels import ops
from model.attention import sdpa
from model.engine import Engine, EngineConfig, SamplingParams
from model.quantize import (Int4Linear, Int6Linear, Int8Linear, int4_k_scales, int4_layout, int4_nibbles, int6_layout,
                            quantize_model, round_activations)
from model.transformer import RMSNorm, apply_rotary_tables, rotary_tables
from paged_pools import scattered_pools
from tiny import byte_tokenizer, greedy_tokens, tiny_model

native = kernels.native()
pytestmark = pytest.mark.skipif(native is None, reason=f"native kernels: {kernels.status()}")
DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, f32_tol: float = 1e-5) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=f32_tol, atol=f32_tol)
    else:  # rounding order differs from the torch chain by at most about one bfloat16 ulp
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 576, 67])  # 67: the scalar tail
def test_rms_norm(dtype, D):
    torch.manual_seed(0)
    norm = RMSNorm(D, 1e-5).to(dtype).requires_grad_(False)
    norm.weight.normal_(1, 0.3)
    x = (torch.randn(5, 3, D) * 4).to(dtype)
    with kernels.disabled():
        want = norm(x)
    got = native.rms_norm(x, norm.weight, 1e-5)
    assert got.dtype == dtype
    _close(got, want, dtype)
    _close(norm(x), want, dtype)  # and the module takes the native path itself


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("F_", [128, 1536, 13])
def test_silu_mul(dtype, F_):
    gu = (torch.randn(4, 2 * F_) * 5).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    _close(native.silu_mul(gu), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E", [64, 128, 12])  # 12: halves of 6, the scalar path
def test_rope_in_place(dtype, E):
    torch.manual_seed(1)
    B, T, H, K = 1, 7, 4, 2
    angles = torch.randn(B, T, E // 2) * 10
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = rotary_tables(emb.cos(), emb.sin(), dtype)  # (B, T, 1, E)
    qkv = torch.randn(B, T, H + 2 * K, E).to(dtype)
    want = torch.cat([apply_rotary_tables(qkv[:, :, : H + K], cos, sin), qkv[:, :, H + K :]], dim=2)
    got = qkv.clone()
    native.rope_(got, cos, sin, H + K)
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,K,E", [(6, 2, 64), (4, 1, 128), (3, 3, 64), (4, 2, 24)])  # GQA, MQA, MHA, odd E
@pytest.mark.parametrize("bs", [4, 6])  # a power of two (positions to blocks by shifts) and not (by division)
def test_paged_decode_attention_equals_sdpa_over_the_gathered_context(dtype, H, K, E, bs):
    lens = [1, 7, 16, 33, 100]
    k_pool, v_pool, tables, padded = scattered_pools(lens, bs, K, E, torch.Generator().manual_seed(0), 0, 3, dtype)
    N = len(lens) + 2  # two packed rows that are not decode rows: left as they were
    q = torch.randn(N, H, E).to(dtype)
    rows = [5, 0, 3, 1, 6]
    out = torch.full((N, H, E), 7.0, dtype=dtype)
    native.paged_decode_attention(q, k_pool, v_pool, torch.tensor(rows), padded, torch.tensor(lens), out)
    for r, n, table in zip(rows, lens, tables):
        kd = k_pool[table].reshape(1, -1, K, E)[:, :n]  # (1, n, K, E)
        vd = v_pool[table].reshape(1, -1, K, E)[:, :n]
        want = sdpa(q[r][None, None], kd, vd)[0, 0]  # (H, E)
        _close(out[r], want, dtype)
    assert (out[[2, 4]] == 7).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,K,E", [(6, 2, 64), (8, 2, 128), (3, 3, 64), (4, 2, 24)])
def test_prefill_rows_attend_in_tiles_bitwise_as_each_row_alone(dtype, H, K, E):
    """A prefill chunk's rows share one sequence's blocks: the kernel runs them in tiles of rows x the query heads of a
    KV head, one block of positions at a time. Every row's output, and the softmax its telemetry records, must be
    bitwise what the row gets alone (a decode step), whatever tile it lands in: chunks crossing the 8-key groups,
    the 64-position blocks and the 16-row tiles (3- and 2-query register tiles), beside another sequence's rows."""
    bs, n0, T = 16, 53, 21  # the chunk: positions 53..73, so lengths 54..74
    k_pool, v_pool, tables, padded = scattered_pools([n0 + T, 40], bs, K, E, torch.Generator().manual_seed(0), 0, 3,
                                                     dtype)
    table, other = padded.tolist()
    q = torch.randn(T + 3, H, E).to(dtype)
    rows = torch.tensor([T + 1, *range(T), T + 2])  # another sequence's rows around the chunk
    lens = torch.tensor([40, *range(n0 + 1, n0 + T + 1), 17])
    tabs = torch.tensor([other] + [table] * T + [other])
    tel_args = lambda R: (torch.arange(R), torch.full((R,), 2), torch.zeros(R, H), torch.zeros(R, H, 4, dtype=torch.long),
                          torch.zeros(R, H, 4))
    together = torch.zeros(T + 3, H, E, dtype=dtype)
    tel = tel_args(len(rows))
    native.paged_decode_attention_telemetry(q, k_pool, v_pool, rows, tabs, lens, together, *tel)
    for i in range(len(rows)):
        alone = torch.zeros(T + 3, H, E, dtype=dtype)
        one = tel_args(1)
        native.paged_decode_attention_telemetry(q, k_pool, v_pool, rows[i : i + 1], tabs[i : i + 1], lens[i : i + 1],
                                                alone, *one)
        assert torch.equal(together[rows[i]], alone[rows[i]]), i
        assert all(torch.equal(a[i], b[0]) for a, b in zip(tel[2:], one[2:])), i
    kd = k_pool[tables[0]].reshape(1, -1, K, E)
    vd = v_pool[tables[0]].reshape(1, -1, K, E)
    for t in range(T):
        want = sdpa(q[t][None, None], kd[:, : n0 + t + 1], vd[:, : n0 + t + 1])[0, 0]
        _close(together[t], want, dtype)


def test_paged_write_and_its_bounds():
    k_pool, v_pool = torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8)
    qkv = torch.randn(3, 6, 8)  # (N, H + 2K, E) with H = 2: k and v are strided views, as in the model
    k, v = qkv[:, 2:4], qkv[:, 4:6]
    slots = torch.tensor([5, 0, 7])
    native.paged_write(k, v, k_pool, v_pool, slots)
    assert torch.equal(k_pool.view(-1, 2, 8)[slots], k) and torch.equal(v_pool.view(-1, 2, 8)[slots], v)
    assert k_pool.view(-1, 2, 8)[[1, 2, 3, 4, 6]].abs().sum() == 0
    with pytest.raises(RuntimeError, match="slot out of range"):
        native.paged_write(k, v, k_pool, v_pool, torch.tensor([0, 1, 8]))


@pytest.mark.parametrize("cache", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("E", [16, 64])
def test_a_16_bit_cache_is_the_float32_cache_of_its_rounded_values(cache, E):
    """float32 rows written into a float16 / bfloat16 pool are rounded once (torch's rounding); attention over that
    pool, with telemetry, is bitwise attention over a float32 pool holding the same rounded values (widened exactly
    on load); a 16-bit cache under bfloat16 activations is refused."""
    torch.manual_seed(4)
    NB, bs, H, K = 12, 4, 6, 2
    k_pool, v_pool = torch.zeros(NB, bs, K, E, dtype=cache), torch.zeros(NB, bs, K, E, dtype=cache)
    qkv = torch.randn(40, H + 2 * K, E) * 3
    slots = torch.randperm(NB * bs)[:40]
    native.paged_write(qkv[:, H : H + K], qkv[:, H + K :], k_pool, v_pool, slots)
    assert torch.equal(k_pool.view(-1, K, E)[slots], qkv[:, H : H + K].to(cache))
    assert torch.equal(v_pool.view(-1, K, E)[slots], qkv[:, H + K :].to(cache))
    q = torch.randn(5, H, E)
    rows, lens = torch.tensor([0, 2, 4]), torch.tensor([33, 9, 48])
    tables = torch.stack([torch.randperm(NB)[:12] for _ in range(3)])
    outs = []
    for kp, vp in ((k_pool, v_pool), (k_pool.float(), v_pool.float())):
        out, tel = torch.zeros(5, H, E), [torch.tensor([0, -1, 1]), torch.tensor([1, 1]), torch.zeros(2, H),
                                          torch.zeros(2, H, 3, dtype=torch.long), torch.zeros(2, H, 3)]
        native.paged_decode_attention_telemetry(q, kp, vp, rows, tables, lens, out, *tel)
        outs.append((out, tel[2:]))
    assert torch.equal(outs[0][0], outs[1][0]) and all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))
    with pytest.raises(RuntimeError, match="float32 over a 16-bit or int8 cache"):
        native.paged_decode_attention(q.bfloat16(), k_pool.half(), v_pool.half(), rows, tables, lens, out.bfloat16())


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
@pytest.mark.parametrize("M", [1, 5, 16])
def test_quantized_kernels_compute_rounded_activations_times_the_dequantized_weight(cls, M):
    torch.manual_seed(2)
    layer = cls.from_float(torch.randn(160, 576) * 0.05)
    x = torch.randn(M, 576) * 3
    x[0, 5] = 400.0  # a massive activation: its block's other entries round to few levels, exactly as the reference
    got = getattr(native, layer.native_op)(x, *layer.native_buffers())
    want = F.linear(round_activations(x), layer.dequantize())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(layer(x), got, rtol=0, atol=0)  # the layer's own dispatch takes that kernel


# 12 and 13 groups of 8 outputs (int4 layers have whole pairs): pair tiles only, and an odd one left alone; 14
# groups are split between the threads as 4 + 4 + 4 + 2
@pytest.mark.parametrize("cls, N", [(Int8Linear, 96), (Int8Linear, 104), (Int4Linear, 96), (Int4Linear, 112)])
def test_quantized_kernels_give_each_row_bitwise_its_one_row_result(cls, N):
    """Tiles of 8, 4 and 1 rows (and 128-row chunks), one group of 8 outputs or (512-bit builds, 16 rows and more) a
    pair of groups, share loads, never arithmetic (csrc/qgemm.h): a row's outputs are the same floats whatever tile
    it falls in."""
    torch.manual_seed(4)
    layer = cls.from_float(torch.randn(N, 320) * 0.05)
    op, buffers = getattr(native, layer.native_op), layer.native_buffers()
    x = torch.randn(141, 320) * 2
    many = op(x, *buffers)
    for M in (1, 2, 3, 4, 7, 8, 13, 16, 17, 19, 141):
        assert torch.equal(op(x[:M], *buffers), many[:M])
    assert all(torch.equal(op(x[m : m + 1], *buffers)[0], many[m]) for m in range(x.shape[0]))


@pytest.mark.parametrize("dtype", DTYPES)
# K = 64: an LM head over a narrow model (the packed tiles); 67, 13: a k % 8 tail; 257, 576: too long to pack.
# N = 1000: whole groups of 16 (8 with AVX2) and a few outputs left in each thread's share; 37: about one group each
@pytest.mark.parametrize("K, N", [(64, 1000), (67, 1000), (13, 37), (256, 100), (257, 100), (576, 37)])
def test_float_linear_gives_each_row_bitwise_its_one_row_result(dtype, K, N):
    """Few rows take the 8-lane tiles with horizontal sums, many rows (and short K) the packed tiles that keep a lane
    of 8 or 16 outputs in a register (csrc/float_linear.cpp): the same multiply-adds in the same order, so a row's
    outputs are the same floats whatever the number of rows beside it, and close to PyTorch's GEMM."""
    torch.manual_seed(5)
    w, x = torch.randn(N, K).to(dtype), torch.randn(97, K).to(dtype)
    many = native.float_linear(x, w)
    _close(many, F.linear(x.float(), w.float()).to(dtype), dtype, f32_tol=1e-4)
    for M in (2, 15, 16, 17, 32, 50):
        assert torch.equal(native.float_linear(x[:M], w), many[:M])
    assert all(torch.equal(native.float_linear(x[m : m + 1], w)[0], many[m]) for m in range(x.shape[0]))


# K = 64: the packed tiles (from 16 rows); 67: a k % 8 tail; 576: the 8-lane tiles. N = 49,152: the default
# vocabulary, blocks of 1,024 columns claimed by the threads; 1,000, 37: a last block of a few columns.
@pytest.mark.parametrize("K, N", [(64, 49152), (67, 1000), (576, 1000), (64, 37)])
@pytest.mark.parametrize("M", [1, 3, 16, 33, 256])
def test_float_linear_argmax_is_argmax_rows_of_float_linear(K, N, M):
    """The greedy head's pick without the logits (csrc/float_linear.cpp) is argmax_rows of float_linear's logits:
    the same tiles give the same values; ties (two equal weight rows, far apart) go to the first column."""
    torch.manual_seed(K + N + M)
    w, x, u = torch.randn(N, K), torch.randn(M, K), torch.randn(K)
    w[N - 1] = w[N // 3] = 3 * u  # equal logits at columns N // 3 and N - 1, the largest in the even rows
    x[::2] += 3 * u
    picks = native.float_linear_argmax(x, w)
    assert torch.equal(picks, native.argmax_rows(native.float_linear(x, w)))
    assert (picks[::2] == N // 3).all()


def test_float_linear_argmax_answers_rows_that_are_not_finite_as_argmax_rows_does():
    torch.manual_seed(1)
    w, x = torch.randn(3000, 64), torch.randn(40, 64)
    x[3, 5] = float("nan")  # a whole row of NaN logits
    x[7, 0] = float("inf")  # +-inf logits, and NaN where a weight is 0
    w[2999, 0] = 0.0
    x[11] = 1e30  # sums that overflow
    x[12] = 0.0  # every logit 0 (and -0): index 0
    picks = native.float_linear_argmax(x, w)
    assert torch.equal(picks, native.argmax_rows(native.float_linear(x, w)))


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_native_dequantize_is_bitwise_the_pytorch_one(cls):
    layer = cls.from_float(torch.randn(48, 96))
    with kernels.disabled():
        want = layer.dequantize()
    assert torch.equal(layer.dequantize(), want)


def test_int6_kernel_rows_are_bitwise_their_one_row_result_and_match_the_reference():
    """GGUF Q6_K's own layout (qgemm.h's Int6): the kernel against rounded activations times the dequantized weight,
    each row bitwise its one-row result in any tile (13 groups of 8 outputs, 3 blocks of 256 weights), extreme
    q / sub-scales included (q 0 and 63, sc -128 and 127), and the native dequantization bitwise the PyTorch one."""
    torch.manual_seed(7)
    layer = Int6Linear.from_float(torch.randn(104, 768) * 0.05)
    q, sc, d = layer.unpacked()
    q[0, :64], q[1, :64], sc[0, :4], sc[1, :4] = 0, 63, -128, 127
    data, scales = int6_layout(q, sc, d)
    layer = Int6Linear.packed(data.contiguous(), scales.contiguous(), 104)
    x = torch.randn(141, 768) * 2
    x[0, 5] = 400.0
    many = native.int6_linear(x, *layer.native_buffers())
    want = F.linear(round_activations(x, 256), layer.dequantize())  # per 256, as ggml's q8_K (q6_tile)
    torch.testing.assert_close(many, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    for M in (1, 2, 3, 4, 7, 8, 13, 16, 17, 31, 32, 48, 141):
        assert torch.equal(native.int6_linear(x[:M], *layer.native_buffers()), many[:M])
    assert all(torch.equal(native.int6_linear(x[m : m + 1], *layer.native_buffers())[0], many[m]) for m in range(20))
    assert torch.equal(layer(x[:5]), many[:5])  # the layer's own dispatch takes that kernel
    with kernels.disabled():
        assert torch.equal(layer.dequantize(), native.int6_dequantize(*layer.native_buffers()))


def test_int4_q4_k_scales_are_exact_and_every_tile_agrees():
    """GGUF Q4_K's own scales (qgemm.h's K layout: d = D sc, m = -(Dmin mn) computed in float32): the dequantized
    weight is gguf.quants' (d sc) q - dmin m bit for bit, natively or not; the kernel matches rounded activations times
    it, each row bitwise its one-row result in any tile (on AMX builds from 32 rows: tiles of 32 and 16 rows, 14
    groups in pairs and, split over 2 threads, an odd one, the rows past the last tile of 16); joined with a symmetric
    layer, both keep their values (d sc rounded to float16 there)."""
    torch.manual_seed(8)
    N, K = 112, 768
    qs = torch.randint(0, 256, (N, K // 32, 16), dtype=torch.uint8)
    D, Dmin = (torch.rand(N, K // 256) * 0.01).half(), (torch.rand(N, K // 256) * 0.01).half()
    sc, mn = torch.randint(0, 64, (N, K // 32)), torch.randint(0, 64, (N, K // 32))
    sc[0], mn[1] = 63, 63
    layer = Int4Linear.packed(int4_nibbles(qs).contiguous().view(torch.uint8).reshape(N // 8, K // 32, 128),
                              int4_k_scales(D, Dmin, sc, mn))
    assert layer.k_scales and layer.decode_bytes * 8 / (N * K) == 4.625
    q = torch.stack([qs & 15, qs >> 4], dim=2).reshape(N, K // 32, 32).float()
    d = D.float().repeat_interleave(8, dim=1) * sc
    m = Dmin.float().repeat_interleave(8, dim=1) * mn
    want_w = (d[..., None] * q - m[..., None]).reshape(N, K)  # gguf.quants' Q4_K order of operations
    assert torch.equal(layer.dequantize(), want_w)
    with kernels.disabled():
        assert torch.equal(layer.dequantize(), want_w)
    x = torch.randn(141, K) * 2
    x[0, 5] = 400.0  # a massive activation: its 256 values' other entries round to few levels, as the reference's
    many = native.int4_linear(x, *layer.native_buffers())
    want = F.linear(round_activations(x, 256), want_w)  # per 256, as ggml's q8_K (csrc/quant_linear.cpp's q4k_tile)
    torch.testing.assert_close(many, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    for M in (1, 2, 3, 4, 7, 8, 13, 16, 17, 31, 32, 48, 141):
        assert torch.equal(native.int4_linear(x[:M], *layer.native_buffers()), many[:M])
    assert all(torch.equal(native.int4_linear(x[i : i + 1], *layer.native_buffers())[0], many[i]) for i in (*range(20), 140))
    other = Int4Linear.from_float(torch.randn(16, K))
    joined = Int4Linear.cat([layer, other])
    assert not joined.k_scales and torch.equal(joined.dequantize()[N:], other.dequantize())
    assert (joined.dequantize()[:N] - want_w).abs().max() <= 2.0**-10 * want_w.abs().max()


def test_int4_q4_0_offsets_and_rounding_ties():
    """Q4_0's m = -8 d, and activations exactly halfway between two int8 steps (ties round to even)."""
    q = torch.randint(0, 16, (16, 64))
    d = torch.rand(16, 2) * 0.1 + 0.01
    layer = Int4Linear(q, d, -8 * d)
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 0.5, 2.5  # d_x = 1: 0.5 and 2.5 are ties
    got = getattr(native, layer.native_op)(x, *layer.native_buffers())
    want = F.linear(round_activations(x), layer.dequantize())
    assert round_activations(x)[0, 1] == 0 and round_activations(x)[0, 2] == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_int4_symmetric_layout_is_bitwise_the_one_holding_m():
    """Q4_0 served as the file holds it, d alone (`int4_layout` with m None; the kernels take m = -8 d): every output
    the same float as the layout that stores m = float16(-8 d), in tiles of any size, dequantized natively or not,
    and joined with a layer that keeps its m."""
    torch.manual_seed(6)
    q = torch.randint(0, 16, (32, 320), dtype=torch.uint8).view(32, 10, 2, 16)
    d = (torch.rand(32, 10) * 0.1 + 0.001).half().float()
    full = Int4Linear(q.reshape(32, 320), d, -8 * d)
    nibbles, scales = int4_layout(q[:, :, 0] | (q[:, :, 1] << 4), d, None)  # views: (4, 10, 4, 8) int32, (4, 10, 1, 8)
    sym = Int4Linear.packed(nibbles.reshape(4, 10, 32).view(torch.uint8), scales.contiguous())
    assert sym.symmetric and not full.symmetric and sym.scales.nbytes * 2 == full.scales.nbytes
    assert torch.equal(sym.asymmetric_scales(), full.scales)
    x = torch.randn(141, 320) * 2
    for M in (1, 3, 8, 141):
        assert torch.equal(native.int4_linear(x[:M], *sym.native_buffers()), native.int4_linear(x[:M], *full.native_buffers()))
    assert torch.equal(sym.dequantize(), full.dequantize())
    with kernels.disabled():
        assert torch.equal(sym.dequantize(), full.dequantize()) and torch.equal(sym(x[:5]), full(x[:5]))
    other = Int4Linear.from_float(torch.randn(16, 320))
    assert torch.equal(Int4Linear.cat([sym, other]).dequantize(), torch.cat([full.dequantize(), other.dequantize()]))


# ---- the native decode step ----------------------------------------------------------------------------------


def _decode_run(model, native_step: bool, ks=(1, 3, 7)):
    """The prompts' greedy tokens with every logprob, and the steps per execution path."""
    engine = Engine(model, byte_tokenizer(), EngineConfig(num_blocks=64, block_size=4, native_step=native_step))
    prompts = [[5, 9, 2, 7, 1] * k for k in ks]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got: dict[str, list] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += [(t, lp.logprob, lp.top) for t, lp in zip(o.token_ids, o.logprobs)]
    return got, engine.stats().steps_by_path


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_decode_step_equals_the_module_path(mode, dtype):
    """`step_layers` composes the very functions the modules' ops call: bitwise the same logprobs, the same greedy
    tokens, for prefill steps as for decode steps (every row attends over the paged pool)."""
    model = quantize_model(tiny_model(dtype=dtype), mode)
    fast, fast_paths = _decode_run(model, native_step=True)
    slow, slow_paths = _decode_run(model, native_step=False)
    assert fast_paths["native"] >= 6 and fast_paths["module"] == 0  # the prefill step too
    assert slow_paths["native"] == 0 and slow_paths["module"] >= 6
    assert fast == slow
    prompts = [[5, 9, 2, 7, 1] * k for k in (1, 3, 7)]
    together = greedy_tokens(model, prompts)
    assert together == [greedy_tokens(model, [p])[0] for p in prompts]  # batched == one at a time


@pytest.mark.parametrize("ks", [(2,), (1, 2, 3, 4), (1, 2, 3, 4, 5)])
@pytest.mark.parametrize("mode", ["none", "int4"])
def test_few_and_many_row_steps_equal_the_module_path(mode, ks):
    """Decode steps of 1 and 4 rows take step_layers' few-row path (every thread computes the row-wise ops
    itself, 5 barriers a block), 5 rows the shared one: both bitwise the module path, on 2 threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = quantize_model(tiny_model(), mode)
        assert _decode_run(model, True, ks)[0] == _decode_run(model, False, ks)[0]
    finally:
        torch.set_num_threads(threads)


def test_greedy_pick_is_torch_argmax_of_nan_to_num_and_answers_every_row():
    torch.manual_seed(0)
    for V in (49152, 101, 7):  # 101, 7: the scalar tails
        x = torch.randn(8, V)
        x[1, V // 3] = x[1, V - 1] = 50.0  # a tie: the first index
        x[2, V - 1] = 60.0  # in the tail
        x[3, V // 2] = float("nan")  # a NaN: the largest number wins
        x[4] = float("-inf")  # nothing finite: index 0
        x[5, 0] = float("inf")
        x[6, 1:] = float("-inf")  # NaN below -inf (nan_to_num's ordering)
        x[6, 0] = float("nan")
        x[7] = float("nan")
        want = x.nan_to_num(nan=float("-inf")).argmax(dim=-1)
        assert want[:7].tolist() == [x[0].argmax().item(), V // 3, V - 1, x[3].nan_to_num(nan=-1e9).argmax().item(),
                                     0, 0, 1]
        assert native.argmax_rows(x).tolist() == want.tolist()
        with kernels.disabled():
            assert ops.greedy_pick(x).tolist() == want.tolist()
    zeros = torch.zeros(1, 64)
    zeros[0, 5] = -0.0
    assert native.argmax_rows(zeros).tolist() == [0]


def test_native_and_pytorch_paths_agree_on_greedy_tokens():
    model = tiny_model()
    prompts = [[5, 9, 2, 7, 1] * k for k in (1, 3, 7)]
    fast = greedy_tokens(model, prompts, n=16)
    with kernels.disabled():
        assert greedy_tokens(model, prompts, n=16) == fast


# ---- off, or unavailable -------------------------------------------------------------------------------------


def test_off_and_unavailable_fall_back_to_pytorch(monkeypatch):
    with kernels.disabled():
        assert kernels.native() is None and kernels.status() == "off" and kernels.built_for() is None
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "load", lambda *a: (_ for _ in ()).throw(OSError("no C++ compiler")))
    assert kernels.native() is None
    assert kernels.status() == "unavailable: OSError: no C++ compiler"
    model = tiny_model()
    assert greedy_tokens(model, [[1, 2, 3]], n=3)  # serves on the PyTorch ops


def test_env_var_turns_the_kernels_off(tmp_path):
    import subprocess
    import sys

    code = "from model import kernels; print(kernels.status())"
    env = {**__import__("os").environ, "LLAMASCOPE_NATIVE_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "off"


def test_a_stale_build_lock_is_cleared(tmp_path, monkeypatch):
    """A build killed mid-way leaves its lock file, which later builds would wait on."""
    import os
    import time

    from model.kernels import extension

    monkeypatch.setenv("LLAMASCOPE_KERNELS_DIR", str(tmp_path))
    lock = tmp_path / kernels.module_name() / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    seen = []
    monkeypatch.setattr(extension, "load", lambda **kw: seen.append((kw["name"], lock.exists())) or "built")
    assert kernels.build() == "built" and seen == [(kernels.module_name(), False)]
    lock.touch()  # a fresh lock is another build in progress: left alone
    kernels.build()
    assert seen[-1] == (kernels.module_name(), True)


def test_an_edit_to_one_kernel_file_recompiles_that_file_alone(tmp_path, monkeypatch):
    """extension.load keeps each object under a name of what made it: a build of other sources compiles only the
    files that changed (a header: every file), and one of other flags every kernel file but not the bindings."""
    import shutil

    from model.kernels import extension

    csrc = tmp_path / "csrc"
    shutil.copytree(kernels.CSRC, csrc)
    compiled = []

    def compile_(source, command, obj, verbose=False):
        compiled.append(source.name)
        obj.write_bytes(b"")
        return 0.0

    monkeypatch.setattr(extension, "_compile", compile_)
    monkeypatch.setattr(extension, "_link", lambda objects, so: so.write_bytes(b""))
    monkeypatch.setattr(kernels, "import_built", lambda path: path)

    def build(name, flags):
        compiled.clear()
        extension.load(name=name, kernels=[csrc / s for s in kernels.SOURCES], bindings=csrc / kernels.BINDINGS,
                       entry=csrc / kernels.ENTRY, extra_cflags=flags, base_cflags=["-O3"],
                       build_directory=str(tmp_path / name), objects=tmp_path / "objects")
        return sorted(compiled)

    everything = sorted([*kernels.SOURCES, kernels.BINDINGS, kernels.ENTRY])
    assert build("a", ["-O3", "-mavx2"]) == everything
    assert build("b", ["-O3", "-mavx2"]) == [kernels.ENTRY]  # the same sources: every object kept
    (csrc / "lora.cpp").write_text((csrc / "lora.cpp").read_text() + "\n// an edit\n")
    assert build("c", ["-O3", "-mavx2"]) == sorted(["lora.cpp", kernels.ENTRY])
    assert build("d", ["-O3"]) == sorted([*kernels.SOURCES, kernels.ENTRY])  # another build's flags: not the bindings
    (csrc / "simd.h").write_text((csrc / "simd.h").read_text() + "\n// an edit\n")
    assert build("e", ["-O3"]) == everything
    assert not (tmp_path / "e" / "lock").exists()


def test_a_build_records_what_it_asks_of_a_cpu():
    """build.json beside the build: its sources, torch and flags, what compatible_build matches another CPU against."""
    import json

    record = json.loads((kernels.build_dir() / kernels.module_name() / "build.json").read_text())
    assert record == {"sources": kernels.sources_hash(), "torch": torch.__version__,
                      "flags": kernels.compile_flags(kernels.cpu_has_avx2())}
    assert all(f in kernels.FLAG_FEATURES for f in record["flags"] if f.startswith("-m"))


def test_without_its_own_build_a_cpu_loads_the_richest_build_it_can_run(tmp_path, monkeypatch, caplog):
    """An image holds the builds of the CPU it was built on and a portable AVX2 one (python -m model.kernels
    --portable); on another CPU, with no compiler to build its own, it loads the build with the most features that
    CPU has, of the same sources and torch."""
    import json
    import logging

    monkeypatch.setenv("LLAMASCOPE_KERNELS_DIR", str(tmp_path))
    base = kernels.compile_flags(True, [])
    builds = {  # name -> (flags, sources, torch)
        "portable": (base, kernels.sources_hash(), torch.__version__),
        "alder": (base + ["-mavxvnni"], kernels.sources_hash(), torch.__version__),
        "zen4": (base + ["-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256", "-mavx512bw"],
                 kernels.sources_hash(), torch.__version__),
        "alder-old": (base + ["-mavxvnni", "-mf16c"], "0" * 64, torch.__version__),  # other sources
        "alder-torch": (base + ["-mavxvnni", "-mfma"], kernels.sources_hash(), "0.0"),  # another torch
        "alder-odd": (base + ["-mavxvnni", "-mavx10.2"], kernels.sources_hash(), torch.__version__),  # a flag unknown here
    }
    for name, (flags, sources, version) in builds.items():
        d = tmp_path / f"llamascope_kernels_avx2_{name}"
        d.mkdir()
        (d / f"{d.name}.so").touch()
        (d / "build.json").write_text(json.dumps({"sources": sources, "torch": version, "flags": flags}))
    (tmp_path / "llamascope_kernels_avx2_nothing").mkdir()  # a build killed before its record
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx_vnni"})
    assert kernels.compatible_build().parent.name == "llamascope_kernels_avx2_alder"
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512_vnni", "avx512vl", "avx512bw"})
    assert kernels.compatible_build().parent.name == "llamascope_kernels_avx2_zen4"
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512_vnni", "avx512vl"})
    assert kernels.compatible_build().parent.name == "llamascope_kernels_avx2_portable"
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma"})  # no F16C: none of them
    assert kernels.compatible_build() is None

    # load(): its own build missing and none can be made -> the compatible one, said in the log
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx_vnni", "avx512_vnni", "avx512vl"})
    monkeypatch.setattr(kernels, "build", lambda **kw: (_ for _ in ()).throw(OSError("no C++ compiler")))
    monkeypatch.setattr(kernels, "import_built", lambda path: path)
    with caplog.at_level(logging.WARNING, logger="model.kernels"):
        assert kernels.load().parent.name == "llamascope_kernels_avx2_alder"
    assert "no C++ compiler" in caplog.text and "llamascope_kernels_avx2_alder" in caplog.text
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma"})
    with pytest.raises(OSError, match=r"no C\+\+ compiler"):  # nothing it can run: the build's own error
        kernels.load()


@pytest.mark.parametrize("flags, want", [
    ({"avx2", "fma", "f16c"}, []),  # its own build is the AVX2 one
    ({"avx2", "fma", "f16c", "avx_vnni"}, [[]]),
    ({"avx2", "fma", "f16c", "avx512_vnni", "avx512vl", "avx512bw"}, [[]]),  # Zen 4: its own is the AVX-512 one
    ({"avx2", "fma", "f16c", "avx_vnni", "avx512_vnni", "avx512vl", "avx512bw"},  # Zen 5
     [[], ["-mavxvnni"], ["-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256", "-mavx512bw"]]),
    ({"avx2", "fma", "f16c", "avx_vnni", "avx512_vnni", "avx512vl", "avx512bw", "amx_tile", "amx_int8"},  # SPR
     [[], ["-mavxvnni"], ["-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256", "-mavx512bw"]]),
])
def test_an_image_carries_the_portable_builds_its_machine_can_check(monkeypatch, flags, want):
    """`--portable` builds, besides the machine's own, each PORTABLE build it differs from and can run: an image
    built on a Sapphire Rapids host serves a Zen 4 one on AVX-512 VNNI and an Alder Lake one on AVX-VNNI, not on
    AVX2 alone."""
    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    assert kernels.portable_builds() == want
    # install (`--tested`) makes only those the tests load: the AVX-512 one is for images
    assert kernels.portable_builds(tested_only=True) == [v for v in want if v in ([], ["-mavxvnni"])]


@pytest.mark.parametrize("flags, want", [
    ({"avx2", "avx_vnni"}, ["-mavxvnni"]),  # Alder Lake
    ({"avx2", "avx_vnni", "avx512_vnni", "avx512vl", "avx512bw"},  # Zen 5, Sapphire Rapids: the VEX form used first
     ["-mavxvnni", "-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256", "-mavx512bw"]),
    ({"avx2", "avx512_vnni", "avx512vl"}, ["-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256"]),
    ({"avx2", "avx512_vnni", "avx512vl", "avx512bw"},  # Zen 4, Ice Lake server: and the 512-bit pair tiles
     ["-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256", "-mavx512bw"]),
    ({"avx2", "avx512_vnni", "avx512vl", "avx512bw", "amx_tile", "amx_int8"},  # and AMX-INT8 tiles beside them
     ["-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256", "-mavx512bw", "-mamx-tile", "-mamx-int8"]),
    ({"avx2", "avx512_vnni", "avx512vl", "amx_tile", "amx_int8"},  # AMX only beside the 512-bit tiles
     ["-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256"]),
    ({"avx2", "avx512_vnni"}, []),  # no 256-bit EVEX form without AVX512-VL
    ({"avx2"}, []),
])
def test_vnni_flags_follow_the_cpu(monkeypatch, flags, want):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    assert kernels.vnni_flags() == want


def test_the_build_uses_vnni_where_the_cpu_has_it():
    """The flags reach the source: simd.h turns `vpdpbusd` on for either encoding the build was given, and the
    512-bit pair tiles on where it was given AVX512-VNNI and -BW."""
    flags = kernels.loaded_vnni_flags()  # (none for the portable build)
    assert bool(native.vnni) == (kernels.cpu_has_avx2() and bool(flags))
    assert bool(native.zmm) == (kernels.cpu_has_avx2() and {"-mavx512vnni", "-mavx512bw"} <= set(flags))
    assert bool(native.amx) == (kernels.cpu_has_avx2() and "-mamx-int8" in flags)
    # a CPU with AMX runs a kernel that grants it (Linux 5.16 on), also beside pytest's faulthandler stack
    assert native.amx_permitted() == bool(native.amx)


@pytest.mark.parametrize("flags, want", [
    (kernels.PORTABLE[0], "avx2"), (kernels.PORTABLE[1], "avx2+avx-vnni"), (kernels.PORTABLE[2], "avx512-vnni"),
    (["-mavxvnni", "-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256", "-mavx512bw", "-mamx-tile",
      "-mamx-int8"], "avx512-vnni+amx"),  # a Sapphire Rapids' own: the EVEX form and AMX name it
])
def test_a_build_names_the_instruction_set_it_is_for(flags, want):
    assert kernels.instruction_set(flags) == want


def test_the_loaded_build_says_what_it_was_built_for():
    """/v1/models and the load line say the instruction set of the build that runs, from its own record (build.json):
    the one the flags it was compiled with name, and what the module says it has (VNNI, AMX)."""
    isa = kernels.built_for()
    assert isa == kernels.instruction_set(kernels.loaded_vnni_flags())
    assert ("vnni" in isa) == bool(native.vnni) and isa.endswith("+amx") == bool(native.amx)


@pytest.mark.parametrize("block", [32, 256])
def test_native_activation_rounding_is_bitwise_the_pytorch_one(block):
    """The kernels' int8 rounding of activations per 32 (q8_0) and per 256 (q8_K, Q4_K's layers), a K that is not a
    whole number of 256s included (its last 64 values take their own scale), ties and a massive activation."""
    torch.manual_seed(3)
    x = torch.randn(9, 832) * 2
    x[0, 5], x[1, 0], x[1, 1] = 400.0, 127.0, 0.5
    assert torch.equal(native.round_activations(x, block), round_activations(x, block))
