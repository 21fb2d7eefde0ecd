"""The serving engine: requests and their sequences, the scheduler, the paged KV cache and its block manager, the
sampler, the step loop (`Engine`) and its thread for asyncio callers (`AsyncEngine`). The network below it (model/)
knows none of this; the HTTP service above it imports only the names exported here."""

from model.engine.async_engine import AsyncEngine, EngineDeadError, EngineJob, RequestStream
from model.engine.engine import Engine, EngineConfig, EngineStats, FatalEngineError, RequestOutput
from model.engine.output_processor import HiddenStates
from model.engine.request_options import PLAIN, InvalidOption, RequestOptions
from model.engine.sampler import TokenLogprobs
from model.engine.sampling_params import SamplingParams
from model.engine.scheduler import QueueFullError
from model.engine.speculative import SpecDecodeStats, SpeculativeConfig

__all__ = [
    "AsyncEngine", "Engine", "EngineConfig", "EngineDeadError", "EngineJob", "EngineStats", "FatalEngineError",
    "HiddenStates", "InvalidOption", "PLAIN", "QueueFullError", "RequestOptions", "RequestOutput", "RequestStream",
    "SamplingParams", "SpecDecodeStats", "SpeculativeConfig",
    "TokenLogprobs",
]
