"""What a route gets (`serving: Serving = Depends(get_serving)`): a narrow view of the served model and its
engine. The model's name, tokenizer and shape, the deployment's limits, the engine's submission calls and the stats
the engine thread publishes; never the engine's internals, whose state only the engine thread touches
(docs/development.md rule 6)."""

from __future__ import annotations

import asyncio

from fastapi import Request

from model.config import ModelConfig
from model.features.sae import DictionaryStore
from model.engine import (PLAIN, EngineJob, EngineStats, InvalidOption, RequestOptions, RequestStream,
                          SamplingParams)
from model.interventions import Intervention
from model.features.lora import LoRAAdapter
from model.features.sae import Dictionary, DictionaryStore
from model.probes import (AttributionPatchingRun, CaptureRun, DirectLogitRun, FeatureAttributionRun,
                          FeatureDirectLogitRun, FeatureRequest, PatchSweep, ProbeOptions, ProbeRun, SiteCapture)
from model.text import Tokenizer
from model.transformer import Transformer
from service.common.tracing import RequestTracer
from service.config import Settings
from service.common.errors import APIError
from service.common.metrics import Metrics
from service.api.openai.lora import ServedAdapters
from service.api.openai.responses.store import ResponseStore
from service.common.state import ServerState
from service.microscope.vectors import VectorStore


class Serving:
    def __init__(self, state: ServerState) -> None:
        self._state, self._engine = state, state.engine
        self.model_name: str = state.model_name
        self.tokenizer: Tokenizer = state.loaded.tokenizer
        self.config: ModelConfig = state.loaded.model.config  # the whole model's, as clients see it
        self.settings: Settings = state.settings
        self.metrics: Metrics = state.metrics
        self.max_model_len: int = state.max_model_len  # prompt + max_tokens, clamped to the KV pool at start-up
        self.vectors: VectorStore = state.vectors  # stored vectors interventions name (thread-safe)
        self.saes: DictionaryStore | None = state.saes  # the dictionaries served, by name (thread-safe)
        self.responses: ResponseStore = state.responses  # stored responses /v1/responses continues (thread-safe)
        self.precision: dict = state.precision  # {"quantization": ..., "dtype": ...} as served
        self.speculative: dict | None = state.speculative  # --speculative-config as served, or None
        self.adapters: ServedAdapters = state.adapters  # LoRA adapters served, by name (the engine's own)
        self.tracing: RequestTracer | None = state.tracing  # --otlp-traces-endpoint, else None

    @property
    def execution(self) -> dict:
        """The decode paths as served, and the fallbacks taken so far (/v1/models)."""
        return {**self._state.execution, "fallbacks": self.stats.fallbacks}

    @property
    def draining(self) -> bool:
        return self._state.draining

    @property
    def stats(self) -> EngineStats:
        """The engine's counters as its thread last published them."""
        return self._engine.stats

    async def add_requests(self, prompts: list[tuple[str, list[int]]], params: SamplingParams,
                           options: RequestOptions | list[RequestOptions] = PLAIN) -> list[RequestStream]:
        """Submit prompts (AsyncEngine.add_requests) once the engine can serve what each carries (`check`): an
        invalid one is a 400 here; a full queue or a dead engine raise the engine's errors, which errors.install
        turns into 429 / 503."""
        for o in {id(o): o for o in (options if isinstance(options, list) else [options])}.values():
            await self.check(o)
        try:
            return await self._engine.add_requests(prompts, params, options)
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_request") from None

    async def run_job(self, job: EngineJob, max_queued: int | None = None) -> None:
        await self._engine.run_job(job, max_queued)

    def new_probe(self, token_ids: list[int], opts: ProbeOptions, interventions: list[Intervention] | None = None,
                  num_prompt_tokens: int | None = None, adapter: str | None = None,
                  features: FeatureRequest | None = None) -> ProbeRun:
        """An inspection of `token_ids` over the serving weights, under LoRA adapter `adapter` (a served name) or the
        base, edited by `interventions`, with `features`' grid; options out of range are a 400 (naming the
        `features.*` field at fault)."""
        # (under tensor parallelism a probe's blocks run on every rank, which serve no adapter outside engine steps)
        model = self._state.loaded.model if adapter is None else self.local_model("an inspection under a LoRA adapter")
        try:
            return ProbeRun(model, token_ids, opts, interventions, num_prompt_tokens, self.adapter(adapter), features)
        except ValueError as e:
            field = str(e).split(":", 1)[0]
            raise APIError(400, str(e), param=field if field.startswith("features") else None,
                           code="invalid_value") from None

    def local_model(self, what: str) -> Transformer:
        """The served model where its modules run in this process; 400 under tensor parallelism."""
        model = self._state.loaded.model
        if not isinstance(model, Transformer):
            raise APIError(400, f"{what} needs the whole model in one process; this server runs it across "
                                "tensor-parallel ranks", code="invalid_request")
        return model

    def new_capture(self, token_ids: list[int], capture: SiteCapture) -> CaptureRun:
        """A forward of `token_ids` over the serving weights recording `capture`'s sites (model/probes/capture.py)."""
        return CaptureRun(self.local_model("a head-level sweep"), token_ids, capture)

    def adapter(self, name: str | None) -> LoRAAdapter | None:
        """A served LoRA adapter by name (`check_model`'s answer), or None: the base."""
        return self.adapters[name] if name is not None else None

    def new_direct_logit(self, token_ids: list[int], answer: int, contrast: int,
                         adapter: str | None = None) -> DirectLogitRun:
        return DirectLogitRun(self.local_model("attribution"), token_ids, answer, contrast, self.adapter(adapter))

    def new_attribution_patching(self, sweep: PatchSweep, source: list[int], target: list[int],
                                 qk_fix: bool, adapter: str | None = None) -> AttributionPatchingRun:
        return AttributionPatchingRun(self.local_model("attribution"), sweep, source, target, qk_fix,
                                      adapter=self.adapter(adapter))

    def new_feature_direct_logit(self, token_ids: list[int], answer: int, contrast: int, dictionary: Dictionary,
                                 adapter: str | None = None) -> FeatureDirectLogitRun:
        return FeatureDirectLogitRun(self.local_model("attribution"), token_ids, answer, contrast, dictionary,
                                     self.adapter(adapter))

    def new_feature_attribution(self, dictionary: Dictionary, clean: list[int], corrupted: list[int], answer: int,
                                contrast: int | None, metric: str, positions: list[int],
                                adapter: str | None = None) -> FeatureAttributionRun:
        return FeatureAttributionRun(self.local_model("attribution"), dictionary, clean, corrupted, answer, contrast,
                                     metric, positions, self.adapter(adapter))

    async def check(self, options: RequestOptions) -> None:
        """400 naming the request field the engine cannot serve (`Engine.check`: the sink + window cache, telemetry,
        speculation, the grammar). A grammar compiles on a worker thread into the engine's cache (thread-safe), so
        the engine thread finds it there and the event loop never waits for a compile."""
        try:
            if options.structured is not None:
                await asyncio.to_thread(self._engine.check, options)
            else:
                self._engine.check(options)
        except InvalidOption as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the adapter at `path` under `name` from the next step (`ServedAdapters.load`: 400s naming the field)."""
        await self.adapters.load(self._engine, name, path, self.config, self.model_name, self.settings.max_lora_rank)

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (`ServedAdapters.unload`: 404 for no such adapter, 400 while one is in use)."""
        await self.adapters.unload(self._engine, name)

    def check_model(self, name: str | None, adapters: bool = False) -> str | None:
        """A request's `model`: the base model's name (or none) -> None; a LoRA adapter's name -> that name where
        the endpoint serves adapters (`adapters`), else 400; anything else 404."""
        if name is None or name == self.model_name:
            return None
        if name in self.adapters:
            if adapters:
                return name
            raise APIError(400, f"model {name!r} is a LoRA adapter; this endpoint runs the base model "
                                f"{self.model_name!r}", param="model", code="invalid_value")
        served = ", ".join(repr(n) for n in [self.model_name, *self.adapters])
        raise APIError(404, f"model {name!r} does not exist; this server serves {served}",
                       param="model", code="model_not_found")


async def get_serving(request: Request) -> Serving:
    """Dependency: the routes' view of the server (`app.state.server.serving`), or a 503 envelope while the model
    loads (or after it failed to, or while the server drains). A coroutine, though it awaits nothing: FastAPI runs a
    plain function dependency on its thread pool, a hop (and a capacity limiter's bookkeeping) every request."""
    state: ServerState = request.app.state.server
    if not state.ready:
        reason = "the server is shutting down" if state.draining else state.fatal_error or "the model is loading"
        raise APIError(503, reason, code="not_ready", headers={"Retry-After": "5"})
    if state.serving is None:
        state.serving = Serving(state)
    return state.serving
