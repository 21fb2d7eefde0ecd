"""The engine's pure decode steps as CUDA graphs, one per batch-size bucket (vLLM's CUDAGraphRunner).

A decode step of a small model on a GPU is launch-bound: hundreds of kernel launches from Python, each a few
microseconds of host work, for a few microseconds of GPU work each. Captured once per batch size, the step's whole
forward (embedding, every block, paged attention through the Triton kernel, the head) replays as one graph launch.

Everything the graph reads lives in the model runner's persistent device buffers (model/engine/input_batch.py),
refilled before each replay: tokens, positions, KV slots, and each row's block table and context length (the
Triton decode kernel reads those on the device, so nothing in the forward depends on host values). A batch of n
rows runs the graph of the smallest bucket >= n; the padding rows decode token 0 at position 0 into a scratch
block outside the KV manager's pool, so they never touch a sequence's cache. Sampling stays outside the graph (it
needs the host anyway: stop strings, detokenization).

Every bucket is captured when the engine starts, largest first and sharing one memory pool (vLLM's order: the
largest graph's buffers are reused by the smaller ones), so no request ever pays a capture. Each bucket has two
graphs: the plain step, and the step with interventions and hidden-state reads from static buffers
(graph_edits.py), replayed only when some row of the step has them. A step whose per-row features' parts replay
the graphs (`Part.graph`) replays the featured variant of either: captured with every feature's graph part
(`GraphPart`, model/features/protocol.py: static per-row slots the step's parts are loaded into before each replay),
for every bucket when a feature's per-engine state changes (`features_changed`, between steps), never in the middle
of a step.

A capture that fails (out of memory, an op that cannot be captured) costs that bucket its graph, never a request:
the bucket decodes eagerly, with a log line, and `num_failed` counts it (the engine's stats, the server's metric).

Modes (`EngineConfig.decode_graphs`): "auto" captures on CUDA where the Triton decode kernel is available, "off"
runs every step eagerly, "eager" runs the static-buffer step without capture (what the CPU tests check, with the
native CPU kernel for attention: every part but the capture itself).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from model.engine.forward_context import ForwardContext
from model.engine.graph_edits import GRAPH_SITES, GraphEdits
from model.engine.input_batch import InputBuffers, StepBatch
from model.engine.paged_cache import AttentionMetadata, PagedKVCache
from model.features.protocol import StepParts
from model.kernels import kv_int8, ops

if TYPE_CHECKING:
    from model.features.registry import EngineFeatures

log = logging.getLogger("llamascope.engine")

DecodeGraphMode = Literal["auto", "off", "eager"]
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: every bucket below max_num_seqs and the first at or above it."""
    return [b for b in BUCKETS if b < max_num_seqs] + [next((b for b in BUCKETS if b >= max_num_seqs), max_num_seqs)]


class CudaGraphs:
    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, buffers: InputBuffers, scratch_block: int,
                 max_num_seqs: int, capture: bool, features: EngineFeatures | None = None) -> None:
        """`features`: the engine's per-row features, whose graph parts the featured graphs are captured with."""
        self.model, self.cache, self.buffers, self.capture = model, cache, buffers, capture
        self.buckets = buckets(max_num_seqs)
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * cache.block_size
        self.rows = torch.arange(self.buckets[-1], dtype=torch.long, device=cache.device)  # decode rows 0..B-1
        # one graph per (bucket, edited, featured): the edited variant applies the step's interventions from static
        # buffers and records block outputs (graph_edits.py), the featured one runs the features' graph parts over
        # the rows that carry them; steps without any replay the plain one
        self.graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool, bool], Tensor] = {}  # the logits each graph writes, (1, b, V)
        self.failed: set[tuple[int, bool, bool]] = set()
        self.num_failed = 0  # captures that failed, ever (a feature's new state captured again counts again)
        # the featured graphs' static parts, one per feature that has one (`Feature.graph_part`)
        self.feature_parts = [] if features is None else features.graph_parts(self.buckets[-1], cache.device)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        c = model.config
        capacity = min(4096, max(64, max_num_seqs * 3 * c.n_layers))  # vectors a step's interventions may use
        self.edits = GraphEdits(c.n_layers, c.dim, self.buckets[-1], capacity, cache.device)

    @staticmethod
    def enabled(mode: DecodeGraphMode, model: torch.nn.Module, block_size: int,
                kv_dtype: torch.dtype | None = None) -> bool:
        """Whether `mode` turns the static decode path on for this model over a KV cache of `kv_dtype` (None: the
        model's): its decode attention must read block tables on the device (Triton on CUDA, the native kernel on
        CPU), and tensor-parallel ranks step together. On CUDA without the Triton kernel the engine decodes
        eagerly, and says so (one log line; `fallbacks`)."""
        if mode == "off" or getattr(model, "kv_config", None) is not None:
            return False
        kv_dtype = kv_dtype or model.dtype
        probe = torch.empty(1, 1, 16, dtype=model.dtype, device=model.device)  # queries in the model's dtype
        pool = torch.empty(1, block_size, 1, kv_int8.row_width(16, kv_dtype), dtype=kv_dtype, device=model.device)
        backend = ops.decode_attention_backend(probe, pool)  # over a pool in the cache's own dtype
        if model.device.type == "cuda":
            if backend != "triton":
                log.warning("decode graphs: off on %s (decode attention for a %s cache is %s, not the Triton paged "
                            "kernel); decode steps run eagerly", model.device, str(kv_dtype).removeprefix("torch."),
                            backend)
            return backend == "triton"
        return mode == "eager" and backend == "native"

    @staticmethod
    def memory_estimate(config, max_num_seqs: int, dtype: torch.dtype) -> int:
        """Bytes the captured graphs hold, for sizing the KV pool around them: every graph keeps its logits (b, V)
        (plain and edited graphs of every bucket, and as many again for the featured ones), and the shared pool the
        largest bucket's working set (its float32 logits and one block's activations: the residual stream, q/k/v,
        the MLP's gate and up). An estimate: the capture logs what the pool took."""
        size = torch.empty((), dtype=dtype).element_size()
        bs = buckets(max_num_seqs)
        qkv = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        outputs = 4 * sum(bs) * config.vocab_size * size  # (plain, edited) x (base, featured)
        work = bs[-1] * (4 * config.vocab_size + (4 * config.dim + qkv + 3 * config.hidden_dim) * size)
        return outputs + work

    def accepts(self, batch: StepBatch, ctx: ForwardContext) -> bool:
        """A pure decode step: one new token per sequence (not prefill rows that attend over the pool one by one,
        `PagedKVCache.paged_prefill`), within the largest bucket."""
        n = batch.meta.num_tokens
        # graphs are captured without the features' parts: a step whose part declines them runs another path
        if not (batch.meta.all_paged and batch.num_seqs == n and (not ctx.parts or ctx.parts.allow("cuda_graph"))
                and 0 < n <= self.buckets[-1]):
            return False
        edited, featured = batch.edits is not None, bool(ctx.parts) and ctx.parts.graph
        key = (self._bucket(n), edited, featured)
        if key in self.failed:
            return False
        # featured graphs are captured for the features' state now (`features_changed`): none for it, no replay
        if self.capture and (key not in self.graphs or (featured and not self._current())):
            return False
        return not edited or (self.edits.fits(batch.edits) and not batch.edits.reads_beyond(("block_output",))
                              and not batch.edits.edits_beyond(GRAPH_SITES)
                              and not batch.edits.module_only and not batch.edits.has_clamps)

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _static(self, b: int) -> tuple[Tensor, Tensor, AttentionMetadata]:
        """The first b entries of the runner's device buffers: what bucket b's graph reads."""
        d = self.buffers.dev
        meta = AttentionMetadata(d["slots"][:b], self.rows[:b], d["paged_tables"][:b], d["paged_lens"][:b])
        return d["tokens"][None, :b], d["positions"][None, :b], meta

    def _pad(self, n: int, b: int) -> None:
        """Rows n..b-1 of the buffers: token 0 at position 0, written to and read from the scratch block only."""
        d = self.buffers.dev
        d["tokens"][n:b] = 0
        d["positions"][n:b] = 0
        d["slots"][n:b] = self.scratch_slot
        d["paged_tables"][n:b, 0] = self.scratch_block
        d["paged_lens"][n:b] = 1

    @torch.inference_mode()
    def run(self, batch: StepBatch, parts: StepParts | None = None) -> Tensor:
        """A pure decode step of n rows, already written into the buffers (`parts`: its features' parts, which
        `accepts` let through) -> logits (n, V)."""
        n = batch.meta.num_tokens
        b = self._bucket(n)
        self._pad(n, b)
        key = (b, batch.edits is not None, bool(parts) and parts.graph)
        if key[1]:
            self.edits.load(batch.edits)
        if key[2]:
            self._use_features()
            for gp in self.feature_parts:
                gp.load(parts)
        if not self.capture:
            logits = self._forward(*key)[0, :n]
        else:  # (`accepts`: captured, for the features' state now)
            self.graphs[key].replay()
            logits = self.outputs[key][0, :n]
        if key[1]:
            self.edits.store_reads(batch.edits)
        return logits

    def _current(self) -> bool:
        return all(gp.current() for gp in self.feature_parts)

    def _use_features(self) -> None:
        """The featured graphs hold the features' state now: those captured for another are dropped (and their
        failures forgotten)."""
        if not any([gp.use() for gp in self.feature_parts]):  # (every part takes its state: no short circuit)
            return
        for key in [k for k in self.graphs if k[2]]:
            del self.graphs[key], self.outputs[key]
        self.failed = {k for k in self.failed if not k[2]}

    def features_changed(self) -> None:
        """A feature's per-engine state changed (an adapter loaded or unloaded, between steps): the featured graphs
        of the new state, every bucket plain and edited, are captured now, so that no step ever waits for a capture
        (vLLM captures its adapters' graphs up front too); with no feature active, none."""
        self._use_features()
        if not self.capture or not any(gp.active() for gp in self.feature_parts):
            return
        start = time.perf_counter()
        for b in reversed(self.buckets):
            self._pad(0, b)
            for gp in self.feature_parts:
                gp.load(None)
            for edited in (False, True):
                self._capture(b, edited, True)
        log.info("decode graphs: %d featured graphs captured in %.1fs%s",
                 sum(k[2] for k in self.graphs), time.perf_counter() - start,
                 f"; failed: {sorted(k for k in self.failed if k[2])}" if any(k[2] for k in self.failed) else "")

    def capture_all(self) -> None:
        """Capture every bucket now, largest first into one shared pool; logs the time it took and the memory."""
        start = time.perf_counter()
        before = torch.cuda.memory_reserved(self.cache.device) if self.cache.device.type == "cuda" else 0
        for b in reversed(self.buckets):
            self._pad(0, b)  # every row a padding row: the capture writes only the scratch block
            for edited in (False, True):
                self._capture(b, edited)
        taken = (torch.cuda.memory_reserved(self.cache.device) - before) if self.cache.device.type == "cuda" else 0
        log.info("decode graphs: %d graphs (plain and edited) captured in %.1fs, %.0f MB (%s)", len(self.graphs),
                 time.perf_counter() - start, taken / 1e6,
                 ", ".join(str(b) for b, e, _ in sorted(self.graphs) if not e)
                 + (f"; failed: {sorted(self.failed)}" if self.failed else ""))

    def _forward(self, b: int, edited: bool = False, featured: bool = False) -> Tensor:  # -> (1, b, V)
        tokens, positions, meta = self._static(b)
        # the captured step's context: the static buffers' metadata, the static interventions when edited, the
        # features' static parts when featured
        parts = StepParts(list(self.feature_parts)) if featured and self.feature_parts else None
        ctx = ForwardContext(self.cache, meta, [], self.edits if edited else None, parts)
        return self.model(tokens, positions, ctx)

    def _capture(self, b: int, edited: bool = False, featured: bool = False) -> None:
        key = (b, edited, featured)
        try:
            # on the cache's device whichever thread captures (the current device is per thread and starts at 0)
            torch.cuda.set_device(self.cache.device)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up outside the graph: Triton compiles, the allocator settles
                    self._forward(*key)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[key] = self._forward(*key)
            self.graphs[key] = graph
        except Exception:  # never fail a request over a capture: that bucket runs eagerly from now on
            log.exception("CUDA graph capture failed for batch size %d (edited: %s, featured: %s); decoding it eagerly",
                          b, edited, featured)
            self.num_failed += 1
            self.failed.add(key)
            self.graphs.pop(key, None)
            self.outputs.pop(key, None)
