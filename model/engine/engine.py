"""The engine: `step()` = schedule -> the model runner executes the step -> the output processor updates.

Synchronous and single-threaded; `async_engine.AsyncEngine` runs it on its own thread for the HTTP service. The
shape is vLLM's engine core (`step()` = `schedule()` -> `execute_model()` -> `update_from_output()`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from model.engine.context_shift import ContextShift
from model.engine.cuda_graphs import CudaGraphs, DecodeGraphMode
from model.engine.end_of_sequence import Finish, finish_after
from model.engine.engine_sizes import EngineSizes
from model.engine.kv_cache_manager import KVCacheManager
from model.engine.model_runner import DecodeLaunch, ModelRunner, RunnerOutput
from model.engine.output_processor import OutputProcessor, RequestOutput, StepOutputs
from model.engine.paged_cache import PagedKVCache, cache_dtype, kv_config
from model.engine.persistent_batch import PersistentBatch
from model.engine.request import FinishReason, Request, Sequence, SequenceStatus
from model.engine.request_options import PLAIN, InvalidOption, RequestOptions
from model.engine.sampler import Sampler, SamplingRow, TokenLogprobs
from model.engine.sampling_params import SamplingParams
from model.engine.scheduler import QueueFullError, ScheduledSeq, Scheduler, SchedulerConfig
from model.engine.sequence_state import SamplingState
from model.engine.speculative import Drafter, SpecDecodeStats, SpeculativeConfig, Verification
from model.engine.stream import stream_for
from model.engine.speculative.build import build_speculator
from model.features.protocol import EngineView, Feature
from model.features.registry import EngineFeatures
from model import kernels
from model.kernels import ops
from model.loaders.memory import check_fits
from model.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from model.transformer import Transformer

log = logging.getLogger("llamascope.engine")

__all__ = ["Engine", "EngineConfig", "RequestOutput", "QueueFullError", "EngineStats", "FatalEngineError"]


class FatalEngineError(RuntimeError):
    """A step failure the engine cannot recover from (a tensor-parallel step that failed after its broadcast: the
    other ranks may be left inside a collective). It ends the engine thread; the server exits to be restarted."""


@dataclass
class EngineConfig:
    """The engine's capacity and paths. Each default is written here only: the server's Settings take theirs from
    these fields (service/config.py), and `Settings.engine_config()` builds this from them."""

    block_size: int = 16
    kv_cache_bytes: int = 1 << 30  # the block pool's budget; num_blocks, when set, wins
    num_blocks: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_waiting: int = 256
    max_background_tokens: int = 4  # tokens a step for background rows (patching sweeps) while others run or wait
    max_model_len: int | None = None  # default: the model's context length, clamped to the KV pool
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    # Pure decode steps as CUDA graphs per batch-size bucket (model/engine/cuda_graphs.py): "auto" on CUDA with
    # Triton, "off" (--enforce-eager), "eager" (the same static-buffer step without capture: for tests on CPU).
    decode_graphs: DecodeGraphMode = "auto"
    # Steps whose rows all attend over the paged pool (decode rows, and on CPU prefill chunks too) through every
    # block in one native call on CPU (model/engine/native_step.py); False runs them through the modules (tests
    # compare the two).
    native_step: bool = True
    # Speculative decoding (model/engine/speculative/): drafts verified in the engine's own step; None: off
    speculative: SpeculativeConfig | None = None
    # The KV cache's dtype: "auto" (float16 under quantized weights on CPU with the native kernels, else the
    # model's), "float32", "float16" / "bfloat16" under a float32 model on CPU, or "int8" (quantized per token and
    # head: under a float32 model on CPU, any model on a GPU) (paged_cache.cache_dtype)
    kv_cache_dtype: str = "auto"
    # Overlapped steps (model/engine/engine.py, `_overlapped_step`): decode step N + 1 launched before step N's
    # tokens are read back. None: where the model's stream runs beside the host (a GPU), not across tensor-parallel
    # ranks; False: every step waits for its own results.
    async_scheduling: bool | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    kv_usage: float
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens admitted
    prefix_cache_hits: int  # of which served from cache
    steps_by_path: dict[str, int] = field(default_factory=dict)  # engine steps per execution path
    # paths fallen back from, and how often: "triton_decode_attention" (its first launch failed: gather + SDPA),
    # "decode_graphs" (none on CUDA), "graph_capture" (captures that failed: those buckets decode eagerly)
    fallbacks: dict[str, int] = field(default_factory=dict)
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counters, when configured
    features: dict[str, dict[str, float]] = field(default_factory=dict)  # the per-row features' counters, by name


def resolve_max_model_len(requested: int | None, model_len: int, pool_tokens: int) -> int:
    """The longest sequence (prompt + max_tokens) the engine serves: the model's context, or less when asked, and
    never more than the KV pool holds (vLLM's start-up check). An explicit request beyond the pool is refused
    (ValueError naming both numbers); the model's own default is clamped to the pool with a warning."""
    if requested is not None and min(requested, model_len) > pool_tokens:
        raise ValueError(f"max_model_len {min(requested, model_len)} does not fit the KV cache, which holds "
                         f"{pool_tokens} tokens: raise --kv-cache-bytes or lower --max-model-len")
    limit = min(requested or model_len, model_len)
    if limit > pool_tokens:
        log.warning("max_model_len clamped from %d (the model's context) to %d, what the KV cache holds; raise "
                    "--kv-cache-bytes for longer sequences", limit, pool_tokens)
        limit = pool_tokens
    return limit


def _quantized_weights(model) -> bool:
    """Whether the model's matmuls are int8 / int4 (quantize_model's mark; a tensor-parallel model: rank 0's shard)."""
    return getattr(model, "shard", model).quantization != "none"


def _check_pools_fit(pool: int, draft_pool: int) -> None:
    """The served model's load reserved room for the engine's KV pool (`load_model(reserve_bytes=...)`), not for a
    draft model's beside it. With both models' weights resident and neither pool allocated yet, both must fit in what
    the machine has left, or the engine is refused with the figures: a pool faulted in past the machine's memory has
    the kernel kill the process half-way (a `"model": "self"` draft's pool is as large as the engine's, or larger)."""
    check_fits({"the served model's": pool, "the draft model's": draft_pool}, "the KV pools need",
               "choose a smaller --kv-cache-bytes or a smaller draft model", digits=2)


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: EngineConfig | None = None,
                 draft_model: Transformer | None = None) -> None:
        """`draft_model`: the proposer's model when `config.speculative` is a draft_model method (same vocabulary)."""
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or EngineConfig()
        kv_dtype = cache_dtype(config.kv_cache_dtype, model.dtype, model.device,
                               quantized=_quantized_weights(model))
        per_block = PagedKVCache.bytes_per_block(kv_config(model), config.block_size, kv_dtype)  # per rank under TP
        graphs = CudaGraphs.enabled(config.decode_graphs, model, config.block_size, kv_dtype)
        # captured decode graphs keep memory of their own (each graph's logits, the shared pool's working set): it
        # comes out of --kv-cache-bytes, as vLLM counts its graphs' memory before sizing the KV cache
        self.graph_reserve = (CudaGraphs.memory_estimate(model.config, config.max_num_seqs, model.dtype)
                              if graphs and config.decode_graphs == "auto" else 0)
        num_blocks = config.num_blocks or max(1, (config.kv_cache_bytes - self.graph_reserve) // per_block)
        self.max_model_len = resolve_max_model_len(config.max_model_len, model.config.max_seq_len,
                                                   num_blocks * config.block_size)
        self.sizes = EngineSizes(num_blocks, config.block_size, config.max_num_seqs, config.max_num_batched_tokens,
                                 self.max_model_len, config.max_logprobs)
        if draft_model is not None and config.speculative is not None and torch.device(model.device).type == "cpu":
            # the draft's pool: as many blocks as the engine's, in the draft's dtype (draft_model.DraftModelProposer)
            draft_pool = num_blocks * PagedKVCache.bytes_per_block(kv_config(draft_model), config.block_size,
                                                                   draft_model.dtype)
            _check_pools_fit(per_block * (num_blocks + graphs), draft_pool)
        # with decode graphs, one block more than the manager hands out: the padding rows' scratch block
        self.cache = PagedKVCache.for_model(model, num_blocks + graphs, config.block_size, kv_dtype)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.batch = PersistentBatch(config.max_num_seqs, self.sizes.max_blocks_per_seq)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.max_waiting,
                            config.max_background_tokens), self.kv, self.batch
        )
        self.scheduler.max_model_len = self.max_model_len
        stream = stream_for(model)
        self.distributed = getattr(model, "world_size", 1) > 1  # tensor parallelism: step failures are fatal
        self.async_scheduling = (stream.asynchronous and not self.distributed if config.async_scheduling is None
                                 else config.async_scheduling)
        self.in_flight: DecodeLaunch | None = None  # an overlapped decode step not read back yet
        # the per-row features, bound to this engine (model/features/registry.py)
        self.features = EngineFeatures(EngineView(self.distributed, self.max_model_len, config.block_size, model,
                                                  lambda: self.requests.values(), tokenizer, model.config.vocab_size,
                                                  config.max_num_seqs, torch.device(model.device).type))
        self.runner = ModelRunner(
            model, self.cache, Sampler(model.config.vocab_size, model.device, sync_free=self.async_scheduling),
            self.sizes, graph_mode=config.decode_graphs, native_step=config.native_step,
            scratch_block=num_blocks if graphs else None, batch=self.batch, stream=stream, features=self.features,
        )
        self.features.listen(self.runner.features_changed)  # (a feature's state changed: its graphs follow)
        self.context_shift = ContextShift(model, self.cache)  # windowed sequences' evictions (model/features/kv_window/)
        self.output = OutputProcessor(tokenizer)
        self.requests: dict[str, Request] = {}
        self._sibling_requests: set[Request] = set()  # requests with choices waiting for the first's prompt
        self._next_seq_id = 0
        # Test hook (fault injection): called with each step's scheduled sequences before the forward; whatever
        # it raises fails that step's requests exactly as a failing forward would.
        self.step_fault_hook: Callable[[list[ScheduledSeq]], None] | None = None
        # Rows of several new tokens: drafts proposed before each step and resolved after it (speculative
        # decoding's bookkeeping, model/engine/speculative/verification.py), from `drafter` (None: one token a row).
        # Drafts change no output: a draft is kept only where it equals the token sampled at its position.
        self.verification = Verification(None, self.kv, self._settle, model.config.vocab_size, self.max_model_len)
        if config.speculative is not None:
            self.drafter = build_speculator(config.speculative, model, draft_model, self.sizes,
                                            distributed=self.distributed)
        log.info("engine: %d KV blocks of %d tokens (%d tokens, %.0f MB, %s%s), max_model_len %d", num_blocks,
                 config.block_size, self.kv_cache_tokens, self.cache.nbytes / 1e6, str(kv_dtype).removeprefix("torch."),
                 "; made resident in the background" if self.cache.device.type == "cpu" else
                 f"; {self.graph_reserve / 1e6:.0f} MB of the budget kept for decode graphs" if self.graph_reserve else "",
                 self.max_model_len)
        self.runner.capture_graphs()
        self.decode_attention = self.cache.decode_backend  # what decode rows attend with (fixed once loaded)
        self.decode_graphs = ("off" if self.runner.graphs is None else
                              "captured" if self.runner.graphs.capture else "static buffers, not captured")
        cuda = self.cache.device.type == "cuda"
        # the instruction set the native CPU kernels serving this engine were built for (kernels.instruction_set:
        # "avx2" under LLAMASCOPE_NATIVE_KERNELS=portable on any x86 host); None off the CPU or where they are off
        self.cpu_kernels = kernels.built_for() if self.cache.device.type == "cpu" else None
        # paths the engine fell back from at start (`stats().fallbacks`; each logged where it was decided: the
        # Triton kernel's first launch, model/kernels/triton_attention.py; `CudaGraphs.enabled`)
        self.fallbacks = {"triton_decode_attention": int(cuda and self.decode_attention != "triton"),
                          "decode_graphs": int(cuda and config.decode_graphs == "auto" and self.runner.graphs is None)}

    # ---- requests ---------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    options: RequestOptions = PLAIN) -> Request:
        """Queue a request. ValueError for an invalid one, QueueFullError when the waiting queue is full.
        `options`: what it carries beside prompt and sampling (interventions, hidden-state reads, the registered
        per-row features, a kv window, background priority: model/engine/request_options.py)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        V = self.model.config.vocab_size
        if any(not 0 <= t < V for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {V})")
        params.validate(V, self.config.max_logprobs)
        c = self.model.config
        options.validate(c.n_layers)
        self.check(options)
        P, total = len(prompt_token_ids), len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len and options.kv_window is None:  # a window's cache stays within the context
            raise ValueError(
                f"prompt ({P} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the context length of {self.max_model_len}"
            )
        # n > 1 choices share the first one's cached prompt blocks; windowed choices own theirs (kv_cache_manager.py)
        share_prefix = params.n > 1 and self.config.enable_prefix_caching and options.kv_window is None
        self.scheduler.check_capacity(1 if share_prefix else params.n)
        req = Request(request_id, list(prompt_token_ids), params, options=options)
        self.features.admit(req, c)  # the per-row features' per-request state (an intervention plan)
        req.prefix_root = self.features.prefix_key(req)  # the registered features' shares (model/features/registry.py)
        for i in range(params.n):
            seq = Sequence(self._next_seq_id, req, i, req.prompt_token_ids)
            self._next_seq_id += 1
            seq.sampling = SamplingState(
                generator=params.make_generator(self.model.device, offset=i),  # choice i of a seeded request: seed + i
                stop_ids=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.tokenizer.stop_ids))
            self.features.start(seq)  # each feature's state of this choice
            seq.sampling.row = SamplingRow(params, seq.prompt_token_ids, seq.output_token_ids, seq.sampling.generator,
                                           seq.sampling.stop_ids)
            seq.output = self.output.new_state(params)
            req.seqs.append(seq)
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        for seq in req.seqs[1:]:
            if share_prefix:
                req.pending_siblings.append(seq)  # admitted once the first choice's prompt is cached
            else:
                self.scheduler.add(seq)
        if req.pending_siblings:
            self._sibling_requests.add(req)
        return req

    def feature(self, name: str) -> Feature:
        """This engine's per-row feature `name` (model/features/registry.py), for its per-engine calls: what it
        loads or drops between steps, on the engine thread (`AsyncEngine.call_feature`). KeyError."""
        return self.features.feature(name)

    @property
    def kv_cache_tokens(self) -> int:
        """The tokens the KV pool holds: the blocks the manager hands out, times their size."""
        return self.kv.num_blocks * self.config.block_size

    def check(self, options: RequestOptions) -> None:
        """The one check of what a request carries beside prompt and sampling against this engine: the sink + window
        cache fits, the per-row features' own checks (model/features/registry.py; one may compile what the request
        carries into a thread-safe cache the engine thread reads later), speculation is served here. InvalidOption
        naming the request field. Reads only fixed configuration and such caches, so any thread may ask; the service
        asks before it queues a request, on a worker thread where a check compiles."""
        self.features.check(options)
        self._check_speculation(options.num_speculative_tokens)

    def _check_speculation(self, k: int | None) -> None:
        """A request's `num_speculative_tokens` (None or 0: always served)."""
        if k is None or k == 0:
            return
        spec = self.config.speculative
        if spec is None:
            raise InvalidOption("num_speculative_tokens", "num_speculative_tokens: speculative decoding is not "
                                "configured on this server (--speculative-config)")
        if k > spec.num_speculative_tokens:
            raise InvalidOption("num_speculative_tokens", f"num_speculative_tokens must be at most "
                                f"{spec.num_speculative_tokens} (the server's --speculative-config), got {k}")

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Cancel a request at any moment; its blocks return to the pool at once. -> its choices' final outputs."""
        return self.process(self.abort_core(request_id))

    def abort_core(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
                   error: str | None = None) -> StepOutputs:
        """`abort` without the output processing (AsyncEngine's engine thread hands that to its output thread); each
        open choice ends with `reason` and `error`."""
        out = StepOutputs()
        req = self.requests.get(request_id)
        if req is None:
            return out
        req.pending_siblings.clear()
        self._sibling_requests.discard(req)
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, reason)
                out.finished[seq] = Finish(reason, error=error)
        self.requests.pop(request_id, None)
        return out

    def finish_by_output(self, seq: Sequence, end: Finish) -> None:
        """The output processor ended a choice (a stop string in its text, or its processing failed): the engine
        ends it too (a no-op when it has ended meanwhile)."""
        if not seq.is_finished:
            self._finish(seq, end.reason, end.stop_reason)

    def process(self, step: StepOutputs) -> list[RequestOutput]:
        """A step's outputs through the output processor here, on the caller's thread (the synchronous API)."""
        outs, ended = self.output.process(step, time.perf_counter())
        for seq, end in ended:
            self.finish_by_output(seq, end)
        return outs

    def has_unfinished(self) -> bool:
        return bool(self.requests) or self.in_flight is not None

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + sum(len(r.pending_siblings) for r in self._sibling_requests),
            num_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            kv_usage=self.kv.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.num_prompt_tokens,
            prefix_cache_hits=self.kv.num_cached_prompt_tokens,
            steps_by_path=dict(self.runner.path_counts),
            fallbacks={**self.fallbacks, **ops.triton_fallbacks(),
                       "graph_capture": self.runner.graphs.num_failed if self.runner.graphs is not None else 0},
            spec_decode=self.drafter.stats.copy() if self.config.speculative is not None else None,
            features=self.features.metrics(),
        )

    # ---- the step ---------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step and its outputs for clients (`core_step`, then the output processor on this thread)."""
        return self.process(self.core_step())

    def core_step(self) -> StepOutputs:
        """Schedule, run the model, update the engine's state: each choice's new tokens and how the engine ended any
        of them, for the output processor (which may run on another thread: AsyncEngine)."""
        if self.in_flight is not None:
            return self._overlapped_step()
        if self._sibling_requests:
            self._admit_siblings()
        if self.drafter is not None:
            self.verification.propose(self.scheduler.running)
        elif not self.distributed:
            seqs = self.scheduler.schedule_decode()
            if seqs is not None:
                return self._decode_step(seqs)
        sched = self.scheduler.schedule()
        step = StepOutputs()
        if not sched.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("scheduler made no progress with an idle batch (KV pool too small?)")
            return step
        # The step's outputs are collected as it produces them, so that a failure part-way through still delivers
        # the outputs (final ones included) of the sequences it already processed.
        try:
            if self.step_fault_hook is not None:
                self.step_fault_hook(sched.scheduled)
            result = self.runner.execute(sched.scheduled)
            for s in sched.scheduled:
                s.seq.num_computed_tokens += s.num_new_tokens
                if not s.seq.draft_token_ids:  # else settled once its drafts are resolved (`_update`)
                    self._settle(s.seq)
            self._update(result, step)
            return step
        except Exception as e:  # a failing step fails its own requests; the engine keeps serving the rest
            if self.distributed:  # ... except across processes, where ranks may be stranded mid-collective (vLLM)
                raise FatalEngineError(f"a tensor-parallel step failed: {type(e).__name__}: {e}") from e
            log.exception("engine step failed")
            for s in sched.scheduled:
                if not s.seq.is_finished:
                    self._finish(s.seq, FinishReason.ERROR)
                    step.finished[s.seq] = Finish(FinishReason.ERROR, error=f"generation failed: {type(e).__name__}")
            return step

    def _decode_step(self, seqs: list[Sequence]) -> StepOutputs:
        """The steady state's step: every running sequence decodes one token (`Scheduler.schedule_decode`), through
        the runner's decode path: the general step's work per row, without its per-row objects. With overlapped
        steps (`async_scheduling`) and rows that allow it, the step is launched and left in flight: its tokens come
        with the next step's outputs (`_overlapped_step`)."""
        try:
            if self.step_fault_hook is not None:
                self.step_fault_hook([ScheduledSeq(seq, 1) for seq in seqs])
            launch = self.runner.launch_decode(seqs)
        except Exception as e:
            return self._failed(seqs, e)
        self._launched(launch)
        if self.async_scheduling and self.scheduler.batch.all_overlappable(seqs):
            self.in_flight = launch
            return StepOutputs()
        return self._land(launch)

    def _overlapped_step(self) -> StepOutputs:
        """Step N + 1 scheduled and launched while step N runs on the device, then step N's results taken: the host
        works while the device does (vLLM's async scheduling, SGLang's overlap scheduler). Each row's input token is
        its sample in step N, which stays on the device. When the next step cannot be launched before step N's
        tokens are on the host (a request to admit, a prefill, a row that reads its tokens: `Request.overlappable`),
        step N is taken alone and the next step is an ordinary one."""
        prev = self.in_flight
        self.in_flight = None
        seqs = self.scheduler.schedule_decode(in_flight=True)
        if seqs and self.scheduler.batch.all_overlappable(seqs):
            try:
                if self.step_fault_hook is not None:
                    self.step_fault_hook([ScheduledSeq(seq, 1) for seq in seqs])
                launch = self.runner.launch_decode(seqs, prev=prev)
            except Exception as e:
                step = self._land(prev)
                failed = self._failed([s for s in seqs if not s.is_finished], e)
                step.finished.update(failed.finished)
                return step
            self._launched(launch)
            self.in_flight = launch
        return self._land(prev)

    def _launched(self, launch) -> None:
        for seq in launch.seqs:
            seq.num_computed_tokens += 1

    def _land(self, launch) -> StepOutputs:
        """A decode step's samples on the host: each row's token appended, its newly full block committed, and the
        rows the end-of-sequence rule ends (end_of_sequence.py, `_append`'s too) finished. A row whose sequence ended while the step ran (aborted, or ended by the token
        of the step before) is dropped."""
        step = StepOutputs()
        try:
            tokens, logprobs = launch.result()
        except Exception as e:
            return self._failed(launch.seqs, e)
        rows, positions = launch.seqs, launch.positions
        if launch.removals != self.scheduler.batch.removals and any(s.is_finished for s in rows):
            keep = [i for i, s in enumerate(rows) if not s.is_finished]
            rows, positions = [rows[i] for i in keep], positions[keep]
            tokens = [tokens[i] for i in keep]
            logprobs = [logprobs[i] for i in keep] if logprobs is not None else None
        step.seqs, step.tokens, step.logprobs = rows, tokens, logprobs
        bs, commit, max_len = self.kv.block_size, self.kv.enable_prefix_caching, self.max_model_len
        filled = (positions + 1) % bs == 0 if commit else None  # (n,): the rows whose token filled a block
        for i, (seq, token) in enumerate(zip(rows, tokens)):
            seq.output_token_ids.append(token)
            if commit and filled[i]:  # into the prefix cache (its tokens are all on the host now)
                self.kv.commit(seq)
            end = finish_after(seq, token, max_len)
            if end is not None:
                self._finish(seq, end.reason, end.stop_reason)
                step.finished[seq] = end
        window = self.model.config.sliding_window
        if window:  # the model's sliding window: blocks every later query attends past go back, as in `_settle`
            for seq in rows:
                if not seq.is_finished:
                    self.kv.release_behind_window(seq, window)
        return step

    def _failed(self, seqs: list[Sequence], e: Exception) -> StepOutputs:
        """A decode step that raised: its requests fail; the engine keeps serving the rest."""
        log.exception("engine step failed")
        step = StepOutputs()
        for seq in list(seqs):  # (finishing a sequence moves the batch's rows: `seqs` may be them)
            if not seq.is_finished:
                self._finish(seq, FinishReason.ERROR)
                step.finished[seq] = Finish(FinishReason.ERROR, error=f"generation failed: {type(e).__name__}")
        return step

    def _settle(self, seq: Sequence) -> None:
        """After a step computed tokens of `seq` (a drafting one's rejected drafts rolled back): its newly full
        blocks go to the prefix cache, and a windowed sequence that slid past a block gives it back."""
        self.kv.commit(seq)
        self.kv.release_behind_window(seq, self.model.config.sliding_window)  # the model's sliding window
        eviction = self.kv.evict(seq)
        if eviction is not None:
            self.context_shift.apply(eviction)

    def _update(self, result: RunnerOutput, step: StepOutputs) -> None:
        """The runner's tokens -> the sequences' outputs; sequences that end are finished and their blocks freed."""
        for seq, logprobs in result.prompt_logprobs:
            seq.num_scored_prompt_positions += len(logprobs)
            step.extra(seq).prompt_logprobs = logprobs
        rows = []  # each sequence's tokens to append: a drafting one's resolved first (its rejected K/V rolled back)
        for seq, sampled in _by_sequence(result.sampled):
            rows.append((seq, self.verification.resolve(seq, sampled) if seq.draft_token_ids else sampled))
        for seq, positions, values in result.hidden_states:  # not the positions of rejected drafts
            keep = [i for i, p in enumerate(positions) if p < seq.num_computed_tokens]
            if keep:
                step.extra(seq).hidden = ([positions[i] for i in keep],
                                          values if len(keep) == len(positions) else values[keep])
        for seq, upto in result.read_upto:
            seq.num_read_positions = max(seq.num_read_positions, min(upto, seq.num_computed_tokens))
        for seq, sampled in rows:
            tokens, logprobs, end = self._append(seq, sampled)
            step.add(seq, tokens, logprobs)
            per_token = result.per_token.get(seq)  # per sampled row: each kept token's values go out with it, alone
            if per_token is not None:
                step.extra(seq).per_token = {name: values[: len(tokens)] for name, values in per_token.items()}
            if end is not None:
                self._finish(seq, end.reason, end.stop_reason)
                step.finished[seq] = end
                hidden = step.extras[seq].hidden if seq in step.extras else None
                if hidden is not None and len(tokens) < len(sampled):
                    # drafts verified after the token that ended it: their positions' reads go with them (one token
                    # at a time would never have computed those positions)
                    last = seq.num_tokens - 1
                    keep = [i for i, p in enumerate(hidden[0]) if p < last]
                    step.extras[seq].hidden = ([hidden[0][i] for i in keep], hidden[1][keep]) if keep else None

    def _append(self, seq: Sequence, sampled: list[tuple[int, TokenLogprobs | None]]
                ) -> tuple[list[int], list[TokenLogprobs | None], Finish | None]:
        """Append a step's sampled tokens to `seq`, stopping at the first that ends it by the end-of-sequence rule
        (end_of_sequence.py, the decode path's too): what follows is never appended."""
        tokens: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        for token, lp in sampled:
            seq.output_token_ids.append(token)
            tokens.append(token)
            logprobs.append(lp)
            end = finish_after(seq, token, self.max_model_len)
            if end is not None:
                return tokens, logprobs, end
        return tokens, logprobs, None

    @property
    def drafter(self) -> Drafter | None:
        """What drafts each decoding sequence's tokens to verify (speculative/verification.py); None: one a row."""
        return self.verification.drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        self.verification.drafter = drafter

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.verification.release(seq)
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        req = seq.request
        if req.is_finished and self.requests.get(req.request_id) is req:
            del self.requests[req.request_id]

    def _admit_siblings(self) -> None:
        for req in list(self._sibling_requests):
            leader = req.seqs[0]
            if not req.pending_siblings:
                self._sibling_requests.discard(req)
            elif leader.is_finished or leader.num_computed_tokens >= leader.num_prompt_tokens:
                for seq in req.pending_siblings:
                    self.scheduler.add(seq)
                req.pending_siblings.clear()
                self._sibling_requests.discard(req)


def _by_sequence(sampled: list[tuple[Sequence, int, TokenLogprobs | None]]
                 ) -> list[tuple[Sequence, list[tuple[int, TokenLogprobs | None]]]]:
    """The runner's sampled rows grouped by sequence (a drafting sequence's rows are consecutive), in order."""
    out: list[tuple[Sequence, list[tuple[int, TokenLogprobs | None]]]] = []
    for seq, token, lp in sampled:
        if out and out[-1][0] is seq:
            out[-1][1].append((token, lp))
        else:
            out.append((seq, [(token, lp)]))
    return out
