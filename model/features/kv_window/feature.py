"""The sink + window KV cache as a per-row feature (model/features/protocol.py): the request's `kv_window` checked
against the engine. Its schedule is schedule.py; the engine applies it where its own state is (the scheduler's
chunks stop at eviction points, the KV manager evicts blocks, model/engine/context_shift.py re-rotates keys)."""

from __future__ import annotations

from model.features.kv_window.schedule import KVWindow
from model.features.protocol import Feature, InvalidOption


class KVWindowFeature(Feature):
    name = "kv_window"

    def check(self, value: KVWindow) -> None:
        engine = self.engine
        if engine.distributed:  # the ranks' caches would need every eviction too
            raise InvalidOption("kv_window", "kv_window is not supported with tensor parallelism")
        need = value.max_cache_tokens(engine.block_size)
        if need > engine.max_model_len:
            raise InvalidOption("kv_window", f"kv_window: sink_tokens ({value.sink_tokens}) + window ({value.window}) + "
                                f"block_size ({engine.block_size}) = {need} exceeds the context length of "
                                f"{engine.max_model_len}")
