"""A step's interventions as static buffers a captured decode graph reads (as vLLM's punica wrapper keeps adapter slots:
per row an index into a bank), for model/engine/cuda_graphs.py.

A graph replays fixed kernels over fixed addresses, so the ragged table of model/edits.py (ops per site, of any
length) is rewritten before each replay into dense per-site, per-row indices into a static bank:

    idx    (S L, B, 3) int64   each row's entry at site k (model/edits.py's numbering): bank rows of u, keep, put
    on     (S L, B) bool       which rows have an entry there (the others are left exactly as they are)
    bank   (2 + C, D) float32  row 0 zeros (no u, no put), row 1 ones (no keep), then the step's vectors
    hidden (L, B, D) float32   every block's output, for the step's hidden-state reads

The captured forward applies, at the sub-blocks' outputs and the block's output (GRAPH_SITES; a step editing or
reading another site replays no graph, so the captured kernels stay three a block), x -= (x . u) u;
x = x * keep + put on the rows that are `on`: model/edits.py's `apply_dense`, the PyTorch definition of an edit, a
handful of fixed-shape kernels. Graphs with these ops are
a second variant per bucket, replayed only for steps that edit or read something; the plain variant stays as it
was. A step whose vectors exceed the bank's C rows runs on the module path.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from model.edits import StepEdits, apply_dense
from model.interventions import SITE_INDEX, SITES_PER_BLOCK

GRAPH_SITES = ("attention_output", "mlp_output", "block_output")  # the sites a captured graph edits


class GraphEdits:
    def __init__(self, n_layers: int, dim: int, max_rows: int, capacity: int, device: torch.device) -> None:
        S, B = SITES_PER_BLOCK * n_layers, max_rows
        self.n_layers, self.capacity = n_layers, capacity
        self.idx = torch.zeros(S, B, 3, dtype=torch.long, device=device)
        self.on = torch.zeros(S, B, dtype=torch.bool, device=device)
        self.bank = torch.zeros(2 + capacity, dim, device=device)
        self.bank[1] = 1.0
        self.hidden = torch.zeros(n_layers, B, dim, device=device)
        self._identity = np.array([0, 1, 0], dtype=np.int64)
        self._host = np.empty((S, B, 3), dtype=np.int64)
        self._on = np.empty((S, B), dtype=bool)

    def fits(self, edits: StepEdits) -> bool:
        return edits.bank.shape[0] <= self.capacity

    def load(self, edits: StepEdits) -> None:
        """Write the step's table into the static buffers (rows past the step's are identity)."""
        host, on = self._host, self._on
        host[:] = self._identity
        on[:] = False
        ptr, ops = edits.site_ptr_host, edits.ops.cpu().numpy()
        for k in np.nonzero(ptr[1:] > ptr[:-1])[0]:
            sel = ops[ptr[k] : ptr[k + 1]]
            rows = sel[:, 0]
            host[k, rows] = np.where(sel[:, 1:] >= 0, sel[:, 1:] + 2, self._identity)
            on[k, rows] = True
        self.idx.copy_(torch.from_numpy(host), non_blocking=True)
        self.on.copy_(torch.from_numpy(on), non_blocking=True)
        V = edits.bank.shape[0]
        if V:
            self.bank[2 : 2 + V].copy_(edits.bank)

    def apply(self, layer: int, site: str, x: Tensor) -> Tensor:
        """x (1, b, D) in place, the first b rows of the buffers; records block outputs."""
        if site not in GRAPH_SITES:  # a head site or one of the stream's others: such steps replay no graph
            return x
        b = x.shape[1]
        k = SITES_PER_BLOCK * layer + SITE_INDEX[site]
        apply_dense(x[0], self.idx[k, :b], self.on[k, :b], self.bank)  # (b, D), the rows that are `on`
        if site == "block_output":
            self.hidden[layer, :b] = x[0].float()
        return x

    def store_reads(self, edits: StepEdits) -> None:
        """After a replay: the step's reads from the recorded block outputs."""
        for layer in range(self.n_layers):
            k = SITES_PER_BLOCK * layer + SITE_INDEX["block_output"]  # (steps reading other sites replay no graph)
            a, b = int(edits.read_ptr_host[k]), int(edits.read_ptr_host[k + 1])
            if a < b:
                edits.read_out[a:b] = self.hidden[layer, edits.read_rows[a:b]]
