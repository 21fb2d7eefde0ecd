"""A step's inputs, written into buffers allocated once (vLLM's `gpu_model_runner` persistent input buffers).

Each step the runner writes the scheduled sequences' tokens, positions (cache positions: a kv_window's sequence
computes each token at its position within the cache, model/features/kv_window/schedule.py), KV slots, the decode rows' block tables and
context lengths, and the rows whose logits it needs into preallocated host tensors through numpy views (no tensor
is created from a Python list on the decode path), then hands the model views of their first N entries (copied to
the device's own persistent buffers off the CPU). Prefill chunks with a cached prefix also get their block list
and causal mask, built per step: a prefill step's cost is its matmuls, not this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from model.edits import StepEdits
from model.engine.paged_cache import AttentionMetadata, PrefillChunk, SeqSlice, prefill_chunk
from model.engine.persistent_batch import PersistentBatch
from model.engine.request import Sequence
from model.engine.sampler import SamplingRow
from model.engine.scheduler import ScheduledSeq
from model.kernels import ops


@dataclass
class PromptLogprobRows:
    """Logits rows [row, row + count) of a step score prompt tokens first + 1 .. first + count of `seq`."""

    seq: Sequence
    row: int
    first: int
    count: int


@dataclass
class StepBatch:
    """One step's inputs as the model and the sampler read them (views into `InputBuffers`)."""

    tokens: Tensor  # (N,) on the model's device
    positions: Tensor  # (N,)
    logits_rows: Tensor  # (M,) packed rows whose logits are computed
    meta: AttentionMetadata
    slices: list[SeqSlice]  # the same, as plain data (tensor-parallel ranks rebuild the metadata from it)
    # (sequence, logits row) to sample this step: one per sequence that caught up, 1 + its drafts for a drafting one
    sample: list[tuple[Sequence, int]] = field(default_factory=list)
    # what the sampler reads of each of those rows (its parameters, the tokens so far, the seeded generator, the ids
    # that end it): the rows' sampling state, the runner's to hand to the sampler
    sampling: list[SamplingRow] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobRows] = field(default_factory=list)
    edits: StepEdits | None = None  # the rows' interventions and hidden-state reads (model/edits.py), if any
    num_seqs: int = 0  # sequences in the step (a pure decode step: one token each)
    host_positions: np.ndarray | None = None  # (N,) the positions, on the host (the decode path keeps them)


# The per-token fields, each a row of one (F, capacity) int64 array: where they live on the host and the device
FIELDS = ("tokens", "positions", "slots", "logits_rows", "paged_rows", "paged_lens", "prev_rows")


class InputBuffers:
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, separate: bool | None = None, table_rows: int | None = None) -> None:
        """`separate`: the device reads buffers of its own, filled from the host's with one copy a step (a GPU, the
        default off the CPU; or a CPU device that runs beside the host: the simulated one of
        benchmarks/host_overhead.py). The host then keeps two sets and uses them in turn, so a step prepared while
        the previous one runs never writes memory that step's copy may not have read yet. `table_rows`: the block
        tables a step can have (None: one per token; `max_num_seqs` where only decode rows attend over their tables,
        not prefill rows, i.e. off the native kernel): the separate sets' tables are pinned memory, which is never
        paged in lazily, so they are sized to what is read."""
        self.block_size, self.device = block_size, torch.device(device)
        T, S, W = max_num_tokens, max_num_seqs, max_blocks_per_seq
        C = T + S  # a field's capacity: logits rows are prompt-logprob rows + one per sequence
        F = len(FIELDS)
        self.separate = self.device.type != "cpu" if separate is None else separate
        self.max_num_tokens, self.max_num_seqs, self.width = max_num_tokens, S, W
        self._fields_size = F * C
        if self.separate and table_rows is not None:
            T = min(T, table_rows)  # (a (T, W) table at 8,192 tokens a step and a 128k context is 512 MB a set)
        if not self.separate:
            # (T, W) tables: 84 MB at 8,192 tokens a step and 20,480 a sequence, most of it never used on the CPU (a
            # decode step writes a row per sequence); numpy's calloc maps it as zero pages the kernel faults in when
            # first written, where torch.zeros writes every page at start-up.
            fields = torch.zeros(F, C, dtype=torch.long)
            tables = torch.from_numpy(np.zeros((T, W), dtype=np.int64))
            self._sets = [(None, fields, tables)]
            self.dev = self._views(fields, tables)
        else:
            pin = self.device.type == "cuda"
            self._sets = []
            for _ in range(2):
                stage = torch.zeros(F * C + T * W, dtype=torch.long, pin_memory=pin)  # [fields | tables]
                self._sets.append((stage, stage[: F * C].view(F, C), stage[F * C :].view(T, W)))
            self._dev_stage = torch.zeros(F * C + T * W, dtype=torch.long, device=self.device)
            self.dev = self._views(self._dev_stage[: F * C].view(F, C), self._dev_stage[F * C :].view(T, W))
        # each set's views, made once: a step switches sets by reference (a numpy view of a tensor is four
        # dispatcher calls, a field's tensor view one more)
        self._set_views = []
        for _, fields, tables in self._sets:
            host = self._views(fields, tables)
            self._set_views.append((host, {name: t.numpy() for name, t in host.items()}))
        self._set = 0
        self._use(0)
        self._arange = np.arange(C)
        self._tables_of, self._tables = None, None

    @staticmethod
    def _views(fields: Tensor, tables: Tensor) -> dict[str, Tensor]:
        views = {name: fields[i] for i, name in enumerate(FIELDS)}
        views["paged_tables"] = tables
        return views

    def _use(self, k: int) -> None:
        self.host, self.np = self._set_views[k]

    def _next_set(self) -> None:
        """The other host set, for a step prepared while the previous one may still be copying from this one."""
        if len(self._sets) > 1:
            self._set ^= 1
            self._use(self._set)

    def _upload(self, table_rows: int) -> None:
        """The step's inputs to the device buffers: every field and the first `table_rows` block tables, in one copy
        of the host set's leading part."""
        if self.separate:
            n = self._fields_size + table_rows * self.width
            self._dev_stage[:n].copy_(self._sets[self._set][0][:n], non_blocking=True)

    def host_buffers(self) -> list[Tensor]:
        """The host memory steps write their inputs to (a test tells them from device memory by this)."""
        return [t for st in self._sets for t in st if t is not None]

    def prepare(self, scheduled: list[ScheduledSeq], wants_prompt_logprobs, paged_prefill: bool = False,
                prefill_tiles: bool = False) -> StepBatch:
        """Write the step's inputs; `wants_prompt_logprobs(seq, start, n)` -> (first, count) of prompt positions
        to score in this chunk, or None. `paged_prefill` (`PagedKVCache.paged_prefill`): prefill rows, too, attend
        one by one over their block tables, each up to its own position, as decode rows do. `prefill_tiles`
        (`PagedKVCache.prefill_tiles`): prefill chunks attend over their blocks in one kernel, by tiles."""
        self._next_set()
        np_, bs = self.np, self.block_size
        slices: list[SeqSlice] = []
        sample: list[tuple[Sequence, int]] = []
        sampling: list[SamplingRow] = []
        prompt_rows: list[PromptLogprobRows] = []
        prefill: list[SeqSlice] = []
        off = m = r = 0
        for s in scheduled:
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            c0 = start - seq.num_evicted  # its cache position: the token's own, less what a kv_window evicted
            blocks = seq.block_ids
            if n == 1:  # decode (or a one-token chunk): attends over its block table
                np_["tokens"][off] = seq.token_ids(start, start + 1)[0]
                np_["positions"][off] = c0
                np_["slots"][off] = blocks[c0 // bs] * bs + c0 % bs
                np_["paged_rows"][r] = off
                np_["paged_lens"][r] = c0 + 1
                np_["paged_tables"][r, : len(blocks)] = blocks
                r += 1
            else:
                np_["tokens"][off : off + n] = seq.token_ids(start, start + n)
                pos = np.arange(c0, c0 + n)
                np_["positions"][off : off + n] = pos
                np_["slots"][off : off + n] = np.asarray(blocks)[pos // bs] * bs + pos % bs
                if paged_prefill:
                    np_["paged_rows"][r : r + n] = np.arange(off, off + n)
                    np_["paged_lens"][r : r + n] = pos + 1
                    np_["paged_tables"][r : r + n, : len(blocks)] = blocks
                    r += n
            sl = SeqSlice(off, n, c0 + n, blocks)
            slices.append(sl)
            if n > 1 and not paged_prefill:
                prefill.append(sl)
            scored = wants_prompt_logprobs(seq, start, n)
            if scored is not None:
                first, count = scored
                prompt_rows.append(PromptLogprobRows(seq, m, first, count))
                np_["logits_rows"][m : m + count] = np.arange(off + first - start, off + first - start + count)
                m += count
            if start + n == seq.num_tokens:  # caught up: its next token is sampled from this step's last row, and
                # with drafts each draft is checked against the row before it: the last 1 + drafts rows are sampled
                d = len(seq.draft_token_ids)
                for i in range(n - 1 - d, n):
                    sample.append((seq, m))
                    sampling.append(_sampling_row(seq, i - (n - 1 - d)))
                    np_["logits_rows"][m] = off + i
                    m += 1
            off += n
        dev = self.device
        self._upload(r)
        d = self.dev
        meta = AttentionMetadata(
            slot_mapping=d["slots"][:off], paged_rows=d["paged_rows"][:r], paged_tables=d["paged_tables"][:r],
            paged_lens=d["paged_lens"][:r],
        )
        if prefill_tiles and prefill:  # every chunk in one kernel launch: its tiles and the chunks' block tables
            width = max(len(p.block_ids) for p in prefill)
            tiles = ops.prefill_tiles([(p.start, p.num_new, p.context_len - p.num_new) for p in prefill])
            meta.prefill_tiles = _small(tiles, dev)  # (Tn, 4)
            meta.prefill_tables = _small([(p.block_ids + [0] * width)[:width] for p in prefill], dev)  # (C, W)
            meta.prefills = [PrefillChunk(p.start, p.start + p.num_new, p.context_len, None, None) for p in prefill]
        else:
            meta.prefills = [prefill_chunk(p, bs, dev) for p in prefill]
        return StepBatch(d["tokens"][:off], d["positions"][:off], d["logits_rows"][:m], meta, slices, sample, sampling,
                         prompt_rows, num_seqs=len(scheduled))

    def prepare_decode(self, seqs: list[Sequence], batch: PersistentBatch, tables_in_place: bool,
                       prev_rows: np.ndarray | None = None) -> StepBatch:
        """A step in which each of `seqs` (rows of the persistent batch, none windowed) computes one token: the same
        inputs as `prepare` writes, from whole-batch numpy operations and the batch's block tables. With
        `tables_in_place` and `seqs` the batch's rows 0..n-1 in order, the kernels read the batch's tables where they
        are (the CPU), else the rows' tables are copied into the step's buffer. `prev_rows`: each row's input token
        is not on the host yet but sampled by the step before, at that row of its samples (`prev_rows` field)."""
        self._next_set()
        n, bs, np_ = len(seqs), self.block_size, self.np
        batch.sync()
        pos = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, n)  # each row's position (n,)
        slots = np.fromiter((s.slot for s in seqs), np.int64, n)  # its row in the batch (n,)
        rows = self._arange[:n]
        in_order = n == len(batch) and (n == 0 or (slots[0] == 0 and slots[-1] == n - 1))
        width = -(-int(pos.max(initial=0) + 1) // bs)  # the widest row's blocks: nothing past them is read
        # (n, width): a gather of the rows' used blocks only (a table is max_model_len / block_size wide)
        tables = batch.tables[:n] if in_order else batch.tables[:, :width][slots]
        if prev_rows is None:
            np_["tokens"][:n] = [s.last_token_id for s in seqs]
        else:
            np_["prev_rows"][:n] = prev_rows
        np_["positions"][:n] = pos
        np_["slots"][:n] = tables[rows, pos // bs] * bs + pos % bs
        np_["paged_rows"][:n] = rows
        np_["paged_lens"][:n] = pos + 1
        np_["logits_rows"][:n] = rows
        paged_tables = None
        if tables_in_place and in_order and not self.separate:
            paged_tables = self._batch_tables(batch)[:n]
        else:
            np_["paged_tables"][:n, :width] = tables[:, :width]
        self._upload(n if paged_tables is None else 0)
        d = self.dev
        meta = AttentionMetadata(slot_mapping=d["slots"][:n], paged_rows=d["paged_rows"][:n],
                                 paged_tables=d["paged_tables"][:n] if paged_tables is None else paged_tables,
                                 paged_lens=d["paged_lens"][:n])
        return StepBatch(d["tokens"][:n], d["positions"][:n], d["logits_rows"][:n], meta, [], num_seqs=n,
                         host_positions=pos)

    def _batch_tables(self, batch: PersistentBatch):
        """The persistent batch's tables as a tensor over the same memory (made once)."""
        if self._tables_of is not batch:
            self._tables_of, self._tables = batch, torch.from_numpy(batch.tables)
        return self._tables


def _small(rows: list, device: torch.device) -> Tensor:
    """A small int64 table of a step (prefill tiles, their block tables) on `device`, from pinned memory without a
    blocking copy."""
    t = torch.tensor(rows, dtype=torch.long)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def _sampling_row(seq: Sequence, i: int) -> SamplingRow:
    """The sampling row of `seq`'s i-th sampled row this step. A drafting sequence's rows are sampled as if the drafts
    before each were accepted (their tokens count as output for penalties): the only case in which that row's token
    is kept (`Verification.resolve`, speculative/verification.py)."""
    output = seq.output_token_ids + seq.draft_token_ids[:i] if i else seq.output_token_ids
    return SamplingRow(seq.request.params, seq.prompt_token_ids, output, seq.sampling.generator, seq.sampling.stop_ids)
