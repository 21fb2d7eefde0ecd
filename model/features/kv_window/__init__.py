"""The sink + window KV cache (StreamingLLM): its schedule (schedule.py) and the feature the engine checks it
through (feature.py)."""

from model.features.kv_window.feature import KVWindowFeature
from model.features.kv_window.schedule import Eviction, KVWindow, evict

__all__ = ["Eviction", "KVWindow", "KVWindowFeature", "evict"]
