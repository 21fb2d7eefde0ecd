"""A step's inputs, written into buffers allocated once (vLLM's `gpu_model_runner` persistent input buffers).

Each step the runner writes the scheduled sequences' tokens, positions (cache positions: a kv_window's sequence
computes each token at its position within the cache, model/engine/kv_window.py), KV slots, the decode rows' block tables and
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
from model.engine.paged_cache import AttentionMetadata, SeqSlice, prefill_chunk
from model.engine.request import Sequence
from model.engine.sampler import SamplingRow
from model.engine.scheduler import ScheduledSeq


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


class InputBuffers:
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device) -> None:
        self.block_size, self.device = block_size, torch.device(device)
        pin = self.device.type == "cuda"
        T, S, W = max_num_tokens, max_num_seqs, max_blocks_per_seq
        # Host side: int64 tensors and numpy views of the same memory (numpy writes are cheap per element).
        self.host = {
            "tokens": torch.zeros(T, dtype=torch.long, pin_memory=pin),
            "positions": torch.zeros(T, dtype=torch.long, pin_memory=pin),
            "slots": torch.zeros(T, dtype=torch.long, pin_memory=pin),
            "logits_rows": torch.zeros(T + S, dtype=torch.long, pin_memory=pin),  # prompt-logprob rows + one per seq
            # rows attending over their block tables: decode rows, and every row when prefill rows do too
            "decode_rows": torch.zeros(T, dtype=torch.long, pin_memory=pin),
            "decode_lens": torch.zeros(T, dtype=torch.long, pin_memory=pin),
            # (T, W): 84 MB at 8,192 tokens a step and 20,480 a sequence, most of it never used on the CPU (a decode
            # step writes a row per sequence). There numpy's calloc maps it as zero pages the kernel faults in when
            # first written, where torch.zeros wrote every page (0.16 s of start-up); pinned for a GPU as the rest.
            "decode_tables": (torch.from_numpy(np.zeros((T, W), dtype=np.int64)) if self.device.type == "cpu"
                              else torch.zeros(T, W, dtype=torch.long, pin_memory=pin)),
        }
        self.np = {name: t.numpy() for name, t in self.host.items()}
        # Device side: the same buffers where the model runs (the host ones themselves on the CPU).
        self.dev = self.host if self.device.type == "cpu" else {n: t.to(self.device) for n, t in self.host.items()}
        self.max_num_tokens, self.max_num_seqs, self.width = T, S, W

    def prepare(self, scheduled: list[ScheduledSeq], wants_prompt_logprobs, paged_prefill: bool = False) -> StepBatch:
        """Write the step's inputs; `wants_prompt_logprobs(seq, start, n)` -> (first, count) of prompt positions
        to score in this chunk, or None. `paged_prefill` (`PagedKVCache.paged_prefill`): prefill rows, too, attend
        one by one over their block tables, each up to its own position, as decode rows do."""
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
                np_["decode_rows"][r] = off
                np_["decode_lens"][r] = c0 + 1
                np_["decode_tables"][r, : len(blocks)] = blocks
                r += 1
            else:
                np_["tokens"][off : off + n] = seq.token_ids(start, start + n)
                pos = np.arange(c0, c0 + n)
                np_["positions"][off : off + n] = pos
                np_["slots"][off : off + n] = np.asarray(blocks)[pos // bs] * bs + pos % bs
                if paged_prefill:
                    np_["decode_rows"][r : r + n] = np.arange(off, off + n)
                    np_["decode_lens"][r : r + n] = pos + 1
                    np_["decode_tables"][r : r + n, : len(blocks)] = blocks
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
        if dev.type != "cpu":
            for name, used in (("tokens", off), ("positions", off), ("slots", off), ("logits_rows", m),
                               ("decode_rows", r), ("decode_lens", r), ("decode_tables", r)):
                self.dev[name][:used].copy_(self.host[name][:used], non_blocking=True)
        d = self.dev
        meta = AttentionMetadata(
            slot_mapping=d["slots"][:off], decode_rows=d["decode_rows"][:r], decode_tables=d["decode_tables"][:r],
            decode_lens=d["decode_lens"][:r], prefills=[prefill_chunk(p, bs, dev) for p in prefill],
        )
        return StepBatch(d["tokens"][:off], d["positions"][:off], d["logits_rows"][:m], meta, slices, sample, sampling,
                         prompt_rows)


def _sampling_row(seq: Sequence, i: int) -> SamplingRow:
    """The sampling row of `seq`'s i-th sampled row this step. A drafting sequence's rows are sampled as if the drafts
    before each were accepted (their tokens count as output for penalties): the only case in which that row's token
    is kept (`Engine._resolve_drafts`)."""
    output = seq.output_token_ids + seq.draft_token_ids[:i] if i else seq.output_token_ids
    return SamplingRow(seq.request.params, seq.prompt_token_ids, output, seq.sampling.generator, seq.sampling.stop_ids)
