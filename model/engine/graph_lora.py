"""A step's rows under LoRA adapters as static buffers a captured decode graph reads (vLLM's punica wrapper: per row
an index into the adapters a graph was captured with), for model/engine/cuda_graphs.py.

A graph replays fixed kernels over fixed addresses, so the step's ragged grouping (model/lora.py's `LoRARows`: per
adapter a list of rows) is rewritten before each replay into one dense per-row index:

    slot   (B,) int64   the row's adapter among the graph's (-1: the base; padding rows too)

The captured forward applies, at every adapted site, for every adapter s the graph holds and each of its targets,

    y[:, start:stop] += ((x A^T) * (slot == s)) B^T * scale

over all the bucket's rows: the rows under another adapter (or none) get an exact zero delta. The adapters' weights
stay where `Engine.add_lora` put them (the graph reads their addresses, which do not move while they are loaded).
A graph of this kind holds every adapter loaded when it was captured; loading or unloading one makes a new set,
whose graphs are captured when first needed (the old set's are dropped). Steps with no adapter rows replay the plain
graphs, which hold none of this.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from model.lora import LoRAAdapter, LoRARows


class GraphLoRA:
    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.slot = torch.full((max_rows,), -1, dtype=torch.long, device=device)
        self.adapters: list[LoRAAdapter] = []  # the adapters of the set in use, in slot order
        self._host = np.full(max_rows, -1, dtype=np.int64)

    def holds(self, adapters: dict[str, LoRAAdapter]) -> bool:
        """Whether the set in use is `adapters` (by name and load serial: a name loaded again is another adapter)."""
        return sorted(map(_ident, adapters.values())) == [_ident(a) for a in self.adapters]

    def use(self, adapters: dict[str, LoRAAdapter]) -> bool:
        """Make `adapters` the set the next graphs are captured and replayed with (every adapter loaded, in name
        order); False where it already is."""
        if self.holds(adapters):
            return False
        self.adapters = sorted(adapters.values(), key=_ident)
        return True

    def load_none(self) -> None:
        """Every row on the base (what a capture runs with: its rows are padding rows)."""
        self.slot.fill_(-1)

    def load(self, lora: LoRARows) -> None:
        """Write the step's rows' slots into the static buffer (every other row: -1)."""
        host = self._host
        host[:] = -1
        index = {_ident(a): s for s, a in enumerate(self.adapters)}
        for g, (adapter, _) in enumerate(lora.groups):
            host[lora.rows_on_host(g)] = index[_ident(adapter)]
        self.slot.copy_(torch.from_numpy(host), non_blocking=True)

    def apply(self, layer: int, site: str, x: Tensor, y: Tensor) -> Tensor:
        """x (1, b, in), y (1, b, out): the first b rows of the buffers; y gets each row's adapter's deltas, in
        place (`ForwardContext.adapt`)."""
        b = x.shape[1]
        xf, yf = x[0], y[0]  # (b, in), (b, out)
        for s, adapter in enumerate(self.adapters):
            parts = adapter.parts.get((layer, site))
            if not parts:
                continue
            mine = (self.slot[:b] == s).to(xf.dtype)[:, None]  # (b, 1)
            for p in parts:
                t = (xf @ p.A.T) * mine  # (b, r)
                yf[:, p.start : p.stop] += (t.float() @ p.BT.float()).to(yf.dtype) * p.scale  # as LoRARows.apply
        return y


def _ident(a: LoRAAdapter) -> tuple[str, int]:
    return a.name, a.serial
