"""The engine's pure decode steps as CUDA graphs, one per batch-size bucket (vLLM's CUDAGraphRunner).

A decode step of a small model on a GPU is launch-bound: hundreds of kernel launches from Python, each a few
microseconds of host work, for a few microseconds of GPU work each. Captured once per batch size, the step's whole
forward (embedding, every block, paged attention through the Triton kernel, the head) replays as one graph launch.

Everything the graph reads lives in static buffers, refilled before each replay: tokens, positions, KV slots, and
each row's block table and context length (the Triton decode kernel reads those on the device, so nothing in the
forward depends on host values). A batch of n rows runs the graph of the smallest bucket >= n; the padding rows
decode token 0 at position 0 into a scratch block outside the KV manager's pool, so they never touch a sequence's
cache. Sampling stays outside the graph (it needs the host anyway: stop strings, detokenization).

Modes (`EngineConfig.decode_graphs`): "auto" captures on CUDA where the Triton decode kernel is available, "off"
runs every step eagerly, "eager" runs the static-buffer step without capture (what the CPU tests check, with the
native CPU kernel for attention: every part but the capture itself).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import Tensor

from model import kernels
from model.kernels import triton_attention
from model.engine.paged_cache import PagedKVCache, SeqSlice, decode_attention_kernel, padded_tables, slot_of, write_kv

log = logging.getLogger("llamascope.engine")

DecodeGraphMode = Literal["auto", "off", "eager"]
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class _StaticDecodeContext:
    """The attention context the captured forward sees: the engine's pools, the static buffers' metadata."""

    def __init__(self, cache: PagedKVCache, slots: Tensor, rows: Tensor, tables: Tensor, lens: Tensor) -> None:
        self.cache, self.slots, self.rows, self.tables, self.lens = cache, slots, rows, tables, lens

    def begin_forward(self, positions: Tensor) -> None:
        pass

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (1, B, H, E), k/v (1, B, K, E) -> (1, B, H, E), writing k/v into their slots first."""
        k_pool, v_pool = self.cache.k[layer], self.cache.v[layer]  # (NB, bs, K, E)
        write_kv(k_pool, v_pool, self.slots, k[0], v[0])
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        attend_decode = decode_attention_kernel(q, k_pool, self.cache.block_size)  # `enabled` made sure there is one
        attend_decode(q[0], k_pool, v_pool, self.rows, self.tables, self.lens, out[0])
        return out


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, scratch_block: int, max_num_seqs: int,
                 max_blocks_per_seq: int, capture: bool) -> None:
        self.model, self.cache, self.capture = model, cache, capture
        self.buckets = [b for b in BUCKETS if b < max_num_seqs] + [next((b for b in BUCKETS if b >= max_num_seqs), max_num_seqs)]
        B, W, dev = self.buckets[-1], max_blocks_per_seq, cache.device
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * cache.block_size
        self.tokens = torch.zeros(1, B, dtype=torch.long, device=dev)  # (1, B)
        self.positions = torch.zeros(1, B, dtype=torch.long, device=dev)  # (1, B)
        self.slots = torch.full((B,), self.scratch_slot, dtype=torch.long, device=dev)  # (B,)
        self.rows = torch.arange(B, dtype=torch.long, device=dev)  # (B,)
        self.tables = torch.full((B, W), scratch_block, dtype=torch.long, device=dev)  # (B, W)
        self.lens = torch.ones(B, dtype=torch.long, device=dev)  # (B,)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}  # bucket -> the logits the bucket's graph writes, (1, b, V)
        self.failed: set[int] = set()
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    @staticmethod
    def enabled(mode: DecodeGraphMode, model: torch.nn.Module, block_size: int) -> bool:
        """Whether `mode` turns the static decode path on for this model: its decode attention must read block
        tables on the device (Triton on CUDA, the native kernel on CPU), and tensor-parallel ranks step together."""
        if mode == "off" or getattr(model, "kv_config", None) is not None:
            return False
        probe = torch.empty(0, device=model.device)
        if model.device.type == "cuda":
            return triton_attention.available(probe, block_size)
        return mode == "eager" and kernels.usable(probe.float()) is not None

    def accepts(self, slices: list[SeqSlice]) -> bool:
        n = len(slices)
        return 0 < n <= self.buckets[-1] and all(s.num_new == 1 for s in slices) and self._bucket(n) not in self.failed

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    @torch.inference_mode()
    def run(self, slices: list[SeqSlice], tokens: list[int], positions: list[int]) -> Tensor:
        """A pure decode step of n = len(slices) rows -> logits (n, V)."""
        n, b, bs = len(slices), self._bucket(len(slices)), self.cache.block_size
        dev = self.tokens.device
        W = self.tables.shape[1]
        slots = [slot_of(s.block_ids, p, bs) for s, p in zip(slices, positions)]
        host_tables = torch.tensor(padded_tables(slices, W), dtype=torch.long)  # W: the blocks of max_model_len
        self.tokens[0, :n].copy_(torch.tensor(tokens), non_blocking=True)
        self.positions[0, :n].copy_(torch.tensor(positions), non_blocking=True)
        self.slots[:n].copy_(torch.tensor(slots), non_blocking=True)
        self.tables[:n].copy_(host_tables.to(dev), non_blocking=True)
        self.lens[:n].copy_(torch.tensor([s.context_len for s in slices]), non_blocking=True)
        # padding rows: token 0 at position 0, written to and read from the scratch block only
        self.tokens[0, n:b] = 0
        self.positions[0, n:b] = 0
        self.slots[n:b] = self.scratch_slot
        self.tables[n:b, 0] = self.scratch_block
        self.lens[n:b] = 1
        if not self.capture:
            return self._forward(b)[0, :n]
        if b not in self.graphs:
            self._capture(b)
            if b in self.failed:
                return self._forward(b)[0, :n]
        self.graphs[b].replay()
        return self.outputs[b][0, :n]

    def _forward(self, b: int) -> Tensor:  # -> (1, b, V)
        ctx = _StaticDecodeContext(self.cache, self.slots[:b], self.rows[:b], self.tables[:b], self.lens[:b])
        return self.model(self.tokens[:, :b], self.positions[:, :b], ctx)

    def _capture(self, b: int) -> None:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up outside the graph: Triton compiles, the allocator settles
                    self._forward(b)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph
            log.info("decode graph captured for batch size %d", b)
        except Exception:  # never fail a request over a capture: that bucket runs eagerly from now on
            log.exception("CUDA graph capture failed for batch size %d; decoding it eagerly", b)
            self.failed.add(b)
            self.graphs.pop(b, None)
            self.outputs.pop(b, None)
