"""What the app lifespan owns (docs/development.md rule 6): settings, metrics, the loaded model and its AsyncEngine."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field

import torch

from model.engine import AsyncEngine
from model.engine import Engine, RequestOptions, SpeculativeConfig
from model.features import KVWindow
from model.loaders import LoadedModel, load_model
from model.features.sae import DictionaryStore, StoreLimits
from model.parallel import TPModel, launch
from model.dtypes import DTYPES
from model.text.chat_template import read_template_option
from service.common.tracing import RequestTracer
from service.config import Settings, named_path
from service.common.metrics import Metrics
from service.api.openai.lora import ServedAdapters
from service.api.openai.responses.store import ResponseStore
from service.microscope.vectors import VectorStore, control_vector_specs, load_control_vector

log = logging.getLogger("llamascope.service")


@dataclass
class ServerState:
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    loaded: LoadedModel | None = None
    engine: AsyncEngine | None = None
    model_name: str = ""
    saes: DictionaryStore | None = None  # the dictionaries served (--sae, POST /v1/saes), made when the model loads
    adapters: ServedAdapters = field(default_factory=ServedAdapters)  # LoRA adapters served (--lora-modules), by name
    load_error: str | None = None
    draining: bool = False
    fatal_error: str | None = None  # the model failed to load or the engine thread ended: /health 503, exit 1
    on_fatal: Callable[[], None] | None = None  # set by the real server (service/common/shutdown.py): stop with exit code 1
    serving: Any = None  # what routes get (service/common/serving.py `Serving`), made at the first request once ready
    vectors: VectorStore = field(default=None)  # named steering vectors (service/microscope/vectors.py)
    responses: ResponseStore = field(default=None)  # stored responses (service/api/openai/responses/store.py)
    speculative: dict | None = None  # --speculative-config as served (/v1/models), None when off
    kv_cache_dtype: str = ""  # the KV cache's dtype as served (--kv-cache-dtype resolved)
    kv_cache_tokens: int = 0  # the tokens the KV pool holds (--kv-cache-bytes over the bytes a token takes)
    execution: dict = field(default_factory=dict)  # decode attention and decode graph paths as served (/v1/models)
    loader: threading.Thread | None = None  # the thread loading the model, once `start_in_background` began it
    tracing: RequestTracer | None = None  # --otlp-traces-endpoint: a span per request (service/common/tracing.py)

    def __post_init__(self) -> None:
        if self.vectors is None:
            self.vectors = VectorStore(self.settings.max_vectors)
        if self.responses is None:
            self.responses = ResponseStore(self.settings.max_stored_responses)
        if self.settings.otlp_traces_endpoint and self.tracing is None:
            self.tracing = RequestTracer(self.settings.otlp_traces_endpoint)

    @property
    def stats(self):
        """The engine's stats as its thread last published them (None before it starts)."""
        return self.engine.stats if self.engine is not None else None

    @property
    def max_model_len(self) -> int:
        """The engine's limit on prompt + max_tokens (the model's context, clamped to the KV pool at start-up)."""
        return self.engine.max_model_len

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.is_running and not self.draining

    def start(self, loaded: LoadedModel | None = None) -> None:
        """Load (unless given) and start the engine; runs on a background thread so /health answers 503 meanwhile."""
        s = self.settings
        try:
            if s.threads:
                torch.set_num_threads(s.threads)
            if loaded is None:
                device = s.device or ("cuda" if torch.cuda.is_available() else "cpu")
                dtype = s.dtype if s.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
                if s.tensor_parallel_size > 1:  # this process is rank 0: it schedules, the workers follow
                    if s.quantization not in ("none", "auto"):
                        raise ValueError("--quantization and --tensor-parallel-size > 1 cannot be combined yet")
                    if not s.threads and not device.startswith("cuda"):  # N processes share the cores
                        torch.set_num_threads(max(1, (os.cpu_count() or 1) // s.tensor_parallel_size))
                    loaded = launch(s.model, s.tensor_parallel_size, DTYPES[dtype], device, threads=s.threads)
                else:
                    loaded = load_model(s.model, DTYPES[dtype], device, quantization=s.quantization,
                                        reserve_bytes=s.kv_cache_bytes)
            if s.chat_template is not None:  # --chat-template: instead of the checkpoint's own
                loaded.tokenizer.chat_template = read_template_option(s.chat_template)
            config = s.engine_config()
            c = loaded.model.config
            for spec in control_vector_specs(s.control_vector):  # llama.cpp control vectors, stored by name
                self.vectors.add(load_control_vector(spec, c.n_layers, c.dim))
            draft = _load_draft(config.speculative, loaded, s) if config.speculative is not None else None
            core = Engine(loaded.model, loaded.tokenizer, config, draft_model=draft)
            self.adapters.load_at_start(s.lora_modules, core, c, s.served_model_name or loaded.name, s.max_lora_rank)
            self.saes = DictionaryStore(StoreLimits(tuple(s.sae_allowed_dirs), s.sae_max_bytes, encoder=s.sae_encoder), c)
            for spec in s.sae:  # a dictionary this model cannot serve stops the server at start, naming it
                name, path = named_path(spec, "--sae")
                d = self.saes.load(name, path, trusted=True)
                log.info("dictionary %s: %s (%s, %d features at %s)", name, path, d.source, d.d_sae, d.hook_in)
            if s.kv_window is not None:  # the default window must fit this engine: refuse to start, not every request
                core.check(RequestOptions(kv_window=KVWindow(s.sink_tokens, s.kv_window)))
            # Ready means full speed: the KV pool resident and the weights on 2 MB pages before /health says ready,
            # not in the background while the first requests decode (docs/performance.md#ready-means-full-speed)
            core.cache.wait_resident(torch.get_num_threads())
            if getattr(loaded.model, "collapsing", None) is not None:  # (model/loaders/checkpoint.py)
                loaded.model.collapsing.join()
            engine = AsyncEngine(core)
            engine.step_hooks.append(self.metrics.on_step)
            engine.on_dead = self._engine_died
            engine.start()
            self.loaded, self.model_name = loaded, s.served_model_name or loaded.name
            self.speculative = config.speculative.to_dict() if config.speculative is not None else None
            self.kv_cache_dtype = str(core.cache.k.dtype).removeprefix("torch.")
            self.kv_cache_tokens = core.kv_cache_tokens
            self.execution = {"decode_attention": core.decode_attention, "decode_graphs": core.decode_graphs,
                              "cpu_kernels": core.cpu_kernels}
            self.engine = engine
            log.info("serving %s: %s", self.model_name, self.precision)
            if self.speculative is not None:
                log.info("speculative decoding: %s", self.speculative)
        except Exception as e:  # nothing this process can serve (docs/development.md rule 9): /health 503 with the
            # reason meanwhile, and a real server exits non-zero with it (service/common/shutdown.py)
            if loaded is not None and isinstance(loaded.model, TPModel) and self.engine is None:
                loaded.model.close()
            self.load_error = " ".join(str(e).split()) or type(e).__name__  # one line, for /health and stderr
            log.error("model failed to load: %s", self.load_error)
            self._fatal(f"model failed to load: {self.load_error}")

    @property
    def precision(self) -> dict:
        """What /v1/models says the weights, activations and KV cache run in, and the tokens the KV pool holds."""
        return {**_precision(self.loaded), "kv_cache_dtype": self.kv_cache_dtype, "kv_cache_tokens": self.kv_cache_tokens}

    def _engine_died(self, error: BaseException | None) -> None:
        """The engine thread ended while serving (its open requests end with errors right after this). Nothing in
        this process can serve again: /health says so, and a real server exits non-zero to be restarted."""
        reason = f"the engine stopped: {type(error).__name__}" if error is not None else "the engine stopped"
        log.critical("%s; the server cannot serve any more", reason)
        if self.loaded is not None and isinstance(self.loaded.model, TPModel):
            self.loaded.model.abort()
        self._fatal(reason)

    def _fatal(self, reason: str) -> None:
        """Nothing in this process can serve again: /health says `reason`, and a real server (`on_fatal`, set by
        service/common/shutdown.py) stops and exits 1 so that whatever started it sees the failure."""
        self.fatal_error = reason
        if self.on_fatal is not None:
            self.on_fatal()

    def start_in_background(self, loaded: LoadedModel | None = None) -> threading.Thread:
        self.loader = threading.Thread(target=self.start, args=(loaded,), name="llamascope-load", daemon=True)
        self.loader.start()
        return self.loader

    def begin_drain(self, grace_seconds: float) -> None:
        """SIGTERM: refuse new work (503, /health included) from now on; whatever still generates 1 s before the
        grace period is over is ended then, so its response closes cleanly before the server's own deadline."""
        if self.draining:
            return
        self.draining = True
        log.info("shutting down: refusing new requests, %.0f s for those in flight", grace_seconds)
        timer = threading.Timer(max(0.0, grace_seconds - 1.0), self._end_in_flight)
        timer.daemon = True
        timer.start()

    def _end_in_flight(self) -> None:
        s = self.engine.stats if self.engine is not None and self.engine.is_running else None
        if s is not None and s.num_running + s.num_waiting:
            log.warning("shutdown grace period over: ending the requests still in flight")
            self.engine.abort_all("the server is shutting down")

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        if self.tracing is not None:  # the spans of the last requests go out before the process ends
            self.tracing.shutdown()
        if self.loaded is not None and isinstance(self.loaded.model, TPModel):
            if self.engine is not None and self.engine.is_running:  # a step may be in flight: leave the workers
                log.warning("engine thread still running; tensor-parallel workers exit with this process")
            else:
                self.loaded.model.close()


def _load_draft(spec: SpeculativeConfig, target: LoadedModel, s: Settings) -> torch.nn.Module:
    """The draft model of a draft_model speculative configuration: the served checkpoint again at another
    quantization ("self"), or another checkpoint, which must tokenize as the served one does (ValueError)."""
    if s.tensor_parallel_size > 1:
        raise ValueError("--speculative-config: a draft model with --tensor-parallel-size > 1 is not supported "
                         "(the ngram method is)")
    path = s.model if spec.model == "self" else spec.model
    model = target.model
    # the engine's KV pool is not allocated yet: the draft's weights must fit beside it (and the engine then checks
    # both pools, the draft's included, before allocating either)
    draft = load_model(path, model.dtype, model.device, quantization=spec.quantization or "auto",
                       reserve_bytes=s.kv_cache_bytes)
    V, Vd = model.config.vocab_size, draft.model.config.vocab_size
    probe = "Speculative decoding checks 12 tokens, ünïcödé and <|im_end|> too."
    if Vd != V or draft.tokenizer.encode(probe) != target.tokenizer.encode(probe) \
            or draft.tokenizer.stop_ids != target.tokenizer.stop_ids:
        raise ValueError(f"--speculative-config: the draft model {spec.model!r} has another tokenizer or vocabulary "
                         f"({Vd} tokens, the served model {V}): its drafts would mean other tokens")
    log.info("draft model %s: %s, %.0f MB of weights, loaded in %.1f s", spec.model, _precision(draft)["quantization"],
             draft.weight_bytes / 1e6, draft.load_seconds)
    return draft.model


def _precision(loaded: LoadedModel) -> dict:
    """{"quantization": "int4" / "int8" / "none", "dtype": the activations' dtype, "weights": {"bytes": served
    weights, "from_file": how the file's matrices are served, e.g. {"Q4_K -> int4": 154}}}."""
    weights = {"bytes": getattr(loaded, "weight_bytes", 0), "from_file": getattr(loaded, "weight_mix", {})}
    return {"quantization": getattr(loaded, "quantization", "none"), "dtype": str(loaded.model.dtype).removeprefix("torch."),
            "weights": weights}
