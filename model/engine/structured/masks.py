"""The token bitmask of a step's constrained rows, filled while the forward runs.

A row's mask depends only on its grammar state, which is final once the previous step's token was accepted, so it
can be filled before the step's logits exist. vLLM does this on its scheduler side, overlapped with the GPU forward
(`vllm/v1/structured_output/__init__.py`, `grammar_bitmask`); here the engine starts the fill on a worker thread just
before the forward and collects it just before sampling. llguidance's batched call (`LLExecutor`) computes every
row in one Python call, so the worker takes the GIL once per step, not once per row, and the forward's own Python
(module calls between kernels) is not interrupted row by row.

Layout (llguidance's and xgrammar's): bit t % 32 of int32 word t // 32 of a row set = token t allowed; the
buffer is allocated once for `max_rows` rows and reused every step (house rule 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from model.engine.sampler import AllowedTokens
from model.engine.structured.compiler import SequenceGrammar, import_llguidance


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


class GrammarMasks:
    """overlap=True fills on a worker thread (while the caller runs the forward); False fills on the caller's
    thread inside `start` (for measuring what the overlap buys: benchmarks/bench_structured.py)."""

    def __init__(self, vocab_size: int, max_rows: int, overlap: bool = True) -> None:
        self.words = (vocab_size + 31) // 32
        self.bitmask = torch.full((max(1, max_rows), self.words), -1, dtype=torch.int32)  # (R, W)
        self.overlap = overlap
        self._worker: ThreadPoolExecutor | None = None
        self._executor = None  # llguidance.LLExecutor, made on first use

    def start(self, rows: Sequence[tuple[SequenceGrammar | None, Sequence[int], int]]) -> PendingMasks | None:
        """rows: (grammar or None, output token ids, tokens left to max_tokens) per sampling row of the step, in the
        sampler's row order. None when no row is constrained. Each grammar is synced to its output first (a no-op
        unless they diverged); a JSON row near max_tokens gets a one-token mask from its closing plan (closing.py)."""
        constrained: list[tuple[int, SequenceGrammar]] = []
        for i, (grammar, output_token_ids, _) in enumerate(rows):
            if grammar is not None:
                grammar.sync(output_token_ids)
                constrained.append((i, grammar))
        if not constrained:
            return None
        if len(constrained) > self.bitmask.shape[0]:  # more rows than max_num_seqs promised: grow once
            self.bitmask = torch.full((len(constrained), self.words), -1, dtype=torch.int32)
        bitmask = self.bitmask[: len(constrained)]  # (M, W) view: rows 0..M-1 of the persistent buffer
        work = []
        for j, (i, g) in enumerate(constrained):
            forced = g.forced_token(rows[i][2])
            if forced is None:
                work.append((g.matcher, j))
            else:  # written here, before the fill starts: the worker never touches this row
                bitmask[j].zero_()
                bitmask[j, forced // 32] = _bit(forced % 32)
        if self.overlap:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llamascope-grammar")
            future = self._worker.submit(self._fill, work, bitmask)
        else:
            self._fill(work, bitmask)
            future = None
        return PendingMasks(future, bitmask, [i for i, _ in constrained])

    def _fill(self, work: list, bitmask: torch.Tensor) -> None:
        if not work:
            return
        if self._executor is None:
            # One thread: on a small CPU the forward owns the cores; the batched call is for the GIL, not for speed.
            self._executor = import_llguidance().LLExecutor(num_threads=1)
        # A matcher in an error state or past its end writes the EOS-only mask (llguidance's contract).
        self._executor.unsafe_compute_mask_ptr(work, bitmask.data_ptr(), self.words * 4, bitmask.shape[0])

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
