"""The model runner: one step's execution, in one place (vLLM's `gpu_model_runner`).

`execute(scheduled)`:
    1. writes the step's inputs into persistent buffers (tokens, positions, KV slots, block tables, logits rows),
       and the rows' interventions and hidden-state reads into one table (model/edits.py) when any row has some;
       the per-row features its rows carry each prepare their part (model/features/registry.py);
    2. chooses the execution path from the step's batch and the model's layers, and records which ran:
           cuda_graph     a pure decode step replayed as the CUDA graph of its batch-size bucket
           native         any step (decode, prefill chunks, both) through every block in one native call (CPU,
                          where every row attends over the paged pool: `PagedKVCache.paged_prefill`)
           module         the model's modules, one call each (CUDA prefill and mixed steps, tensor parallelism,
                          the PyTorch reference ops)
       A path runs a step only where every feature part of it allows (`Part.paths`).
       All three compute the same logits (the module path is the reference; tests hold the others to it);
    3. runs it, scores prompt logprobs, and samples every sequence that caught up, from its logits as the step's
       feature parts mask them (`Part.mask_logits`: a part may prepare its masks while the forward runs).

The model is a function (tokens, positions, attention context) -> logits and knows none of this.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from model.edits import EditTables, Segment, gather_reads
from model.engine.cuda_graphs import CudaGraphs, buckets
from model.engine.forward_context import ForwardContext
from model.engine.input_batch import InputBuffers, StepBatch
from model.engine.engine_sizes import EngineSizes
from model.engine.native_step import NativeStep
from model.engine.paged_cache import PagedKVCache
from model.engine.persistent_batch import PersistentBatch
from model.engine.request import Sequence
from model.engine.sampler import SampledTensors, Sampler, TokenLogprobs, _put, prompt_logprobs
from model.engine.stream import Event, HostStream, Stream
from model.engine.scheduler import ScheduledSeq
from model.features.protocol import StepParts, StepRow, StepView

if TYPE_CHECKING:
    from model.features.registry import EngineFeatures

log = logging.getLogger("llamascope.engine")

PATHS = ("cuda_graph", "native", "module")


@dataclass
class DecodeLaunch:
    """A decode step launched and not yet read back: its rows, their positions, the samples (on the device, where
    the next step reads its input tokens from), the pinned host buffer their one copy goes to, and its event."""

    seqs: list[Sequence]
    positions: np.ndarray  # (n,) the positions computed
    sampled: SampledTensors
    tokens: Tensor  # (n,) the sampled ids, on the device
    host: Tensor  # (P,) what `sampled.pack()` is copied to
    event: Event
    removals: int  # the persistent batch's removals at launch: while it has not moved, every row still runs

    def result(self) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """Wait for the step and read its samples: each row's token, and the logprobs where any row asked."""
        self.event.synchronize()
        out = self.sampled.unpack(self.host.numpy())
        return out.token_ids, out.logprobs if self.sampled.lp_rows else None


@dataclass
class RunnerOutput:
    """What one step computed: the path it took, each sampled row's token (one per sequence that caught up; a
    drafting sequence's 1 + drafts rows in order), prompt logprobs scored, and the hidden states read: (sequence,
    positions, (n_positions, n_layers, D) float32), how far each reading sequence has now been read, and the
    features' per-token outputs: per sequence, per feature, one value per sampled row (`Part.collect`)."""

    path: str
    sampled: list[tuple[Sequence, int, TokenLogprobs | None]] = field(default_factory=list)
    prompt_logprobs: list[tuple[Sequence, list[TokenLogprobs]]] = field(default_factory=list)
    hidden_states: list[tuple[Sequence, list[int], Tensor]] = field(default_factory=list)
    read_upto: list[tuple[Sequence, int]] = field(default_factory=list)
    per_token: dict[Sequence, dict[str, list]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, sampler: Sampler, sizes: EngineSizes, *,
                 graph_mode: str = "off", native_step: bool = True, scratch_block: int | None = None,
                 batch: PersistentBatch | None = None, stream: Stream | None = None,
                 features: EngineFeatures | None = None) -> None:
        """`graph_mode`: EngineConfig.decode_graphs, where `scratch_block` (the padding rows' block) is given;
        `native_step`: EngineConfig.native_step; `features`: the engine's per-row features (none on a draft
        model's runner: its rows carry none)."""
        self.model, self.cache, self.sampler = model, cache, sampler
        self.features = features
        self.batch = batch  # the running sequences' rows: the decode path's block tables
        self.stream = stream or HostStream()  # where the device work runs (model/engine/stream.py)
        bs = cache.block_size
        rows = buckets(sizes.max_num_seqs)[-1] if scratch_block is not None else sizes.max_num_seqs  # graphs pad
        # block tables: one per decode row, or per token where prefill rows attend over them too (the native kernel)
        self.buffers = InputBuffers(max(sizes.max_num_batched_tokens, rows), rows, sizes.max_blocks_per_seq, bs,
                                    cache.device, separate=cache.device.type != "cpu" or self.stream.asynchronous,
                                    table_rows=None if cache.paged_prefill else rows)
        # the decode path's samples, two sets used in turn: on the device (the next step's input tokens) and their
        # packed copy on the host (tokens, and logprobs with up to MAX_LOGPROBS alternatives a row)
        pin = cache.device.type == "cuda"
        self._sampled = [torch.zeros(rows, dtype=torch.long, device=cache.device) for _ in range(2)]
        self._out_host = [torch.zeros(rows * (3 + 2 * sizes.max_logprobs), dtype=torch.long, pin_memory=pin)
                          for _ in range(2)]
        self._parity = 0
        self.native = NativeStep.for_model(model) if native_step else None
        self.graphs = None if scratch_block is None else CudaGraphs(
            model, cache, self.buffers, scratch_block, sizes.max_num_seqs, capture=graph_mode == "auto",
            features=features)
        self.path_counts: Counter[str] = Counter({p: 0 for p in PATHS})
        # prefill chunks in one kernel launch per layer where the attention backend is Triton (CUDA); the pools'
        # backend is fixed once the model is loaded, so asked once
        self._prefill_tiles = cache.prefill_tiles
        self.tables = EditTables(model.config.n_layers, model.config.dim, cache.device, model.config.norm_eps)

    def capture_graphs(self) -> None:
        if self.graphs is not None and self.graphs.capture:
            self.graphs.capture_all()

    def features_changed(self) -> None:
        """A feature's per-engine state changed (between steps): the decode graphs captured with it are captured
        again."""
        if self.graphs is not None:
            self.graphs.features_changed()

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> RunnerOutput:
        paged_prefill = self.cache.paged_prefill  # asked once per step: the pools' attention backend decides it
        batch = self.buffers.prepare(scheduled, _prompt_positions, paged_prefill, self._prefill_tiles)
        parts = StepParts()  # the per-row features' parts: none unless a row carries a feature, then nothing changes
        if self.features is not None:
            parts = self.features.prepare(StepView(
                [StepRow(s.seq, sl.start, sl.num_new, s.seq.num_computed_tokens, sl.context_len, sl.block_ids)
                 for s, sl in zip(scheduled, batch.slices)], batch.sample, self.model, self.cache.device, paged_prefill))
        layouts = []
        feature_reads = parts.reads() if parts else []  # rows the features read: through the same table as reads
        if feature_reads or any(s.seq.request.interventions is not None or s.seq.request.hidden_states is not None
                                for s in scheduled):
            batch.edits, layouts = self.tables.build(_segments(scheduled, batch), feature_reads)
        # the step as every path reads it
        ctx = ForwardContext(self.cache, batch.meta, batch.slices, batch.edits, parts or None)
        path = self._choose(batch, ctx)
        # every logits row a plain greedy row's (no prompt logprobs): the native head may pick without the logits
        greedy = (bool(batch.sample) and not batch.prompt_logprobs and not parts.masks
                  and all(seq.request.plain_greedy for seq, _ in batch.sample))
        with parts.module_hooks(self.model) if parts and path == "module" else contextlib.nullcontext():
            logits = self._forward(path, batch, ctx, greedy)  # (M, V): the batch's logits rows; or (M,) picks
        logits = logits if logits.dim() == 1 else logits.float()
        self.path_counts[path] += 1
        if feature_reads:
            parts.take_reads(batch.edits.read_out)
        out = RunnerOutput(path, per_token=parts.collect() if parts else {})
        if batch.edits is not None:
            for layout in layouts:
                out.hidden_states.append((layout[0].owner, layout[1], gather_reads(batch.edits, layout)))
            out.read_upto = [(s.seq, s.seq.num_computed_tokens + s.num_new_tokens) for s in scheduled
                             if s.seq.request.hidden_states is not None]
        for p in batch.prompt_logprobs:
            targets = _put(p.seq.prompt_token_ids[p.first + 1 : p.first + 1 + p.count], torch.long, logits.device)
            out.prompt_logprobs.append(
                (p.seq, prompt_logprobs(logits[p.row : p.row + p.count], targets, p.seq.request.params.prompt_logprobs)))
        if batch.sample:
            rows = batch.sampling
            # without prompt-logprob rows, the logits rows are the sampling rows in order
            picked = _rows(logits, [r for _, r in batch.sample],
                           identity=not batch.prompt_logprobs and logits.shape[0] == len(batch.sample))
            sampled = (SampledTensors(picked, []).read() if picked.dim() == 1
                       else self.sampler(parts.mask_logits(picked) if parts.masks else picked, rows))
            out.sampled = [(seq, t, lp) for (seq, _), t, lp in zip(batch.sample, sampled.token_ids, sampled.logprobs)]
        return out

    @torch.inference_mode()
    def execute_decode(self, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """A step in which each of `seqs` (plain decode rows of the persistent batch: `Request.plain_decode`)
        computes one token: `execute`'s work without its per-row objects. -> each row's token, and its logprobs
        where any row asked (else None)."""
        return self.launch_decode(seqs).result()

    @torch.inference_mode()
    def launch_decode(self, seqs: list[Sequence], prev: DecodeLaunch | None = None) -> DecodeLaunch:
        """Launch `execute_decode`'s step and return before its results are back on the host (on a device: before
        they are computed). `prev`: the decode step still in flight whose samples are these rows' input tokens: they
        go from its device buffer straight into this step's, never through the host. Nothing here waits for the
        device: the rows' samples are copied to a pinned host buffer asynchronously, one copy, and an event marks
        when they are there (`DecodeLaunch.result` waits for it)."""
        n = len(seqs)
        prev_rows = np.fromiter((s.sample_row for s in seqs), np.int64, n) if prev is not None else None
        batch = self.buffers.prepare_decode(seqs, self.batch, self.graphs is None, prev_rows)
        if prev is not None:  # (n,): each row's input, its sample in `prev`
            batch.tokens.copy_(prev.tokens.index_select(0, self.buffers.dev["prev_rows"][:n]))
        ctx = ForwardContext(self.cache, batch.meta, batch.slices)
        path = self._choose(batch, ctx)
        greedy = self.batch.all_plain_greedy(seqs)  # an argmax a row: the rows' sampling state is not read
        out = self._forward(path, batch, ctx, greedy)
        self.path_counts[path] += 1
        if out.dim() == 1:  # the picks themselves (the native step's head)
            sampled = SampledTensors(out, [])
        elif greedy:
            sampled = self.sampler.sample(out.float(), None, plain_greedy=True)
        else:
            sampled = self.sampler.sample(out.float(), [s.sampling.row for s in seqs])
        k = self._parity = self._parity ^ 1  # the buffers the step before did not use
        tokens = self._sampled[k][:n]
        tokens.copy_(sampled.tokens)  # where the next step reads its input tokens
        host = self._out_host[k][: sampled.packed_size]
        host.copy_(sampled.pack(), non_blocking=True)
        for i, seq in enumerate(seqs):
            seq.sample_row = i
        return DecodeLaunch(list(seqs), batch.host_positions, sampled, tokens, host, self.stream.record(),
                            self.batch.removals)

    def host_buffers(self) -> list[Tensor]:
        """The host memory steps write inputs to and read results from (tests and benchmarks/host_overhead.py tell
        host reads of it, which wait for nothing, from reads of device memory)."""
        return self.buffers.host_buffers() + self._out_host

    def _choose(self, batch: StepBatch, ctx: ForwardContext) -> str:
        if self.graphs is not None and self.graphs.accepts(batch, ctx):
            return "cuda_graph"
        if self.native is not None and self.native.accepts(ctx):
            return "native"
        return "module"

    def _forward(self, path: str, batch: StepBatch, ctx: ForwardContext, greedy: bool = False) -> Tensor:
        """The step's logits (M, V) at its logits rows; with `greedy` (every such row plain greedy), on the native path,
        their greedy picks (M,) where the head makes them without the logits (`NativeStep.run`)."""
        if path == "cuda_graph":  # the graph's logits are one per token row: keep the logits rows (M, V)
            return _rows(self.graphs.run(batch, ctx.parts), batch.logits_rows,
                         identity=batch.logits_rows.numel() == batch.meta.num_tokens)
        if path == "native":
            return self.native.run(batch, ctx, greedy)
        return self.model(batch.tokens[None], batch.positions[None], ctx, logits_indices=batch.logits_rows)[0]


def _segments(scheduled: list[ScheduledSeq], batch: StepBatch) -> list[Segment]:
    """Each sequence's rows of the step, with its interventions and hidden-state read."""
    out = []
    for s, sl in zip(scheduled, batch.slices):
        seq = s.seq
        req = seq.request
        out.append(Segment(sl.start, seq.num_computed_tokens, s.num_new_tokens, req.interventions, req.hidden_states,
                           seq.num_prompt_tokens, seq.num_read_positions, owner=seq))
    return out


def _rows(x: Tensor, rows, identity: bool = False) -> Tensor:
    """x[rows], without a copy when the rows are 0..len-1 in order (the common decode case)."""
    return x if identity else x[rows]


def _prompt_positions(seq: Sequence, start: int, n: int) -> tuple[int, int] | None:
    """The prompt positions this chunk scores for prompt logprobs: (first, count), or None. Logits at position j
    score prompt token j + 1; positions scored before a preemption are skipped (and the scheduler never lets the
    prefix cache skip past the ones not scored yet)."""
    if seq.request.params.prompt_logprobs is None or seq.num_scored_prompt_positions >= seq.num_prompt_tokens - 1:
        return None
    assert start <= seq.num_scored_prompt_positions, "prompt logprobs would skip positions"
    first = max(start, seq.num_scored_prompt_positions)
    count = min(start + n, seq.num_prompt_tokens - 1) - first
    return (first, count) if count > 0 else None
