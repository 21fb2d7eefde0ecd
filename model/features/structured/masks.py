"""The token bitmask of a step's constrained rows, filled while the forward runs, and applied to their logits
before the sampler reads them (the step's `Part.mask_logits`, model/features/protocol.py).

A row's mask depends only on its grammar state, which is final once the previous step's token was accepted, so it
can be filled before the step's logits exist. vLLM does this on its scheduler side, overlapped with the GPU forward
(`vllm/v1/structured_output/__init__.py`, `grammar_bitmask`); here the engine starts the fill on a worker thread just
before the forward and collects it just before sampling. llguidance's batched call (`LLExecutor`) computes every
row in one Python call, so the worker takes the GIL once per step, not once per row, and the forward's own Python
(module calls between kernels) is not interrupted row by row.

Layout (llguidance's and xgrammar's): bit t % 32 of int32 word t // 32 of a row set = token t allowed; the
buffer is allocated once for `max_rows` rows and reused every step (docs/development.md rule 5).

The mask comes first, before anything reads the logits (vLLM applies its bitmask before its sampler too,
`vllm/v1/structured_output/__init__.py`): for a constrained row everything the sampler does, logprobs included,
sees the masked logits, so its logprobs are the model's distribution renormalised over the allowed tokens. Other
rows are untouched, to the bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from model.features.protocol import Part
from model.features.structured.compiler import SequenceGrammar, import_llguidance

_NEG_INF = float("-inf")


@dataclass
class AllowedTokens:
    """Per-row allowed-token bitmasks for some rows of a batch. Layout as llguidance and xgrammar write it: bit
    t % 32 of int32 word t // 32 set = token t allowed; tokens past the last word are not."""

    bitmask: Tensor  # (M, ceil(V / 32)) int32, on any device
    rows: list[int]  # (M,) the batch rows the masks belong to, in bitmask row order


def _bit(b: int) -> int:
    """int32 word with bit b set (bit 31 is the sign bit)."""
    return (1 << b) - (1 << 32 if b == 31 else 0)


class PendingMasks:
    """The masks of one step, being filled; `result()` waits for them (and re-raises a fill's failure)."""

    def __init__(self, future: Future | None, bitmask: torch.Tensor, rows: list[int]) -> None:
        self._future, self._bitmask, self._rows = future, bitmask, rows

    def result(self) -> AllowedTokens:
        if self._future is not None:
            self._future.result()
        return AllowedTokens(self._bitmask, self._rows)


class StepMasks(Part):
    """The constrained rows' masks of one step: started before the forward, applied to the sampled rows' logits
    after it (`mask_logits`, which waits for the fill). Any path: the mask reads the logits, not the forward."""

    def __init__(self, pending: PendingMasks, shifts: Tensor) -> None:
        self.pending, self.shifts = pending, shifts

    def mask_logits(self, logits: Tensor) -> Tensor:
        return _apply_allowed(logits, self.pending.result(), self.shifts)


def _forbidden(allowed: AllowedTokens, V: int, shifts: Tensor) -> Tensor:
    """(M, V) bool, True where the row's grammar forbids the token. A CPU bitmask is unpacked by numpy (one
    single-threaded pass writing M x V bytes); a device bitmask by shifts, on its device."""
    words = allowed.bitmask
    if words.device.type == "cpu":
        bits = torch.from_numpy(np.unpackbits(words.contiguous().numpy().view(np.uint8), axis=1, bitorder="little"))
    else:
        bits = ((words.unsqueeze(-1) >> shifts.to(words.device)) & 1).reshape(words.shape[0], -1)  # (M, W * 32)
    if bits.shape[1] < V:  # a mask narrower than the vocabulary allows nothing beyond it
        bits = torch.nn.functional.pad(bits, (0, V - bits.shape[1]))
    return bits[:, :V] == 0


def _apply_allowed(logits: Tensor, allowed: AllowedTokens, shifts: Tensor) -> Tensor:
    """A (B, V) float32 copy of logits with -inf where a constrained row's grammar forbids the token; every other
    value, and every unconstrained row, is the input's own value (bit-identical). shifts: (32,) int32 bit positions."""
    x = logits.to(torch.float32, copy=True)
    if x.device.type != "cpu" and allowed.bitmask.device.type == "cpu":
        # the packed words (M, ceil(V / 32)) go to the device from pinned memory without a wait, and are unpacked
        # there: never the (M, V) bytes of an unpacked mask from pageable memory, which a copy waits on
        allowed = AllowedTokens(allowed.bitmask.pin_memory().to(x.device, non_blocking=True), allowed.rows)
    forbidden = _forbidden(allowed, x.shape[1], shifts)  # (M, V) on x's device
    if allowed.rows == list(range(x.shape[0])):  # every row constrained (a single stream, say): in place, no gather
        return x.masked_fill_(forbidden, _NEG_INF)
    idx = torch.tensor(allowed.rows, dtype=torch.long)  # (M,)
    if x.device.type != "cpu":  # (through pinned memory: the host never waits for the device to take it)
        idx = idx.pin_memory().to(x.device, non_blocking=True)
    x[idx] = x[idx].masked_fill_(forbidden, _NEG_INF)
    return x


class GrammarMasks:
    """overlap=True fills on a worker thread (while the caller runs the forward); False fills on the caller's
    thread inside `start` (for measuring what the overlap buys: benchmarks/bench_structured.py)."""

    def __init__(self, vocab_size: int, max_rows: int, overlap: bool = True) -> None:
        self.words = (vocab_size + 31) // 32
        self.bitmask = torch.full((max(1, max_rows), self.words), -1, dtype=torch.int32)  # (R, W)
        self.overlap = overlap
        self._worker: ThreadPoolExecutor | None = None
        self._executor = None  # llguidance.LLExecutor, made on first use

    def start(self, rows: Sequence[tuple[SequenceGrammar | None, Sequence[int], int, Sequence[int]]]) -> PendingMasks | None:
        """rows: (grammar or None, output token ids, tokens left to max_tokens, drafts) per sampling row of the
        step, in the sampler's row order; a row with d drafts (speculative decoding) is followed by the d rows that
        verify them, whose masks are the grammar's after each draft (llguidance's draft-token masks; the engine
        drafts only tokens the grammar accepts, and never near max_tokens, where a closing plan may force tokens).
        None when no row is constrained. Each grammar is synced to its output first (a no-op unless they
        diverged); a JSON row near max_tokens gets a one-token mask from its closing plan (closing.py)."""
        constrained: list[tuple[int, SequenceGrammar | None]] = []  # (sampler row, grammar; None: a draft's row)
        for i, (grammar, output_token_ids, _, drafts) in enumerate(rows):
            if grammar is not None:
                grammar.sync(output_token_ids)
                constrained.append((i, grammar))
                constrained += [(i + 1 + t, None) for t in range(len(drafts))]
        if not constrained:
            return None
        if len(constrained) > self.bitmask.shape[0]:  # more rows than max_num_seqs promised: grow once
            self.bitmask = torch.full((len(constrained), self.words), -1, dtype=torch.int32)
        bitmask = self.bitmask[: len(constrained)]  # (M, W) view: rows 0..M-1 of the persistent buffer
        work, drafted = [], []
        for j, (i, g) in enumerate(constrained):
            if g is None:
                bitmask[j].fill_(-1)  # a draft's row: written by the fill (left open should a draft end the grammar)
                continue
            drafts = list(rows[i][3])
            forced = g.forced_token(rows[i][2]) if not drafts else None
            if drafts:
                drafted.append((g.matcher, j, drafts))
            elif forced is None:
                work.append((g.matcher, j))
            else:  # written here, before the fill starts: the worker never touches this row
                bitmask[j].zero_()
                bitmask[j, forced // 32] = _bit(forced % 32)
        if self.overlap:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llamascope-grammar")
            future = self._worker.submit(self._fill, work, bitmask, drafted)
        else:
            self._fill(work, bitmask, drafted)
            future = None
        return PendingMasks(future, bitmask, [i for i, _ in constrained])

    def _fill(self, work: list, bitmask: torch.Tensor, drafted: list = ()) -> None:
        if not work and not drafted:
            return
        if self._executor is None:
            # One thread: on a small CPU the forward owns the cores; the batched call is for the GIL, not for speed.
            self._executor = import_llguidance().LLExecutor(num_threads=1)
        # A matcher in an error state or past its end writes the EOS-only mask (llguidance's contract).
        if work:
            self._executor.unsafe_compute_mask_ptr(work, bitmask.data_ptr(), self.words * 4, bitmask.shape[0])
        if drafted:  # row j and, after each draft, row j + 1 + t; the matcher is left as it was
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), self.words * 4,
                                                                    bitmask.shape[0])

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
