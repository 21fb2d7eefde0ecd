"""Run by tests/model/test_triton_attention.py in a subprocess with TRITON_INTERPRET=1 (set before triton is imported):
the CUDA decode-attention kernel, executed by Triton's interpreter on CPU tensors.

On a CUDA machine, `python tests/triton_interpret_check.py --cuda` runs the kernel checks (against SDPA, and the
TELEMETRY variant against its reference) compiled for the GPU instead; the engine checks need the interpreter."""

from __future__ import annotations

import os
import sys

CUDA = "--cuda" in sys.argv
QUICK = "--quick" in sys.argv  # one case of each kernel check (benchmarks/gpu_check.py --dry-run)
assert CUDA or os.environ.get("TRITON_INTERPRET") == "1"
sys.path[:0] = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))]

import torch  # noqa: E402

from model import kernels  # noqa: E402
from model.attention import sdpa  # noqa: E402
from model.kernels import triton_attention  # noqa: E402
from model.engine import Engine, EngineConfig, RequestOptions, SamplingParams  # noqa: E402
from model.features import KVWindow, TelemetryOptions  # noqa: E402
from model.kernels import attention_telemetry, kv_int8  # noqa: E402
from model.kernels.attention_telemetry import AttentionTelemetry  # noqa: E402
from paged_pools import scattered_pools  # noqa: E402
from tiny import byte_tokenizer, greedy_tokens, tiny_model  # noqa: E402


def kernel_vs_sdpa(dtype: torch.dtype, H: int, K: int, E: int, bs: int, device: str = "cpu", window: int = 0,
                   scale: float = 0.0, kv: torch.dtype | None = None) -> float:
    """`window`, `scale`: a sliding window (rows attend to their last `window` keys, the blocks before never read)
    and an attention scale (0: 1/sqrt(E)); `kv`: the pools' dtype (None: `dtype`; int8: SDPA of the query rounded as
    the kernels round it over their dequantized values)."""
    lens = [1, 7, 16, 33, 100]
    k_pool, v_pool, tables, tables_t = scattered_pools(lens, bs, K, E, torch.Generator().manual_seed(0), 0, 3, kv or dtype)
    N = len(lens) + 2
    q = torch.randn(N, H + 2 * K, E).to(dtype)[:, :H]  # a view into a fused q/k/v output, as the model passes it
    rows = [5, 0, 3, 1, 6]
    out = torch.full((N, H, E), 7.0, dtype=dtype)
    on = [t.to(device) for t in (q, k_pool, v_pool, torch.tensor(rows), tables_t, torch.tensor(lens), out)]
    if window:  # the blocks wholly before each row's window hold NaN: a read of one would show in the output
        for n, table in zip(lens, tables):
            for b in table[: max(0, n - window) // bs]:
                if kv == torch.int8:  # (NaN scales)
                    kv_int8.parts(on[1][b])[1].fill_(float("nan"))
                    kv_int8.parts(on[2][b])[1].fill_(float("nan"))
                else:
                    on[1][b], on[2][b] = float("nan"), float("nan")
    triton_attention.paged_decode_attention(*on, None, window, scale)
    out = on[-1].cpu()
    assert (out[[2, 4]] == 7).all(), "rows that are not decode rows must stay untouched"
    err = 0.0
    for r, n, table in zip(rows, lens, tables):
        first = max(0, n - window) if window else 0
        kd = kv_int8.read(k_pool[table], dtype).reshape(1, -1, K, E)[:, first:n]
        vd = kv_int8.read(v_pool[table], dtype).reshape(1, -1, K, E)[:, first:n]
        qr, s = (kv_int8.round_query(q[r], scale).to(dtype), 1.0) if kv == torch.int8 else (q[r], scale)
        want = sdpa(qr[None, None], kd, vd, scale=s)[0, 0]
        err = max(err, ((out[r].float() - want.float()).abs().max() / want.float().abs().max()).item())
    return err


def prefill_kernel_vs_sdpa(dtype: torch.dtype, H: int, K: int, E: int, bs: int, device: str = "cpu",
                           kv: torch.dtype | None = None) -> float:
    """Three chunks of a step (one with nothing cached before it, two after a cached prefix; 1 to 45 rows, so tiles
    of 32 split) through `paged_prefill_attention` against SDPA over each chunk's gathered keys (`kv`: as
    kernel_vs_sdpa)."""
    chunks = [(0, 1, 45), (13, 45, 3), (40, 6, 30)]  # (prefix cached, rows, unused) per chunk
    g = torch.Generator().manual_seed(1)
    lens = [pre + n for pre, n, _ in chunks]
    k_pool, v_pool, tables, tables_t = scattered_pools(lens, bs, K, E, g, 1, 2, kv or dtype)
    N = sum(n for _, n, _ in chunks) + 2
    q = torch.randn(N, H + 2 * K, E, generator=g).to(dtype)[:, :H]
    out = torch.full((N, H, E), 7.0, dtype=dtype)
    starts, row = [], 1  # row 0 and the last row belong to no chunk
    for _, n, _ in chunks:
        starts.append(row)
        row += n
    tiles = triton_attention.prefill_tiles([(r, n, pre) for r, (pre, n, _) in zip(starts, chunks)])
    on = [t.to(device) for t in (q, k_pool, v_pool, torch.tensor(tiles), tables_t, out)]
    triton_attention.paged_prefill_attention(*on)
    out = on[-1].cpu()
    assert (out[[0, N - 1]] == 7).all(), "rows outside the chunks must stay untouched"
    err = 0.0
    for r, (pre, n, _), table, total in zip(starts, chunks, tables, lens):
        kd = kv_int8.read(k_pool[table], dtype).reshape(1, -1, K, E)[:, :total]
        vd = kv_int8.read(v_pool[table], dtype).reshape(1, -1, K, E)[:, :total]
        mask = (torch.arange(total) <= torch.arange(pre, total)[:, None])[None, None]  # (1, 1, n, total)
        qr, s = (kv_int8.round_query(q[r : r + n]).to(dtype), 1.0) if kv == torch.int8 else (q[r : r + n], 0.0)
        want = sdpa(qr[None], kd, vd, mask, scale=s)[0]  # (n, H, E)
        err = max(err, ((out[r : r + n].float() - want.float()).abs().max() / want.float().abs().max()).item())
    return err


def telemetry_vs_reference(H: int, K: int, E: int, bs: int, top_k: int, device: str = "cpu",
                           kv: torch.dtype = torch.float32) -> None:
    """The TELEMETRY variant's record equals the definition (model/kernels/attention_telemetry.py): rows shorter
    than k, sinks of 0, 1 and 5 keys, a row that records nothing; the attention output is the plain variant's."""
    lens = [1, 3, 17, 40, 70]
    g = torch.Generator().manual_seed(1)
    k_pool, v_pool, _, tables_t = scattered_pools(lens, bs, K, E, g, 1, 2, kv)
    q = (torch.randn(len(lens), H, E, generator=g) * 2)
    rows, lens_t = torch.arange(len(lens)), torch.tensor(lens)
    slots, sink_len = torch.tensor([0, 1, -1, 2, 3]), torch.tensor([1, 5, 0, 1])

    def tel():
        return AttentionTelemetry(slots, sink_len, torch.zeros(4, H), torch.full((4, H, top_k), -7), torch.zeros(4, H, top_k))

    got, want = tel(), tel()
    out_plain, out_tel = torch.zeros(len(lens), H, E), torch.zeros(len(lens), H, E)
    # the kernel runs on `device` (.to is the tensor itself on the CPU); its outputs come back to compare on the CPU
    on = [t.to(device) for t in (q, k_pool, v_pool, rows, tables_t, lens_t, out_plain, out_tel)]
    got_d = AttentionTelemetry(*(t.to(device) for t in got))
    triton_attention.paged_decode_attention(*on[:7])
    triton_attention.paged_decode_attention(*on[:6], on[7], got_d)
    out_plain, out_tel = on[6].cpu(), on[7].cpu()
    got = AttentionTelemetry(*(t.cpu() for t in got_d))
    assert torch.equal(out_plain, out_tel)
    kd = kv_int8.read(k_pool.index_select(0, tables_t.reshape(-1)), torch.float32).view(len(lens), -1, K, E)
    if kv == torch.int8:  # the query rounded as the kernel rounds it
        attention_telemetry.reference(kv_int8.round_query(q), kd, lens_t, want, scale=1.0)
    else:
        attention_telemetry.reference(q, kd, lens_t, want)
    assert torch.allclose(got.sink_mass, want.sink_mass, atol=1e-5), (got.sink_mass - want.sink_mass).abs().max()
    assert torch.allclose(got.top_prob, want.top_prob, atol=1e-5)
    assert torch.equal(got.top_pos, want.top_pos), (got.top_pos, want.top_pos)


def split_kv_vs_reference(n_long: int, bs: int, device: str = "cpu", kv: torch.dtype = torch.float32,
                          window: int = 0) -> float:
    """Split-KV decode (one program per partition of the keys, then a reduction) at a long context: rows of
    `n_long`, one partition and a few keys, against SDPA over the gathered keys (float64), and the one-program
    loop's output equal to the split one's, bit for bit (the same merges in the same order). 2 query heads on one
    KV head (GQA); `window`: a sliding window. -> the max relative error."""
    H, K, E = 2, 1, 32
    lens = [n_long, 5, triton_attention.PARTITION + 3]
    g = torch.Generator().manual_seed(3)
    k_pool, v_pool, tables, tables_t = scattered_pools(lens, bs, K, E, g, 3, 1, kv)
    q = torch.randn(len(lens), H, E, generator=g) * 2  # peaked softmaxes: the partitions' maxima differ
    rows, lens_t = torch.arange(len(lens)), torch.tensor(lens)
    on = [t.to(device) for t in (q, k_pool, v_pool, rows, tables_t, lens_t)]
    split, single = torch.zeros(len(lens), H, E).to(device), torch.zeros(len(lens), H, E).to(device)
    assert triton_attention.split_kv(len(lens), H, bs, tables_t.shape[1]), "a step of few rows splits"
    triton_attention.paged_decode_attention(*on, split, window=window, split=True)
    triton_attention.paged_decode_attention(*on, single, window=window, split=False)
    assert torch.equal(split.cpu(), single.cpu()), "split and one-program outputs differ"
    err = 0.0
    for r, (n, table) in enumerate(zip(lens, tables)):
        first = max(0, n - window) if window else 0
        kd = kv_int8.read(k_pool[table], torch.float32).reshape(1, -1, K, E)[:, first:n].double()
        vd = kv_int8.read(v_pool[table], torch.float32).reshape(1, -1, K, E)[:, first:n].double()
        qr, s = (kv_int8.round_query(q[r]), 1.0) if kv == torch.int8 else (q[r], 0.0)
        want = sdpa(qr.double()[None, None], kd, vd, scale=s)[0, 0]
        err = max(err, ((split[r].cpu().double() - want).abs().max() / want.abs().max()).item())
    return err


def long_contexts(device: str) -> None:
    """Split-KV decode at 8k and 32k positions (float32 caches, and an int8 one under a window at 8k). Blocks of 64
    and 256 tokens keep the interpreter's loop short (its cost is per block); the partition is PARTITION tokens
    either way."""
    for n, bs, kv in ((8192, 64, torch.float32), (32768, 256, torch.float32)):
        err = split_kv_vs_reference(n, bs, device, kv)
        print(f"split-KV decode at {n} positions, {kv} cache, block {bs} on {device}: max rel err {err:.1e}, "
              "== the one-program loop")
        assert err < 1e-5, err
    err = split_kv_vs_reference(8192, 64, device, torch.int8, window=1000)
    print(f"split-KV decode at 8192 positions, window 1000, int8 cache, on {device}: max rel err {err:.1e}")
    assert err < 1e-5, err


def windowed_engine(model) -> list:
    """A sink + window sequence long past its window, with telemetry: (tokens, telemetry) per step."""
    engine = Engine(model, byte_tokenizer(), EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64,
                                                          max_model_len=40))
    engine.add_request("w", [5, 9, 2, 7, 1] * 3, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                       RequestOptions(kv_window=KVWindow(2, 6), telemetry=TelemetryOptions()))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def kernels_vs_references(device: str) -> None:
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        for H, K, E, bs in ((6, 2, 64, 4), (4, 1, 128, 16), (3, 3, 64, 8), (4, 2, 24, 4)):
            err = kernel_vs_sdpa(dtype, H, K, E, bs, device)
            print(f"kernel vs SDPA {dtype} H={H} K={K} E={E} block={bs} on {device}: max rel err {err:.1e}")
            assert err < tol, err
            if dtype == torch.float32:
                err = kernel_vs_sdpa(dtype, H, K, E, bs, device, window=11, scale=0.05)
                print(f"kernel vs SDPA, window 11, scale 0.05, {dtype} H={H} K={K} E={E} block={bs}: max rel err {err:.1e}")
                assert err < tol, err
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for H, K, E, bs in ((6, 2, 64, 4), (4, 1, 128, 16), (4, 2, 24, 16)):
            err = prefill_kernel_vs_sdpa(dtype, H, K, E, bs, device)
            print(f"prefill kernel vs SDPA {dtype} H={H} K={K} E={E} block={bs} on {device}: max rel err {err:.1e}")
            assert err < tol, err
    print(f"prefill tiles on {device}: Triton == SDPA")
    for H, K, E, bs, top_k in ((4, 2, 64, 4, 5), (3, 1, 24, 16, 3), (2, 2, 32, 8, 8)):
        telemetry_vs_reference(H, K, E, bs, top_k, device)
    print(f"telemetry on {device}: Triton's TELEMETRY variant == the reference")
    int8_kernels_vs_references(device)
    elementwise_vs_reference(device)
    long_contexts(device)


def int8_kernels_vs_references(device: str) -> None:
    """An int8 cache (blocks of E-byte rows and their scales, model/kernels/kv_int8.py) under float32 and 16-bit
    queries: decode (with a window whose earlier blocks hold NaN scales, and a scale), prefill tiles and telemetry
    against SDPA over the dequantized pools; E = 20: rows that are not whole cache lines."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        for H, K, E, bs in ((6, 2, 64, 4), (4, 1, 128, 16), (4, 2, 20, 8)):
            err = kernel_vs_sdpa(dtype, H, K, E, bs, device, kv=torch.int8)
            print(f"kernel vs SDPA, int8 cache, {dtype} H={H} K={K} E={E} block={bs} on {device}: max rel err {err:.1e}")
            assert err < tol, err
            if dtype == torch.float32:
                assert kernel_vs_sdpa(dtype, H, K, E, bs, device, window=11, scale=0.05, kv=torch.int8) < tol
                err = prefill_kernel_vs_sdpa(dtype, H, K, E, 16, device, kv=torch.int8)
                print(f"prefill kernel vs SDPA, int8 cache, H={H} K={K} E={E} on {device}: max rel err {err:.1e}")
                assert err < tol, err
    telemetry_vs_reference(4, 2, 64, 4, 5, device, kv=torch.int8)
    print(f"int8 cache on {device}: Triton == SDPA over the dequantized pools")


def elementwise_vs_reference(device: str) -> None:
    """triton_elementwise's kernels against ops' PyTorch chains (the kernels' float32 sums differ in order only)."""
    from model.kernels import ops, triton_elementwise as te
    from model.transformer import RotaryEmbedding, rotary_tables
    from model.config import ModelConfig

    g = torch.Generator().manual_seed(2)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        with kernels.disabled():
            x = torch.randn(5, 3, 96, generator=g).to(dtype).to(device)
            w = torch.randn(96, generator=g).to(dtype).to(device)
            want = ops.rms_norm(x, w, 1e-5)
            assert ((te.rms_norm(x, w, 1e-5) - want).abs().max() / want.abs().max()).item() < tol
            gu = torch.randn(7, 2 * 80, generator=g).to(dtype).to(device)
            want = ops.silu_mul(gu)
            assert ((te.silu_mul(gu) - want).abs().max() / want.abs().max()).item() < tol
            B, T, H, K, E = 1, 9, 4, 2, 32
            qkv = torch.randn(B, T, H + 2 * K, E, generator=g).to(dtype).to(device)
            rope = RotaryEmbedding(ModelConfig(vocab_size=8, dim=H * E, n_layers=1, n_heads=H, n_kv_heads=K,
                                               hidden_dim=8))
            cos, sin = rotary_tables(*rope(torch.arange(T)[None].to(device)), dtype)
            want = ops.rope_(qkv.clone(), cos, sin, H + K)
            got = te.rope_(qkv.clone(), cos, sin, H + K)
            assert ((got - want).abs().max() / want.abs().max()).item() < tol
            assert torch.equal(got[:, :, H + K :], qkv[:, :, H + K :])  # v untouched
    print(f"fused elementwise on {device}: Triton == PyTorch's chains")


def assert_same_steps(got: list, want: list) -> None:
    """windowed_engine's outputs of two paths: the same tokens, sink masses and top positions at every step."""
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        assert torch.allclose(a.features.get("telemetry").sink_mass, b.features.get("telemetry").sink_mass, atol=1e-5)
        assert torch.equal(a.features.get("telemetry").top_positions, b.features.get("telemetry").top_positions)


def engines_on_cuda() -> None:
    """The engine on a CUDA model as it serves (Triton kernel, decode graphs) against the gather + SDPA path."""
    model, prompts = tiny_model().cuda(), [[5, 9, 2, 7, 1] * k for k in (1, 3, 7)]
    on_triton, tel_triton = greedy_tokens(model, prompts), windowed_engine(model)
    assert any(triton_attention._checked.values()), "the Triton kernel did not serve"
    assert on_triton == [greedy_tokens(model, [p])[0] for p in prompts]
    for key in list(triton_attention._checked):
        triton_attention._checked[key] = False  # available() -> False: the gather + SDPA path
    assert greedy_tokens(model, prompts) == on_triton
    print("engine tokens on cuda: Triton path == gather path, batched == alone")
    assert_same_steps(tel_triton, windowed_engine(model))
    print("kv_window engine with telemetry on cuda: Triton path == gather path")
    triton_attention._checked.clear()
    on_triton = greedy_tokens(model, prompts, kv_cache_dtype="int8")
    assert triton_attention._checked[("cuda:0", torch.float32, torch.int8)], "the Triton kernel did not serve int8"
    assert on_triton == [greedy_tokens(model, [p], kv_cache_dtype="int8")[0] for p in prompts]
    for key in list(triton_attention._checked):
        triton_attention._checked[key] = False
    assert greedy_tokens(model, prompts, kv_cache_dtype="int8") == on_triton
    print("int8 cache engine tokens on cuda: Triton path == gather path, batched == alone")


def quick(device: str) -> None:
    """One case of each kernel check: float32, bfloat16, an int8 cache, telemetry, prefill tiles, split-KV."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        assert kernel_vs_sdpa(dtype, 4, 2, 32, 16, device) < tol
        assert prefill_kernel_vs_sdpa(dtype, 4, 2, 32, 16, device) < tol
    assert kernel_vs_sdpa(torch.float32, 4, 2, 32, 16, device, kv=torch.int8) < 1e-5
    telemetry_vs_reference(3, 1, 24, 16, 3, device)
    assert split_kv_vs_reference(1100, 64, device) < 1e-5
    print(f"quick kernel checks on {device}: Triton == the references")


def main() -> None:
    if QUICK:
        quick("cuda" if CUDA else "cpu")
        return
    if CUDA:
        kernels_vs_references("cuda")
        engines_on_cuda()
        return
    kernels_vs_references("cpu")
    # The engine on the Triton path (native CPU kernels off, so PagedKVCache.attend takes it) against the gather
    # path (Triton's interpreter off): the same greedy tokens, batched and alone.
    model, prompts = tiny_model(), [[5, 9, 2, 7, 1] * k for k in (1, 3, 7)]
    with kernels.disabled():
        assert triton_attention.available(torch.zeros(1), 4)
        on_triton = greedy_tokens(model, prompts)
        assert on_triton == [greedy_tokens(model, [p])[0] for p in prompts]
        os.environ["TRITON_INTERPRET"] = "0"  # available() -> False: the gather + SDPA path
        assert not triton_attention.available(torch.zeros(1), 4)
        assert greedy_tokens(model, prompts) == on_triton
    print("engine tokens: Triton path == gather path, batched == alone")
    os.environ["TRITON_INTERPRET"] = "1"
    with kernels.disabled():
        assert triton_attention.available(torch.zeros(1), 4)
        on_triton = windowed_engine(model)
        os.environ["TRITON_INTERPRET"] = "0"
        on_gather = windowed_engine(model)
    assert_same_steps(on_triton, on_gather)
    print("kv_window engine with telemetry: Triton path == gather path")
    os.environ["TRITON_INTERPRET"] = "1"
    with kernels.disabled():  # an int8 cache: quantized writes in PyTorch, the Triton kernels' reads
        on_triton = greedy_tokens(model, prompts, kv_cache_dtype="int8")
        assert triton_attention._checked[("cpu", torch.float32, torch.int8)]
        assert on_triton == [greedy_tokens(model, [p], kv_cache_dtype="int8")[0] for p in prompts]
        os.environ["TRITON_INTERPRET"] = "0"
        assert greedy_tokens(model, prompts, kv_cache_dtype="int8") == on_triton
    print("int8 cache engine tokens: Triton path == gather path, batched == alone")
    from tiny import tiny_family

    for family in ("mistral", "granite"):  # a sliding window; an attention scale and multipliers
        model = tiny_family(family)
        os.environ["TRITON_INTERPRET"] = "1"
        with kernels.disabled():
            on_triton = greedy_tokens(model, prompts)
            os.environ["TRITON_INTERPRET"] = "0"
            assert greedy_tokens(model, prompts) == on_triton
        with torch.no_grad():
            for p, t in zip(prompts, on_triton):  # and the uncached forward's argmax at every step
                assert model(torch.tensor([p + t]))[0, len(p) - 1 : -1].argmax(-1).tolist() == t
    print("families on the Triton path == gather path == the uncached forward")


if __name__ == "__main__":
    main()
