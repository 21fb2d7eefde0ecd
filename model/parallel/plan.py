"""Tensor parallelism, the math: which slice of each weight a rank holds, and the all-reduce after each block half.

Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", section 3): in each block, the first matmul is split by output columns and the second by input rows,
so a rank computes its slice end to end and one all-reduce per half-block sums the partial outputs.

    attention   wq, wk, wv column-parallel by whole heads: rank r of N owns query heads [r H/N, (r+1) H/N) and the
                KV heads those read; attention runs on local heads only; wo row-parallel (its input columns are
                the local heads' E-wide slices) -> partial (B, T, D), all-reduced (summed). Biases of q, k, v
                (Qwen2) are sliced with their rows; per-head q/k norms (Qwen3) are replicated; a q/k norm over the
                whole projection (OLMo-2) would need its statistic all-reduced inside attention: refused.
    SwiGLU      w1, w3 column-parallel over the inner width F (rank r: [r F/N, (r+1) F/N)), silu(gate) * up is
                elementwise so it stays local; w2 row-parallel over the same F slice -> partial (B, T, D), summed.
    the rest    tok_embeddings, the norms and the output head are replicated (see README "Tensor parallelism":
                vocabulary-sharding them would save V x D per rank at the price of an all-gather of logits).

KV heads: when N divides K each rank owns K/N of them. When it does not but K divides N (K = 1 (MQA) or few KV
heads on many ranks), N/K consecutive ranks hold a copy of the same single KV head, as vLLM does
(`QKVParallelLinear` with `num_kv_head_replicas`): every local query head then reads a local KV head, the
per-rank GQA grouping stays uniform (Hl / Kl query heads per KV head, what SDPA's `enable_gqa` needs), and the
only cost is the replicated head's weights and KV-cache slots. Other combinations (e.g. K = 3, N = 2) would give a
rank query heads of two KV groups in unequal numbers; they are refused with the allowed sizes named.

Notation as in transformer.py; N ranks (world size), r this rank, Hl/Kl/Fl the per-rank head counts and width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from model.config import ModelConfig
from model.loaders.errors import CheckpointError
from model.features.lora import LoRAAdapter, LoRAPart


@dataclass(frozen=True)
class TPRank:
    """Which rank of how many this process is."""

    rank: int
    world_size: int

    def plan(self, config: ModelConfig) -> "ShardPlan":
        """This rank's shard of a model with `config` (the loaders' `ShardFor`)."""
        return ShardPlan(config, self)


def allowed_sizes(config: ModelConfig) -> list[int]:
    """Tensor-parallel sizes this architecture can be split into (up to n_heads)."""
    H, K = config.n_heads, config.n_kv_heads
    return [n for n in range(1, H + 1) if H % n == 0 and (K % n == 0 or n % K == 0)]


class ShardPlan:
    """The slices rank `tp.rank` of `tp.world_size` holds of a model with `config` (the whole model's)."""

    def __init__(self, config: ModelConfig, tp: TPRank) -> None:
        N, r = tp.world_size, tp.rank
        H, K, F = config.n_heads, config.n_kv_heads, config.hidden_dim
        if not 0 <= r < N:
            raise ValueError(f"rank {r} is out of range for tensor-parallel size {N}")
        if N not in allowed_sizes(config):
            raise CheckpointError(
                f"tensor-parallel size {N} does not fit {H} query heads and {K} KV heads: it must divide n_heads "
                f"and either divide n_kv_heads or be a multiple of it; this model allows {allowed_sizes(config)}")
        if F < N:
            raise CheckpointError(f"tensor-parallel size {N} exceeds the SwiGLU width {F}")
        if config.qk_norm == "projection" and N > 1:
            # OLMo-2's q/k RMSNorm takes its statistic over every head's values: a rank holding some heads cannot
            # compute it without an all-reduce inside attention
            raise CheckpointError(f"tensor parallelism is not supported for {config.architecture}: its q/k norm spans "
                                  "every head (qk_norm 'projection'); serve it on one rank")
        self.config, self.tp = config, tp
        Hl = H // N
        self.q_heads = (r * Hl, (r + 1) * Hl)
        if K % N == 0:
            self.kv_heads = (r * K // N, (r + 1) * K // N)
        else:  # K divides N: one replicated KV head, the one all of this rank's query heads read
            first = r * Hl // config.n_rep
            self.kv_heads = (first, first + 1)
        self.ffn = (r * F // N, (r + 1) * F // N)  # uneven F splits are fine: w1/w3 rows and w2 columns agree
        self.local_config = config.replace(
            n_heads=Hl, n_kv_heads=self.kv_heads[1] - self.kv_heads[0], hidden_dim=self.ffn[1] - self.ffn[0],
            head_dim=config.head_dim)

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each KV head (1 when N divides K)."""
        return max(1, self.tp.world_size // self.config.n_kv_heads)

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """Our parameter name -> (dim, start, stop) of the full tensor this rank holds; None: replicated."""
        E = self.config.head_dim
        suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
        (q0, q1), (k0, k1), (f0, f1) = self.q_heads, self.kv_heads, self.ffn
        return {
            "attention.wq.weight": (0, q0 * E, q1 * E),
            "attention.wk.weight": (0, k0 * E, k1 * E),
            "attention.wv.weight": (0, k0 * E, k1 * E),
            # Qwen2's biases go with their rows; Qwen3's per-head q/k norms (E,) are the same for every head: replicated
            "attention.bq": (0, q0 * E, q1 * E),
            "attention.bk": (0, k0 * E, k1 * E),
            "attention.bv": (0, k0 * E, k1 * E),
            "attention.wo.weight": (1, q0 * E, q1 * E),
            "feed_forward.w1.weight": (0, f0, f1),
            "feed_forward.w3.weight": (0, f0, f1),
            "feed_forward.w2.weight": (1, f0, f1),
        }.get(suffix)

    def take(self, name: str, full: Tensor) -> Tensor:
        """This rank's slice of a full tensor (a view; the loaders copy it on the cast)."""
        s = self.slice_of(name)
        return full if s is None else full.narrow(s[0], s[1], s[2] - s[1])

    def shard_adapter(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """This rank's share of a LoRA adapter (model/features/lora/adapters.py) of the whole model, as its weights are split: at a
        column-parallel site (qkv, w13) each target keeps the output columns this rank holds (B's columns; A whole, the
        input being replicated); at a row-parallel one (o, w2), A's input columns this rank holds (its x A^T a partial
        sum, `LoRAPart.partial`), B whole."""
        E, (q0, q1), (k0, k1), (f0, f1) = self.config.head_dim, self.q_heads, self.kv_heads, self.ffn
        H, K, F = self.config.n_heads, self.config.n_kv_heads, self.config.hidden_dim
        # the global fused columns of this rank's local output columns, in order
        local_cols = {"qkv": [*range(q0 * E, q1 * E), *range((H + k0) * E, (H + k1) * E),
                              *range((H + K + k0) * E, (H + K + k1) * E)],
                      "w13": [*range(f0, f1), *range(F + f0, F + f1)]}
        inputs = {"o": (q0 * E, q1 * E), "w2": (f0, f1)}
        out = LoRAAdapter(adapter.name, adapter.path, adapter.rank, adapter.serial)
        for (layer, site), parts in adapter.parts.items():
            mine = []
            for p in parts:
                if site in inputs:
                    a0, a1 = inputs[site]
                    mine.append(LoRAPart(p.start, p.stop, p.A[:, a0:a1].contiguous(), p.BT, p.scale, partial=True))
                    continue
                js = [j for j, c in enumerate(local_cols[site]) if p.start <= c < p.stop]  # one run: both increase
                if js:
                    cols = torch.tensor(local_cols[site][js[0] : js[-1] + 1]) - p.start
                    mine.append(LoRAPart(js[0], js[-1] + 1, p.A, p.BT[:, cols].contiguous(), p.scale))
            if mine:
                out.parts[(layer, site)] = mine
        return out

    def local_heads(self, heads: list[int] | None) -> list[int] | None:
        """Global query-head ids (None: all) -> this rank's local indices of those it owns."""
        if heads is None:
            return None
        q0, q1 = self.q_heads
        return [h - q0 for h in heads if q0 <= h < q1]


class RowParallelLinear(nn.Module):
    """A row-parallel linear layer (Megatron-LM section 3): this rank holds the input columns of its heads or FFN
    slice, so its output is a partial sum, all-reduced over the ranks. A module swapped in for `wo` and `w2` (the
    model's own math stays as it is; the runner sees a layer it cannot fuse and runs these blocks module by module)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: Tensor) -> Tensor:  # (B, T, in / N) -> (B, T, out), summed over ranks
        out = self.linear(x)
        dist.all_reduce(out)
        return out


def install_row_parallel(model: nn.Module) -> None:
    """Make `wo` and `w2` of every block row-parallel (their outputs all-reduced)."""
    for layer in model.layers:
        layer.attention.wo = RowParallelLinear(layer.attention.wo)
        layer.feed_forward.w2 = RowParallelLinear(layer.feed_forward.w2)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of distinct parameter storage (tied and fused views counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = (p.untyped_storage().data_ptr(), p.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += p.untyped_storage().nbytes()
    return total


def cuda_device(device: str | torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r on CUDA (one GPU per rank), the CPU otherwise."""
    device = torch.device(device)
    return torch.device("cuda", rank) if device.type == "cuda" else device
