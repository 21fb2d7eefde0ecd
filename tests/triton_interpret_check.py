"""Run by tests/test_triton_attention.py in a subprocess with TRITON_INTERPRET=1 (set before triton is imported):
the CUDA decode-attention kernel, executed by Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os
import random
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path[:0] = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))]

import torch  # noqa: E402

from model import kernels  # noqa: E402
from model.attention import sdpa  # noqa: E402
from model.kernels import triton_attention  # noqa: E402
from tiny import greedy_tokens, tiny_model  # noqa: E402


def kernel_vs_sdpa(dtype: torch.dtype, H: int, K: int, E: int, bs: int) -> float:
    lens = [1, 7, 16, 33, 100]
    g = torch.Generator().manual_seed(0)
    n_blocks = sum(-(-n // bs) for n in lens) + 3
    k_pool = torch.randn(n_blocks, bs, K, E, generator=g).to(dtype)
    v_pool = torch.randn(n_blocks, bs, K, E, generator=g).to(dtype)
    ids = list(range(n_blocks))
    random.Random(0).shuffle(ids)  # scattered blocks
    tables, at = [], 0
    for n in lens:
        tables.append(ids[at : at + -(-n // bs)])
        at += -(-n // bs)
    N = len(lens) + 2
    q = torch.randn(N, H + 2 * K, E).to(dtype)[:, :H]  # a view into a fused q/k/v output, as the model passes it
    rows, width = [5, 0, 3, 1, 6], max(map(len, tables))
    out = torch.full((N, H, E), 7.0, dtype=dtype)
    triton_attention.paged_decode_attention(
        q, k_pool, v_pool, torch.tensor(rows), torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        torch.tensor(lens), out,
    )
    assert (out[[2, 4]] == 7).all(), "rows that are not decode rows must stay untouched"
    err = 0.0
    for r, n, table in zip(rows, lens, tables):
        kd = k_pool[table].reshape(1, -1, K, E)[:, :n]
        vd = v_pool[table].reshape(1, -1, K, E)[:, :n]
        want = sdpa(q[r][None, None], kd, vd)[0, 0]
        err = max(err, ((out[r].float() - want.float()).abs().max() / want.float().abs().max()).item())
    return err


def main() -> None:
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for H, K, E, bs in ((6, 2, 64, 4), (4, 1, 128, 16), (3, 3, 64, 8), (4, 2, 24, 4)):
            err = kernel_vs_sdpa(dtype, H, K, E, bs)
            print(f"kernel vs SDPA {dtype} H={H} K={K} E={E} block={bs}: max rel err {err:.1e}")
            assert err < tol, err
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


if __name__ == "__main__":
    main()
