"""The engine's KV cache: a pool of fixed-size blocks per layer, and how a ragged batch attends through it.

Memory follows the tokens held: a sequence of L tokens owns ceil(L / block_size) blocks, listed in its block
table (PagedAttention, Kwon et al. 2023). One engine step packs every scheduled sequence's new tokens into one
row (B = 1, T = N total tokens) so the linear layers run once over all of them; only attention splits by sequence:

- rows with one new token (decode) attend over their block tables in place, all in one call per layer
  (`ops.decode_attention`: the native CPU kernel, Triton on CUDA, or the PyTorch reference that gathers);
- rows with several new tokens (prefill chunks) attend one by one through SDPA: causal over their own fresh K/V
  when nothing precedes them, else over their gathered blocks with a causal mask offset by the cached prefix;
- except where the native kernel runs (`paged_prefill`): there every row, prefill rows included, attends over its
  block table up to its own position, in the same call as decode rows. A prompt token's attention is then computed
  by the same code whether it is prefilled alone, in chunks, beside other sequences, or recomputed after a
  preemption, so its K/V in later layers, and every token after it, do not depend on the step (batch invariance).

The model runner (model/engine/model_runner.py) builds each step's `AttentionMetadata` once, from its persistent
buffers, into the step's `ForwardContext` (model/engine/forward_context.py), whose `attend` every layer calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from model import huge_pages
from model.config import ModelConfig
from model.kernels import kv_int8
from model.kernels import native as native_kernels
from model.kernels import ops



@dataclass
class SeqSlice:
    """One sequence's part of a step: tokens [start, start + num_new) of the packed row."""

    start: int
    num_new: int
    context_len: int  # tokens in the cache after this step (cached prefix + num_new)
    block_ids: list[int]


def slot_of(block_ids: list[int], position: int, block_size: int) -> int:
    """The pool slot (block * block_size + offset) holding a sequence's token at `position`."""
    return block_ids[position // block_size] * block_size + position % block_size


@dataclass
class PrefillChunk:
    """A sequence adding several tokens this step: rows [start, end) of the packed batch."""

    start: int
    end: int
    context_len: int
    blocks: Tensor | None  # (num_blocks,) its blocks, or None when nothing precedes the chunk
    mask: Tensor | None  # (1, 1, n, context_len) causal, offset by the cached prefix


@dataclass
class AttentionMetadata:
    """What every layer's attention reads in one step: where each token's K/V goes, and how each row attends."""

    slot_mapping: Tensor  # (N,) pool slot of each packed token
    paged_rows: Tensor  # (R,) packed rows attending over their block tables: decode rows (every row with paged_prefill)
    paged_tables: Tensor  # (R, W) their block tables (padding past a row's blocks is never read)
    paged_lens: Tensor  # (R,) their context lengths (position + 1)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # where prefill chunks attend in one kernel over the pool (`PagedKVCache.prefill_tiles`): its tiles (Tn, 4) and
    # each chunk's blocks (C, W) (model/kernels/triton_attention.py, `paged_prefill_attention`); else per chunk
    prefill_tiles: Tensor | None = None
    prefill_tables: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def all_paged(self) -> bool:
        return not self.prefills

    @classmethod
    def from_slices(cls, slices: list[SeqSlice], block_size: int, device: torch.device,
                    paged_prefill: bool = False) -> "AttentionMetadata":
        """The metadata from a step's slices alone (tensor-parallel workers, which follow rank 0's steps, and tests);
        the engine's runner writes the same into its persistent buffers instead."""
        paged = [s for s in slices if s.num_new == 1 or paged_prefill]
        slots = [slot_of(s.block_ids, p, block_size) for s in slices for p in range(s.context_len - s.num_new, s.context_len)]
        width = max((len(s.block_ids) for s in paged), default=0)
        rows = [(s.start + i, s.context_len - s.num_new + i + 1, s) for s in paged for i in range(s.num_new)]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            paged_rows=torch.tensor([r for r, _, _ in rows], dtype=torch.long, device=device),
            paged_tables=torch.tensor([(s.block_ids + [0] * width)[:width] for _, _, s in rows], dtype=torch.long,
                                       device=device).view(len(rows), width),
            paged_lens=torch.tensor([n for _, n, _ in rows], dtype=torch.long, device=device),
            prefills=[prefill_chunk(s, block_size, device) for s in slices if s.num_new != 1 and not paged_prefill],
        )


def prefill_chunk(s: SeqSlice, block_size: int, device: torch.device) -> PrefillChunk:
    prefix = s.context_len - s.num_new
    if prefix == 0:
        return PrefillChunk(s.start, s.start + s.num_new, s.context_len, None, None)
    n_blocks = -(-s.context_len // block_size)
    blocks = torch.tensor(s.block_ids[:n_blocks], dtype=torch.long, device=device)
    q_pos = torch.arange(prefix, s.context_len, device=device)
    mask = (torch.arange(s.context_len, device=device) <= q_pos.unsqueeze(1))[None, None]  # (1, 1, n, ctx)
    return PrefillChunk(s.start, s.start + s.num_new, s.context_len, blocks, mask)


def kv_config(model):
    """The config whose KV heads a model's cache holds: its own, or a tensor-parallel rank's share of them."""
    return getattr(model, "kv_config", model.config)


class PagedKVCache:
    """The pools: K and V of every layer, (L, NB, bs, K, E) each, or (L, NB, bs, K, E + 4) int8 for an int8 cache
    (each head's row of a token: its quants and their scale, model/kernels/kv_int8.py). A step's view of them is its
    ForwardContext."""

    def __init__(self, kv: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str,
                 act_dtype: torch.dtype | None = None) -> None:
        """`kv`: the config whose layers and KV heads the pool holds (`kv_config`: a tensor-parallel rank's share).
        `dtype`: the pools'; `act_dtype`: the queries' (the model's; None: `dtype`)."""
        shape = (kv.n_layers, num_blocks, block_size, kv.n_kv_heads, kv_int8.row_width(kv.head_dim, dtype))  # (L, NB, bs, K, E)
        # Zero-filled, not empty: padded gathers read unused slots, and garbage NaNs would survive the -inf mask.
        # On CPU on 2 MB pages (model/huge_pages.py): a step's attention reads every row's keys and values. Their
        # pages are faulted in by a background thread (`huge_pages.populate_later`) while the engine is set up;
        # `wait_resident` waits for it (a server does before it says ready: a step that faults pages in, or one
        # beside the faulting thread, decodes slower; docs/performance.md#ready-means-full-speed).
        cpu = torch.device(device).type == "cpu"
        zeros = (lambda: huge_pages.empty(shape, dtype, resident=False)) if cpu else \
            (lambda: torch.zeros(shape, dtype=dtype, device=device))
        self.k, self.v = zeros(), zeros()
        self.filling = huge_pages.populate_later([self.k, self.v]) if cpu else None  # the thread faulting them in
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device = torch.device(device)
        self.act_dtype = act_dtype or dtype
        # how every step attends over these pools: the model's sliding window (0: none) and attention scale (0:
        # 1/sqrt(E)), from its config (model/config.py)
        self.window, self.scale = kv.sliding_window, kv.attention_multiplier

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_blocks: int, block_size: int,
                  dtype: torch.dtype | None = None) -> "PagedKVCache":
        """`dtype`: the cache's (`cache_dtype`); None: the model's."""
        return cls(kv_config(model), num_blocks, block_size, dtype or model.dtype, model.device, model.dtype)

    @staticmethod
    def bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
        """K and V of `block_size` tokens over all layers (an int8 cache's rows with their scales)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.n_layers * block_size * config.n_kv_heads * kv_int8.row_width(config.head_dim, dtype) * itemsize

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def wait_resident(self, threads: int = 1) -> None:
        """Return once every page of the pools is resident (at once off CPU, where they are allocated whole).
        `threads` > 1: fault what is left in on that many threads beside the background one, for a caller with
        nothing else to run meanwhile (a server before it says ready)."""
        if self.filling is not None:
            if threads > 1 and self.filling.is_alive():
                for pool in (self.k, self.v):  # pages already present are skipped: nothing is faulted twice
                    huge_pages.populate(pool, threads)
            self.filling.join()

    @property
    def paged_prefill(self) -> bool:
        """Prefill rows attend over the pool one by one too (module doc): where the native kernel runs."""
        return self._backend() == "native"

    @property
    def prefill_tiles(self) -> bool:
        """A step's prefill chunks attend over the pool in one kernel launch, by tiles (where Triton runs). The tiles
        kernel has neither a sliding window nor a scale of its own: such a model's chunks attend one by one."""
        return self._backend() == "triton" and not self.window and not self.scale

    @property
    def decode_backend(self) -> str:
        """What decode rows attend with over these pools: "native", "triton" or "torch" (gather + SDPA)."""
        return self._backend()

    def _backend(self) -> str:
        q = torch.empty(0, dtype=self.act_dtype, device=self.device)  # what a step's queries are
        return ops.decode_attention_backend(q, self.k[0])


KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")


def cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device | str, quantized: bool = False) -> torch.dtype:
    """The KV cache's dtype for `--kv-cache-dtype` (vLLM's flag). A float32 model may keep a 16-bit cache, float16
    (llama.cpp's default, `--cache-type-k f16`: 10 mantissa bits) or bfloat16, on CPU, where the native kernels round
    each key and value once when they write it and widen it exactly when they read it: half the bytes a long
    context's attention reads, and twice the tokens in the same pool. "auto": float16 under quantized (int8 / int4)
    weights on CPU where the native kernels run (they keep every row batch invariant over it), whose own rounding is
    far coarser (benchmarks/perplexity.py --kv-cache-dtypes measures what the cache's rounding adds), else the
    model's dtype, so a float32 model's keys and values stay HF's. "int8": each head's row of a token quantized with
    its own scale (model/kernels/kv_int8.py, llama.cpp's `--cache-type-k q8_0` with a block per head row), about half
    a 16-bit cache's bytes: under a float32 model on CPU (the native kernels) or any model on a GPU (the Triton
    kernel, or the PyTorch path that dequantizes what it gathers). Any other pair is refused (ValueError): a bfloat16
    model's cache is bfloat16 already, and the GPU kernels read the model's dtype or int8."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    if name == "auto":
        cpu_float32 = model_dtype == torch.float32 and torch.device(device).type == "cpu"
        return torch.float16 if quantized and cpu_float32 and native_kernels() is not None else model_dtype
    dtype = getattr(torch, name)
    if dtype == model_dtype:
        return dtype
    if dtype == torch.int8:
        if model_dtype != torch.float32 and torch.device(device).type == "cpu":
            raise ValueError(f"kv_cache_dtype int8 with a {str(model_dtype).removeprefix('torch.')} model on cpu: "
                             "an int8 cache on CPU is read under float32 activations (--dtype float32)")
        return dtype
    if model_dtype != torch.float32 or torch.device(device).type != "cpu":
        raise ValueError(f"kv_cache_dtype {name} with a {str(model_dtype).removeprefix('torch.')} model on "
                         f"{torch.device(device).type}: a cache of another dtype than the model's is a 16-bit cache "
                         "under a float32 model on CPU")
    return dtype

