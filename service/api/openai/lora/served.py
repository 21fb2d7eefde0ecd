"""The LoRA adapters a server serves, by name (vLLM's --lora-modules and its runtime load / unload): read from their
files (model/features/lora/adapters.py), handed to the engine's LoRA feature, and listed by /v1/models. Every
request's `model` is looked up here (`Serving.check_model`)."""

from __future__ import annotations

import asyncio
import logging

from model.config import ModelConfig
from model.engine import AsyncEngine, Engine
from model.features.lora import LoRAAdapter, load_adapter
from service.common.errors import APIError
from service.config import lora_module

log = logging.getLogger("llamascope.service")


class ServedAdapters(dict[str, LoRAAdapter]):
    """The adapters served, by name; each is also the engine's (`engine.feature("lora")`), on the engine thread."""

    def load_at_start(self, specs: list[str], engine: Engine, config: ModelConfig, base_name: str,
                      max_rank: int) -> None:
        """--lora-modules (`NAME=PATH` each), before the engine serves: an adapter this model cannot serve stops the
        server at start, naming it (ValueError)."""
        for spec in specs:
            name, path = lora_module(spec)
            if name == base_name:
                raise ValueError(f"LoRA adapter name {name!r} is the base model's name")
            self[name] = load_adapter(name, path, config, max_rank)
            engine.feature("lora").add(self[name])
            log.info("LoRA adapter %s: %s", name, path)

    def cards(self, base_name: str, max_model_len: int) -> list[dict]:
        """/v1/models' entry of each adapter, as vLLM lists one: its own id, its file or folder as root, the base as
        parent."""
        return [{"id": name, "object": "model", "created": 0, "owned_by": "llamascope", "root": a.path,
                 "parent": base_name, "max_model_len": max_model_len} for name, a in self.items()]

    async def load(self, engine: AsyncEngine, name: str, path: str, config: ModelConfig, base_name: str,
                   max_rank: int) -> None:
        """Load a PEFT adapter folder or a llama.cpp LoRA GGUF (read on a worker thread) and serve it under `name` from
        the next step; 400 for a name in use, or a file that does not read or that this model cannot serve."""
        if name == base_name or name in self:
            raise APIError(400, f"the name {name!r} is already served", param="lora_name", code="invalid_value")
        try:
            adapter = await asyncio.to_thread(load_adapter, name, path, config, max_rank)
        except Exception as e:  # noqa: BLE001 - a client's file: whatever fails to read it is that client's 400
            raise APIError(400, f"{e}" if isinstance(e, ValueError) else f"LoRA adapter {name!r}: {path}: {e}",
                           param="lora_path", code="invalid_value") from None
        try:
            await engine.call_feature("lora", "add", adapter)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_name", code="invalid_value") from None
        self[name] = adapter

    async def unload(self, engine: AsyncEngine, name: str) -> None:
        """Stop serving adapter `name`: 404 for no such adapter, 400 while requests run under it."""
        if name not in self:
            raise APIError(404, f"no LoRA adapter {name!r} is loaded", param="lora_name", code="model_not_found")
        try:
            await engine.call_feature("lora", "remove", name)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_name", code="invalid_value") from None
        del self[name]
