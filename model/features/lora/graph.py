"""A step's rows under LoRA adapters as static buffers a captured decode graph reads (vLLM's punica wrapper: per row
an index into the adapters a graph was captured with): the LoRA feature's graph part (`GraphPart`,
model/features/protocol.py), which model/engine/cuda_graphs.py captures its featured graphs with.

A graph replays fixed kernels over fixed addresses, so the step's ragged grouping (adapters.py's `LoRARows`: per
adapter a list of rows) is rewritten before each replay into one dense per-row index:

    slot   (B,) int64   the row's adapter among the graph's (-1: the base; padding rows too)

The captured forward applies, at every adapted site, for every adapter s the graph holds and each of its targets,

    y[:, start:stop] += ((x A^T) * (slot == s)) B^T * scale

over all the bucket's rows: the rows under another adapter (or none) get an exact zero delta. The adapters' weights
stay where `LoRA.add` put them (the graph reads their addresses, which do not move while they are loaded). A graph
of this kind holds every adapter loaded when it was captured; loading or unloading one makes a new set (`use`),
whose graphs are captured again when the feature says its state changed (the old set's are dropped). Steps with no
adapter rows replay the plain graphs, which hold none of this.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from model.features.lora.adapters import LoRAAdapter
from model.features.protocol import GraphPart, StepParts


class GraphLoRA(GraphPart):
    def __init__(self, max_rows: int, device: torch.device, loaded: dict[str, LoRAAdapter]) -> None:
        """`loaded`: the feature's adapters by name (its own dict: what is loaded now)."""
        self.loaded = loaded
        self.slot = torch.full((max_rows,), -1, dtype=torch.long, device=device)
        self.adapters: list[LoRAAdapter] = []  # the adapters of the set in use, in slot order
        self._host = np.full(max_rows, -1, dtype=np.int64)

    def current(self) -> bool:
        """Whether the set in use is the loaded one (by name and load serial: a name loaded again is another
        adapter)."""
        return sorted(map(_ident, self.loaded.values())) == [_ident(a) for a in self.adapters]

    def use(self) -> bool:
        """Make the loaded adapters the set the next graphs are captured and replayed with (in name order); False
        where they already are."""
        if self.current():
            return False
        self.adapters = sorted(self.loaded.values(), key=_ident)
        return True

    def active(self) -> bool:
        return bool(self.loaded)

    def load(self, parts: StepParts | None) -> None:
        """Write the step's rows' slots into the static buffer (every other row: -1); None: every row on the base
        (what a capture runs with: its rows are padding rows)."""
        from model.features.lora.feature import step_rows  # (feature.py makes this part: imported when used)

        lora = step_rows(parts)
        if lora is None:
            self.slot.fill_(-1)
            return
        host = self._host
        host[:] = -1
        index = {_ident(a): s for s, a in enumerate(self.adapters)}
        for g, (adapter, _) in enumerate(lora.groups):
            host[lora.rows_on_host(g)] = index[_ident(adapter)]
        self.slot.copy_(torch.from_numpy(host), non_blocking=True)

    def adapt(self, layer: int, site: str, x: Tensor, y: Tensor) -> Tensor:
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
