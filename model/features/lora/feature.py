"""LoRA as a per-row feature (model/features/protocol.py): the request's `lora` option names an adapter this engine
serves; its rows get that adapter's deltas on every path, and its blocks are keyed apart from the base's.

Per engine the feature holds the adapters loaded (`add`, `remove`: the server's --lora-modules and vLLM's
load / unload routes), each with the serial of its load: an adapter's K/V is neither the base's nor another load's
under the same name, so that serial roots its requests' prefix-cache keys (`prefix_key`). A step whose rows name
adapters gets a `StepLoRA` part: each adapter with its packed rows (`LoRARows`), applied at the attention context's
projection seam on the module path (`adapt`), passed to the fused native step as its `lora_rows` / `lora`
arguments (model/kernels/csrc/step_layers.cpp), and on the CUDA graphs written into the static per-row slots of
graph.py's `GraphLoRA`, the feature's graph part. Loading or unloading an adapter tells the engine its state
changed (`Feature.changed`), so the graphs that hold every loaded adapter are captured again between steps.

The shape is vLLM's: its LoRA package keeps the adapters and the worker's manager of them
(vllm/lora/worker_manager.py), and the runner hands each step's rows to it at one point
(vllm/v1/worker/lora_model_runner_mixin.py, `set_active_loras`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from model.features.lora.adapters import LoRAAdapter, LoRARows
from model.features.lora.graph import GraphLoRA
from model.features.protocol import PATHS, Feature, InvalidOption, Part, StepParts, StepView


class StepLoRA(Part):
    """One step's rows under adapters: its part on every path (the CUDA graphs through `GraphLoRA`)."""

    paths = frozenset(PATHS)
    graph = True  # the CUDA graphs replay it from the features' graph parts (`GraphPart`)

    def __init__(self, rows: LoRARows, n_layers: int) -> None:
        self.rows, self.n_layers = rows, n_layers

    def adapt(self, layer: int, site: str, x: Tensor, y: Tensor) -> Tensor:
        return self.rows.apply(layer, site, x, y)

    def native_args(self) -> dict[str, Any]:
        """step_layers' `lora_rows` (each adapter's packed rows) and `lora` (per block its targets)."""
        rows, parts = self.rows.native_args(self.n_layers)
        return {"lora_rows": rows, "lora": parts}


class LoRA(Feature):
    name = "lora"

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.adapters: dict[str, LoRAAdapter] = {}  # by name, on the model's device and in its dtype
        self._loads = 0  # adapters loaded so far: each load's serial roots its prefix keys

    # ---- the engine's adapters (on the engine thread, between steps) -------------------------------------------

    def add(self, adapter: LoRAAdapter) -> None:
        """Serve `adapter` (adapters.py) to the requests that name it (`RequestOptions.lora`), beside the base. Under
        tensor parallelism every rank serves its share of it (model/parallel/rank0.py, `TPModel.add_lora`)."""
        if adapter.name in self.adapters:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        self._loads += 1
        adapter.serial = self._loads  # (its K/V is never another load's under the same name: the prefix key)
        engine = self.engine
        if engine.distributed:
            adapter = engine.model.add_lora(adapter)
        self.adapters[adapter.name] = adapter.to(engine.model.dtype, torch.device(engine.model.device))
        self.changed()

    def remove(self, name: str) -> None:
        """Stop serving adapter `name`. ValueError while a request runs or waits under it."""
        if name not in self.adapters:
            raise ValueError(f"no LoRA adapter {name!r} is loaded")
        users = sum(r.options.lora == name for r in self.engine.requests())
        if users:
            raise ValueError(f"LoRA adapter {name!r} is serving {users} request(s); unload it once they finish")
        del self.adapters[name]
        self.changed()
        if self.engine.distributed:
            self.engine.model.remove_lora(name)

    # ---- the protocol's stages --------------------------------------------------------------------------------

    def check(self, value: str) -> None:
        if value not in self.adapters:
            raise InvalidOption("model", f"no LoRA adapter {value!r} is loaded")

    def prefix_key(self, request: Any) -> bytes | None:
        name = request.options.lora
        return None if name is None else f"lora {self.adapters[name].serial} {name}".encode()

    def prepare(self, step: StepView) -> StepLoRA | None:
        """The step's rows under each adapter this engine serves."""
        if not self.adapters:
            return None
        rows: dict[str, list[int]] = {}
        for r in step.rows:
            name = r.seq.request.options.lora
            if name is not None and name in self.adapters:
                rows.setdefault(name, []).extend(range(r.start, r.start + r.num_new))
        if not rows:
            return None
        groups = [(self.adapters[n], _put(r, step.device)) for n, r in rows.items()]
        return StepLoRA(LoRARows(groups, list(rows.values())), step.model.config.n_layers)

    def graph_part(self, max_rows: int, device: torch.device) -> GraphLoRA:
        return GraphLoRA(max_rows, device, self.adapters)


def step_rows(parts: StepParts | None) -> LoRARows | None:
    """The step's rows under adapters, where its parts have them (tensor parallelism sends them to the ranks)."""
    part = next((p for p in parts.parts if isinstance(p, StepLoRA)), None) if parts else None
    return part.rows if part is not None else None


def _put(rows: list[int], device: torch.device) -> Tensor:
    """The rows' ids (n,) on `device`: on a GPU from pinned memory without a wait (as the runner's inputs)."""
    t = torch.tensor(rows, dtype=torch.long)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)
