"""The running sequences' state that a decode step reads, kept in arrays allocated once (vLLM's persistent batch:
v1/worker/gpu_input_batch.py and block_table.py).

One row (slot) per running sequence; rows 0..n-1 are in use and stay packed: when a sequence leaves, the last row
moves into its place (vLLM's `condense`), so a step over every running sequence reads rows 0..n-1 as they are,
without a gather. What a row holds is written when it changes, not rebuilt each step:

    tables    (S, W) int64   each sequence's block table (the decode kernels read a row's first ceil(len / bs))

A block table changes only when the KV manager gives a sequence blocks or takes them back; `sync` writes the rows
whose block list changed since it last looked: the appended entries alone in the common case of a new block at the
end, the whole row after anything else (`Sequence.block_table_version`, which the KV manager bumps). Between steady
decode steps the only change is a block appended for a row's next token, which the decode scheduler reports
(`grew`): `sync` then visits those rows alone, and every row only after a step of any other kind (`stale`), whose
scheduling, preemptions, rollbacks or evictions may have changed any block list. Torch-free: the runner wraps the
arrays once as tensors.

The batch also counts what the decode path asks of all its rows every step, so that it is not asked row by row: the
rows whose request cannot be launched ahead of its previous token (`Request.overlappable`), those not plain greedy,
and the removals since start (a launch whose rows saw no removal has every row still running).
"""

from __future__ import annotations

import numpy as np

from model.engine.request import Sequence


class PersistentBatch:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        S, W = max_num_seqs, max_blocks_per_seq
        self.seqs: list[Sequence] = []  # by slot
        self.tables = np.zeros((S, W), dtype=np.int64)  # (S, W)
        self._table_len = np.zeros(S, dtype=np.int64)  # entries written, per slot
        self._table_version = np.full(S, -1, dtype=np.int64)  # the sequence's block_table_version when written
        self._synced = False  # every row written as its block list stands, but for the rows reported by `grew`
        self._grown: list[Sequence] = []
        self.num_serial = 0  # rows whose request is not `overlappable`
        self.num_not_greedy = 0  # rows whose request is not `plain_greedy`
        self.removals = 0

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence) -> None:
        """`seq` joins the running batch: the next free row."""
        slot = len(self.seqs)
        seq.slot = slot
        self.seqs.append(seq)
        self._table_version[slot] = -1  # written at the next `sync`
        self._table_len[slot] = 0
        self._synced = False
        req = seq.request
        self.num_serial += not req.overlappable
        self.num_not_greedy += not req.plain_greedy

    def remove(self, seq: Sequence) -> None:
        """`seq` leaves (finished, aborted, preempted): the last row moves into its place."""
        slot, last = seq.slot, len(self.seqs) - 1
        assert 0 <= slot <= last and self.seqs[slot] is seq, "not in the batch"
        if slot != last:
            moved = self.seqs[last]
            n = self._table_len[last]
            self.tables[slot, :n] = self.tables[last, :n]
            self._table_len[slot] = n
            self._table_version[slot] = self._table_version[last]
            self.seqs[slot] = moved
            moved.slot = slot
        self.seqs.pop()
        self._table_version[last] = -1
        seq.slot = -1
        req = seq.request
        self.num_serial -= not req.overlappable
        self.num_not_greedy -= not req.plain_greedy
        self.removals += 1

    def grew(self, seq: Sequence) -> None:
        """The decode scheduler gave `seq` a block for its next token (the only change to a block list between
        steady decode steps)."""
        self._grown.append(seq)

    def stale(self) -> None:
        """A step of another kind is scheduled: any row's block list may change before the next `sync`."""
        self._synced = False

    def all_overlappable(self, seqs: list[Sequence]) -> bool:
        """Whether every one of `seqs` (rows of this batch) can be launched ahead of its previous token."""
        return self.num_serial == 0 or all(s.request.overlappable for s in seqs)

    def all_plain_greedy(self, seqs: list[Sequence]) -> bool:
        return self.num_not_greedy == 0 or all(s.request.plain_greedy for s in seqs)

    def sync(self) -> None:
        """Bring the block-table rows up to date with their sequences' block lists."""
        tables, lens, versions = self.tables, self._table_len, self._table_version
        rows = self._grown if self._synced else self.seqs
        self._grown = []
        self._synced = True
        for seq in rows:
            if seq.slot < 0:  # (grew, then left the batch)
                continue
            blocks, slot = seq.block_ids, seq.slot
            n = len(blocks)
            if seq.block_table_version == versions[slot]:
                have = lens[slot]
                if n == have:
                    continue
                if n > have:  # blocks appended since: write them alone
                    tables[slot, have:n] = blocks[have:]
                    lens[slot] = n
                    continue
            tables[slot, :n] = blocks
            lens[slot] = n
            versions[slot] = seq.block_table_version
