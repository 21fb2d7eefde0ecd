"""The int8 KV cache's blocks (model/kernels/kv_int8.py) and the native kernels over them: the native writer stores the
PyTorch quantization's bytes; attention over an int8 pool is SDPA over its dequantized values; a prefill chunk's
rows give bitwise what each row gets alone (tiles, widened blocks, telemetry); the context shift re-rotates int8
keys."""

from __future__ import annotations

import pytest
import torch

from model import kernels
from model.attention import sdpa
from model.kernels import kv_int8, ops
from paged_pools import scattered_pools

native = kernels.native()
needs_native = pytest.mark.skipif(native is None, reason=f"native kernels: {kernels.status()}")


def _rows(N: int, K: int, E: int, seed: int = 0) -> torch.Tensor:
    """(N, K, E) float32 with what a writer must get right: a zero row (scale 0), a massive entry (it alone sets its
    row's scale), a negative extreme."""
    x = torch.randn(N, K, E, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, 0] = 0.0
    x[1, 0, 3] = 400.0
    x[2, 0, 1] = -50.0
    return x


def test_quantize_round_trip_is_within_half_a_step():
    x = _rows(12, 3, 64)
    q, d = kv_int8.quantize(x)  # (12, 3, 64), (12, 3, 1)
    assert q.dtype == torch.int8 and d.dtype == torch.float32 and kv_int8.row_width(64, torch.int8) == 68
    assert torch.equal(d[..., 0], x.abs().amax(-1) * torch.tensor(1 / 127, dtype=torch.float32))
    back = kv_int8.dequantize(q, d)
    assert (back - x).abs().le(d * (0.5 + 1e-5)).all()  # half a step, and q * d's own float rounding
    assert torch.equal(back[0, 0], torch.zeros(64)) and q[1, 0, 3] == 127 and q[2, 0, 1] == -127
    assert torch.equal(kv_int8.as_stored(x, torch.int8), back)


def test_a_block_holds_its_rows_quants_then_their_scales():
    """The layout the native kernels address (ops.h kv_slot): a block's bs * K rows of quants, then their float32
    scales, both in (head, position) order; `pack`, `read` and the slot helpers agree with it."""
    bs, K, E = 4, 3, 64
    x = _rows(2 * bs, K, E).view(2, bs, K, E)
    blocks = kv_int8.pack(x)  # (2, bs, K, E + 4)
    q, d = kv_int8.quantize(x)
    raw = blocks.view(2, -1)
    assert torch.equal(raw[:, : bs * K * E], q.transpose(1, 2).reshape(2, -1))
    assert torch.equal(raw[:, bs * K * E :].contiguous().view(torch.float32), d.transpose(1, 2).reshape(2, -1))
    assert torch.equal(kv_int8.read(blocks, torch.float32), kv_int8.dequantize(q, d))
    slots = torch.tensor([5, 0, 7])  # block 1 row 1, block 0 row 0, block 1 row 3
    assert torch.equal(kv_int8.read_slots(blocks, slots, torch.float32), kv_int8.dequantize(q, d).view(-1, K, E)[slots])
    pool = torch.zeros_like(blocks)
    kv_int8.write_slots(pool, slots, x.view(-1, K, E)[slots])
    assert torch.equal(kv_int8.read_slots(pool, slots, torch.float32), kv_int8.read_slots(blocks, slots, torch.float32))
    others = [s for s in range(2 * bs) if s not in slots.tolist()]
    assert kv_int8.read_slots(pool, torch.tensor(others), torch.float32).abs().sum() == 0


@needs_native
@pytest.mark.parametrize("E", [64, 20, 16])  # 20: rows that are not whole cache lines
def test_native_writer_stores_the_pytorch_bytes(E):
    """The native paged_write (and so the fused step's store_kv_row) and the PyTorch one write the same bytes."""
    K, H, NB, bs = 3, 6, 5, 4
    qkv = torch.cat([torch.randn(11, H, E), _rows(11, 2 * K, E)], dim=1)  # (N, H + 2K, E): k, v strided views
    k, v = qkv[:, H : H + K], qkv[:, H + K :]
    slots = torch.randperm(NB * bs, generator=torch.Generator().manual_seed(1))[:11]
    pools = [torch.zeros(NB, bs, K, E + 4, dtype=torch.int8) for _ in range(4)]
    native.paged_write(k, v, pools[0], pools[1], slots)
    with kernels.disabled():
        ops.paged_write(k, v, pools[2], pools[3], slots)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    assert torch.equal(kv_int8.read_slots(pools[0], slots, torch.float32), kv_int8.as_stored(k, torch.int8))
    others = torch.tensor([s for s in range(NB * bs) if s not in slots.tolist()])
    assert kv_int8.read_slots(pools[0], others, torch.float32).abs().sum() == 0
    with pytest.raises(RuntimeError, match="shapes"):  # a pool of E, not E + 4
        native.paged_write(k, v, torch.zeros(NB, bs, K, E, dtype=torch.int8), pools[1], slots)


def _int8_pools(lens: list[int], bs: int, K: int, E: int, seed: int = 0):
    return scattered_pools(lens, bs, K, E, torch.Generator().manual_seed(seed), seed, 3, torch.int8)


@needs_native
@pytest.mark.parametrize("H,K,E", [(6, 2, 64), (4, 1, 128), (3, 3, 64), (4, 2, 20), (4, 2, 48), (2, 1, 96)])  # GQA, MQA, MHA, odd E; E = 48 and 96: the products other than 64 bytes at a time
@pytest.mark.parametrize("bs", [4, 6, 16])  # 16, the engine's default: 8 keys' scales are read as one run
@pytest.mark.parametrize("window", [0, 11])
def test_attention_over_an_int8_pool_is_sdpa_over_its_dequantized_values(H, K, E, bs, window):
    """Native (and the PyTorch reference the engine falls back to) against SDPA of the rounded query over the
    dequantized keys and values: the kernel's score is the integer product of the query's and the key's quants times
    their two scales, and it applies each value's scale to its weight, so float32 rounding apart it is the same
    attention."""
    lens = [1, 7, 16, 33, 100]
    k_pool, v_pool, tables, tables_t = _int8_pools(lens, bs, K, E)
    N = len(lens) + 2
    q = torch.randn(N, H, E)
    rows = torch.tensor([5, 0, 3, 1, 6])
    outs = [torch.full((N, H, E), 7.0) for _ in range(2)]
    native.paged_decode_attention(q, k_pool, v_pool, rows, tables_t, torch.tensor(lens), outs[0], window)
    with kernels.disabled():
        ops.decode_attention(q, k_pool, v_pool, rows, tables_t, torch.tensor(lens), outs[1], window=window)
    for r, n, table in zip(rows.tolist(), lens, tables):
        first = max(0, n - window) if window else 0
        kd = kv_int8.read(k_pool[table], torch.float32).reshape(1, -1, K, E)[:, first:n]
        vd = kv_int8.read(v_pool[table], torch.float32).reshape(1, -1, K, E)[:, first:n]
        want = sdpa(kv_int8.round_query(q[r])[None, None], kd, vd, scale=1.0)[0, 0]  # (H, E)
        for out in outs:
            torch.testing.assert_close(out[r], want, rtol=1e-5, atol=1e-5)
    assert all((out[[2, 4]] == 7).all() for out in outs)


@needs_native
@pytest.mark.parametrize("H,K,E", [(8, 2, 64), (6, 2, 128), (3, 3, 64), (4, 2, 24)])
def test_prefill_rows_over_int8_are_bitwise_each_row_alone(H, K, E):
    """As the float tests (tests/model/test_native_kernels.py): a chunk's rows in tiles (over an int8 pool a group
    of more than 4 queries widens each block's quants once), beside another sequence's rows, give each row's output
    and telemetry bitwise as the row alone."""
    bs, n0, T = 16, 53, 21
    k_pool, v_pool, tables, tabs2 = _int8_pools([n0 + T, 40], bs, K, E, seed=2)
    q = torch.randn(T + 3, H, E)
    rows = torch.tensor([T + 1, *range(T), T + 2])
    lens = torch.tensor([40, *range(n0 + 1, n0 + T + 1), 17])
    tabs = torch.stack([tabs2[1]] + [tabs2[0]] * T + [tabs2[1]])

    def tel(R):
        return (torch.arange(R), torch.full((R,), 2), torch.zeros(R, H), torch.zeros(R, H, 4, dtype=torch.long),
                torch.zeros(R, H, 4))

    together, t_all = torch.zeros(T + 3, H, E), tel(len(rows))
    native.paged_decode_attention_telemetry(q, k_pool, v_pool, rows, tabs, lens, together, *t_all)
    for i in range(len(rows)):
        alone, one = torch.zeros(T + 3, H, E), tel(1)
        native.paged_decode_attention_telemetry(q, k_pool, v_pool, rows[i : i + 1], tabs[i : i + 1], lens[i : i + 1],
                                                alone, *one)
        assert torch.equal(together[rows[i]], alone[rows[i]]), i
        assert all(torch.equal(a[i], b[0]) for a, b in zip(t_all[2:], one[2:])), i
    kd = kv_int8.read(k_pool[tables[0]], torch.float32).reshape(1, -1, K, E)
    vd = kv_int8.read(v_pool[tables[0]], torch.float32).reshape(1, -1, K, E)
    for t in range(T):
        want = sdpa(kv_int8.round_query(q[t])[None, None], kd[:, : n0 + t + 1], vd[:, : n0 + t + 1], scale=1.0)[0, 0]
        torch.testing.assert_close(together[t], want, rtol=1e-5, atol=1e-5)


@needs_native
def test_int8_cache_needs_float32_activations():
    k_pool, v_pool, _, tables = _int8_pools([9], 4, 2, 16)
    q = torch.randn(1, 4, 16)
    with pytest.raises(RuntimeError, match="int8 cache"):
        native.paged_decode_attention(q.bfloat16(), k_pool, v_pool, torch.tensor([0]), tables, torch.tensor([9]),
                                      torch.zeros(1, 4, 16, dtype=torch.bfloat16))
