"""The model runner: one step's execution, in one place (vLLM's `gpu_model_runner`).

`execute(scheduled)`:
    1. writes the step's inputs into persistent buffers (tokens, positions, KV slots, block tables, logits rows),
       and the rows' interventions and hidden-state reads into one table (model/edits.py) when any row has some;
    2. chooses the execution path from the step's batch and the model's layers, and records which ran:
           cuda_graph     a pure decode step replayed as the CUDA graph of its batch-size bucket
           native         any step (decode, prefill chunks, both) through every block in one native call (CPU,
                          where every row attends over the paged pool: `PagedKVCache.paged_prefill`)
           module         the model's modules, one call each (CUDA prefill and mixed steps, tensor parallelism,
                          the PyTorch reference ops)
       All three compute the same logits (the module path is the reference; tests hold the others to it);
    3. runs it, scores prompt logprobs, and samples every sequence that caught up (a constrained one from the
       tokens its grammar allows: the masks are started before the forward, model/engine/structured/).

The model is a function (tokens, positions, attention context) -> logits and knows none of this.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from model.edits import EditTables, Segment, gather_reads
from model.engine.cuda_graphs import CudaGraphs, buckets
from model.engine.forward_context import ForwardContext
from model.engine.input_batch import InputBuffers, StepBatch
from model.engine.native_decode import NativeDecode
from model.engine.paged_cache import PagedKVCache
from model.engine.request import Sequence
from model.engine.sampler import Sampler, TokenLogprobs, prompt_logprobs
from model.engine.scheduler import ScheduledSeq
from model.engine.telemetry import TokenTelemetry, step_telemetry

if TYPE_CHECKING:
    from model.engine.structured import StructuredOutputs

log = logging.getLogger("llamascope.engine")

PATHS = ("cuda_graph", "native", "module")


@dataclass
class RunnerOutput:
    """What one step computed: the path it took, each sampled row's token (one per sequence that caught up; a
    drafting sequence's 1 + drafts rows in order), prompt logprobs scored, and the hidden states read: (sequence,
    positions, (n_positions, n_layers, D) float32), and how far each reading sequence has now been read."""

    path: str
    sampled: list[tuple[Sequence, int, TokenLogprobs | None]] = field(default_factory=list)
    prompt_logprobs: list[tuple[Sequence, list[TokenLogprobs]]] = field(default_factory=list)
    hidden_states: list[tuple[Sequence, list[int], Tensor]] = field(default_factory=list)
    read_upto: list[tuple[Sequence, int]] = field(default_factory=list)
    telemetry: dict[Sequence, list[TokenTelemetry]] = field(default_factory=dict)  # per sampled row, where asked


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, sampler: Sampler, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int, graph_mode: str, native_decode: bool,
                 scratch_block: int | None, structured: StructuredOutputs | None = None) -> None:
        self.model, self.cache, self.sampler = model, cache, sampler
        self.structured = structured  # grammar masks of constrained rows (model/engine/structured/)
        bs = cache.block_size
        rows = buckets(max_num_seqs)[-1] if scratch_block is not None else max_num_seqs  # a graph's padded batch
        self.buffers = InputBuffers(max(max_num_batched_tokens, rows), rows, -(-max_model_len // bs), bs, cache.device)
        self.native = NativeDecode.for_model(model) if native_decode else None
        self.graphs = CudaGraphs(model, cache, self.buffers, scratch_block, max_num_seqs, capture=graph_mode == "auto") \
            if scratch_block is not None else None
        self.path_counts: Counter[str] = Counter({p: 0 for p in PATHS})
        self.tables = EditTables(model.config.n_layers, model.config.dim, cache.device)

    def capture_graphs(self) -> None:
        if self.graphs is not None and self.graphs.capture:
            self.graphs.capture_all()

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> RunnerOutput:
        paged_prefill = self.cache.paged_prefill  # asked once per step: the pools' attention backend decides it
        batch = self.buffers.prepare(scheduled, _prompt_positions, paged_prefill)
        layouts = []
        if any(s.seq.request.interventions is not None or s.seq.request.hidden_states is not None for s in scheduled):
            batch.edits, layouts = self.tables.build(_segments(scheduled, batch))
        tel = step_telemetry(scheduled, batch.slices, batch.sample, self.model, self.cache.device, paged_prefill)
        # the step as every path reads it; telemetry None unless a sampled sequence asked: then nothing changes
        ctx = ForwardContext(self.cache, batch.meta, batch.slices, batch.edits, tel)
        # [structured outputs] the sampling rows' grammar masks, filled on a worker thread during the forward
        masks = self.structured.start_masks(_mask_rows(batch.sample)) if self.structured is not None else None
        path = self._choose(batch, ctx)
        with tel.hidden_hooks(self.model) if tel is not None and path == "module" else contextlib.nullcontext():
            logits = self._forward(path, batch, ctx).float()  # (M, V): the batch's logits rows
        self.path_counts[path] += 1
        out = RunnerOutput(path, telemetry=tel.results() if tel is not None else {})
        if batch.edits is not None:
            for layout in layouts:
                out.hidden_states.append((layout[0].owner, layout[1], gather_reads(batch.edits, layout)))
            out.read_upto = [(s.seq, s.seq.num_computed_tokens + s.num_new_tokens) for s in scheduled
                             if s.seq.request.hidden_states is not None]
        for p in batch.prompt_logprobs:
            targets = torch.tensor(p.seq.prompt_token_ids[p.first + 1 : p.first + 1 + p.count], device=logits.device)
            out.prompt_logprobs.append(
                (p.seq, prompt_logprobs(logits[p.row : p.row + p.count], targets, p.seq.request.params.prompt_logprobs)))
        if batch.sample:
            rows = batch.sampling
            # without prompt-logprob rows, the logits rows are the sampling rows in order
            picked = _rows(logits, [r for _, r in batch.sample],
                           identity=not batch.prompt_logprobs and logits.shape[0] == len(batch.sample))
            sampled = self.sampler(picked, rows, masks.result() if masks is not None else None)
            out.sampled = [(seq, t, lp) for (seq, _), t, lp in zip(batch.sample, sampled.token_ids, sampled.logprobs)]
        return out

    def _choose(self, batch: StepBatch, ctx: ForwardContext) -> str:
        if self.graphs is not None and self.graphs.accepts(batch, ctx):
            return "cuda_graph"
        if self.native is not None and self.native.accepts(ctx):
            return "native"
        return "module"

    def _forward(self, path: str, batch: StepBatch, ctx: ForwardContext) -> Tensor:
        if path == "cuda_graph":  # the graph's logits are one per token row: keep the logits rows (M, V)
            return _rows(self.graphs.run(batch), batch.logits_rows,
                         identity=batch.logits_rows.numel() == batch.meta.num_tokens)
        if path == "native":
            return self.native.run(batch, ctx)
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


def _mask_rows(sample: list[tuple[Sequence, int]]) -> list[tuple]:
    """[structured outputs] One entry per sampling row: (grammar, output token ids, tokens left, drafts) for a
    sequence's first row (drafts: the rows after it verify them, masked as the grammar stands after each draft),
    (None, (), 0, ()) for those rows."""
    rows, prev = [], None
    for seq, _ in sample:
        if seq is prev:
            rows.append((None, (), 0, ()))
        else:
            rows.append((seq.sampling.grammar, seq.output_token_ids,
                         seq.request.params.max_tokens - len(seq.output_token_ids), seq.draft_token_ids))
        prev = seq
    return rows


def _prompt_positions(seq: Sequence, start: int, n: int) -> tuple[int, int] | None:
    """The prompt positions this chunk scores for prompt logprobs: (first, count), or None. Logits at position j
    score prompt token j + 1; positions scored before a preemption are skipped (and the scheduler never lets the
    prefix cache skip past the ones not scored yet). A sequence with no output side (a draft model's shadow,
    model/engine/speculative/draft_model.py) scores none."""
    state = seq.output
    if state is None or state.prompt_logprobs is None or len(state.prompt_logprobs) >= seq.num_prompt_tokens:
        return None
    assert start <= seq.num_scored_prompt_positions, "prompt logprobs would skip positions"
    first = max(start, seq.num_scored_prompt_positions)
    count = min(start + n, seq.num_prompt_tokens - 1) - first
    return (first, count) if count > 0 else None
