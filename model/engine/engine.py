"""The engine: `step()` = schedule -> the model runner executes the step -> the output processor updates.

Synchronous and single-threaded; `async_engine.AsyncEngine` runs it on its own thread for the HTTP service. The
shape is vLLM's engine core (`step()` = `schedule()` -> `execute_model()` -> `update_from_output()`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from model.engine.context_shift import ContextShift
from model.engine.cuda_graphs import CudaGraphs, DecodeGraphMode
from model.engine.kv_cache_manager import KVCacheManager
from model.engine.kv_window import KVWindow
from model.engine.model_runner import ModelRunner, RunnerOutput
from model.engine.output_processor import OutputProcessor, RequestOutput
from model.engine.paged_cache import PagedKVCache, cache_dtype, kv_config
from model.engine.request import FinishReason, Request, Sequence, SequenceStatus
from model.engine.request_options import PLAIN, RequestOptions
from model.engine.sampler import Sampler, TokenLogprobs, replay_noise
from model.engine.sampling_params import SamplingParams
from model.engine.scheduler import QueueFullError, ScheduledSeq, Scheduler, SchedulerConfig
from model.engine.sequence_state import SamplingState
from model.engine.speculative import Drafter, SpecDecodeStats, SpeculativeConfig
from model.engine.speculative.build import build_speculator
from model.engine.structured import StructuredOutputs
from model.interventions import InterventionPlan
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
    # Pure decode steps through every block in one native call on CPU (model/engine/native_decode.py); False runs
    # them through the modules (tests compare the two).
    native_decode: bool = True
    # Speculative decoding (model/engine/speculative/): drafts verified in the engine's own step; None: off
    speculative: SpeculativeConfig | None = None
    # The KV cache's dtype: "auto" (float16 under quantized weights on CPU with the native kernels, else the
    # model's), "float32", or "float16" / "bfloat16" under a float32 model on CPU (paged_cache.cache_dtype)
    kv_cache_dtype: str = "auto"


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
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counters, when configured


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
        num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // per_block)
        self.max_model_len = resolve_max_model_len(config.max_model_len, model.config.max_seq_len,
                                                   num_blocks * config.block_size)
        graphs = CudaGraphs.enabled(config.decode_graphs, model, config.block_size)
        if draft_model is not None and config.speculative is not None and torch.device(model.device).type == "cpu":
            # the draft's pool: as many blocks as the engine's, in the draft's dtype (draft_model.DraftModelProposer)
            draft_pool = num_blocks * PagedKVCache.bytes_per_block(kv_config(draft_model), config.block_size,
                                                                   draft_model.dtype)
            _check_pools_fit(per_block * (num_blocks + graphs), draft_pool)
        # with decode graphs, one block more than the manager hands out: the padding rows' scratch block
        self.cache = PagedKVCache.for_model(model, num_blocks + graphs, config.block_size, kv_dtype)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.max_waiting,
                            config.max_background_tokens), self.kv
        )
        # [structured outputs] grammar compiler + cache and the step's mask buffer (nothing is built until used); masks
        # overlap the forward only off-CPU: on CPU the forward owns every core (benchmarks/bench_structured.py)
        self.structured = StructuredOutputs(tokenizer, model.config.vocab_size, config.max_num_seqs,
                                            overlap=torch.device(model.device).type != "cpu")
        self.runner = ModelRunner(
            model, self.cache, Sampler(model.config.vocab_size, model.device), config.max_num_batched_tokens,
            config.max_num_seqs, self.max_model_len, config.decode_graphs, config.native_decode,
            scratch_block=num_blocks if graphs else None, structured=self.structured,
        )
        self.context_shift = ContextShift(model, self.cache)  # windowed sequences' evictions (kv_window.py)
        self.output = OutputProcessor(tokenizer, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._next_seq_id = 0
        self.distributed = getattr(model, "world_size", 1) > 1  # tensor parallelism: step failures are fatal
        # Test hook (fault injection): called with each step's scheduled sequences before the forward; whatever
        # it raises fails that step's requests exactly as a failing forward would.
        self.step_fault_hook: Callable[[list[ScheduledSeq]], None] | None = None
        # Rows of several new tokens: asked before each step for tokens to verify after each decoding sequence's
        # last one (model/engine/speculative/drafter.py); None: one token a row. Drafts change no output: a draft is
        # kept only where it equals the token sampled at its position.
        self.drafter: Drafter | None = None
        self._noise_states: dict[Sequence, torch.Tensor] = {}  # seeded drafting rows' generator before the step
        if config.speculative is not None:
            self.drafter = build_speculator(
                config.speculative, model, draft_model, distributed=self.distributed,
                num_blocks=num_blocks, block_size=config.block_size,
                max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len)
        log.info("engine: %d KV blocks of %d tokens (%.0f MB, %s%s), max_model_len %d", num_blocks, config.block_size,
                 self.cache.nbytes / 1e6, str(kv_dtype).removeprefix("torch."),
                 "; made resident in the background" if self.cache.device.type == "cpu" else "", self.max_model_len)
        self.runner.capture_graphs()

    # ---- requests ---------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    options: RequestOptions = PLAIN) -> Request:
        """Queue a request. ValueError for an invalid one, QueueFullError when the waiting queue is full.
        `options`: what it carries beside prompt and sampling (interventions, hidden-state reads, telemetry, a
        kv window, a grammar, background priority: model/engine/request_options.py)."""
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
        self._check_extensions(options)
        self.check_speculation(options.num_speculative_tokens)
        P, total = len(prompt_token_ids), len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len and options.kv_window is None:  # a window's cache stays within the context
            raise ValueError(
                f"prompt ({P} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the context length of {self.max_model_len}"
            )
        plan = InterventionPlan(list(options.interventions), P, c.n_layers, c.dim) if options.interventions else None
        # n > 1 choices share the first one's cached prompt blocks; windowed choices own theirs (kv_cache_manager.py)
        share_prefix = params.n > 1 and self.config.enable_prefix_caching and options.kv_window is None
        self.scheduler.check_capacity(1 if share_prefix else params.n)
        # [structured outputs] compiled once per request (a cache hit when the service compiled it already)
        grammar = self.structured.compile(options.structured) if options.structured is not None else None
        req = Request(request_id, list(prompt_token_ids), params, options=options, interventions=plan)
        for i in range(params.n):
            seq = Sequence(self._next_seq_id, req, i, req.prompt_token_ids)
            self._next_seq_id += 1
            seq.sampling = SamplingState(
                generator=params.make_generator(self.model.device, offset=i),  # choice i of a seeded request: seed + i
                stop_ids=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.tokenizer.stop_ids),
                grammar=grammar.new_state() if grammar is not None else None)  # [structured outputs]
            seq.output = self.output.new_state(params)
            req.seqs.append(seq)
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        for seq in req.seqs[1:]:
            if share_prefix:
                req.pending_siblings.append(seq)  # admitted once the first choice's prompt is cached
            else:
                self.scheduler.add(seq)
        return req

    def check_window(self, w: KVWindow) -> None:
        """ValueError unless this engine can serve a sink + window cache of this size."""
        if self.distributed:  # the ranks' caches would need every eviction too
            raise ValueError("kv_window is not supported with tensor parallelism")
        need = w.max_cache_tokens(self.config.block_size)
        if need > self.max_model_len:
            raise ValueError(f"kv_window: sink_tokens ({w.sink_tokens}) + window ({w.window}) + block_size "
                             f"({self.config.block_size}) = {need} exceeds the context length of {self.max_model_len}")

    def _check_extensions(self, options: RequestOptions) -> None:
        """ValueError for a kv_window or telemetry this engine cannot serve."""
        if options.kv_window is not None:
            self.check_window(options.kv_window)
        if options.telemetry is not None and self.distributed:
            raise ValueError("attention telemetry is not supported with tensor parallelism")

    def check_speculation(self, k: int | None) -> None:
        """ValueError unless this engine can serve a request's `num_speculative_tokens` (None or 0: always)."""
        if k is None or k == 0:
            return
        spec = self.config.speculative
        if spec is None:
            raise ValueError("num_speculative_tokens: speculative decoding is not configured on this server "
                             "(--speculative-config)")
        if k > spec.num_speculative_tokens:
            raise ValueError(f"num_speculative_tokens must be at most {spec.num_speculative_tokens} (the server's "
                             f"--speculative-config), got {k}")

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Cancel a request at any moment; its blocks return to the pool at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        outs = []
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
                outs.append(self.output.output(seq))
        req.pending_siblings.clear()
        return outs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + sum(len(r.pending_siblings) for r in self.requests.values()),
            num_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            kv_usage=self.kv.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.num_prompt_tokens,
            prefix_cache_hits=self.kv.num_cached_prompt_tokens,
            steps_by_path=dict(self.runner.path_counts),
            spec_decode=self.drafter.stats.copy() if self.config.speculative is not None else None,
        )

    # ---- the step ---------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self._admit_siblings()
        if self.drafter is not None:
            self._propose_drafts()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("scheduler made no progress with an idle batch (KV pool too small?)")
            return []
        # Outputs are collected here as the step produces them, so that a failure part-way through still delivers
        # the outputs (final ones included) of the sequences it already processed.
        outs: list[RequestOutput] = []
        try:
            if self.step_fault_hook is not None:
                self.step_fault_hook(sched.scheduled)
            result = self.runner.execute(sched.scheduled)
            for s in sched.scheduled:
                s.seq.num_computed_tokens += s.num_new_tokens
                if not s.seq.draft_token_ids:  # else settled once its drafts are resolved (`_update`)
                    self._settle(s.seq)
            self._update(result, outs)
            return outs
        except Exception as e:  # a failing step fails its own requests; the engine keeps serving the rest
            if self.distributed:  # ... except across processes, where ranks may be stranded mid-collective (vLLM)
                raise FatalEngineError(f"a tensor-parallel step failed: {type(e).__name__}: {e}") from e
            log.exception("engine step failed")
            for s in sched.scheduled:
                if not s.seq.is_finished:
                    self._finish(s.seq, FinishReason.ERROR)
                    out = self.output.output(s.seq)
                    out.error = f"generation failed: {type(e).__name__}"
                    outs.append(out)
            self._drop_finished_requests()
            return outs

    def _settle(self, seq: Sequence) -> None:
        """After a step computed tokens of `seq` (a drafting one's rejected drafts rolled back): its newly full
        blocks go to the prefix cache, and a windowed sequence that slid past a block gives it back."""
        self.kv.commit(seq)
        self.kv.release_behind_window(seq, self.model.config.sliding_window)  # (families: a model's sliding window)
        eviction = self.kv.evict(seq)
        if eviction is not None:
            self.context_shift.apply(eviction)

    def _update(self, result: RunnerOutput, outs: list[RequestOutput]) -> None:
        """The runner's tokens -> outputs; sequences that end are finished and their blocks freed."""
        for seq, logprobs in result.prompt_logprobs:
            self.output.add_prompt_logprobs(seq, logprobs)
        rows = []  # each sequence's tokens to append: a drafting one's resolved first (its rejected K/V rolled back)
        for seq, sampled in _by_sequence(result.sampled):
            rows.append((seq, self._resolve_drafts(seq, sampled) if seq.draft_token_ids else sampled))
        for seq, positions, values in result.hidden_states:  # not the positions of rejected drafts
            keep = [i for i, p in enumerate(positions) if p < seq.num_computed_tokens]
            if keep:
                self.output.add_hidden_states(seq, [positions[i] for i in keep],
                                              values if len(keep) == len(positions) else values[keep])
        for seq, upto in result.read_upto:
            seq.num_read_positions = max(seq.num_read_positions, min(upto, seq.num_computed_tokens))
        for seq, sampled in rows:
            telemetry = result.telemetry.get(seq)  # per sampled row: each kept token's goes out with it, alone
            deltas, finish = self.output.append_all(seq, sampled, each=telemetry is not None)
            for out, tel in zip(deltas, telemetry or [None] * len(deltas)):
                out.telemetry = tel
            if finish is not None:
                self._finish(seq, finish.reason, finish.stop_reason)
                deltas[-1].finish_reason, deltas[-1].stop_reason = seq.finish_reason.value, seq.stop_reason
            outs += deltas
        self._drop_finished_requests()

    def _propose_drafts(self) -> None:
        """Ask the drafter for tokens to verify after each decoding sequence's last one (rows of several tokens).
        A grammar's sequence keeps the drafts its grammar accepts (the verification rows are masked as it stands
        after each); a hidden-state read gets the positions of the kept tokens only; a windowed sequence drafts no
        further than its next eviction point (kv_window.py's chunk_limit: its K/V is evicted, and its keys shifted,
        only once its drafts are resolved, so a rollback never meets an eviction) and, its cache being bounded, past
        the context too. Attention telemetry is recorded for every verification row, and each kept token's goes
        out with it. Not for sequences whose request turned speculation off."""
        seqs, rooms = [], []
        bs = self.kv.block_size
        for seq in self.scheduler.running:
            o = seq.request.options
            if seq.draft_token_ids or seq.num_computed_tokens != seq.num_tokens - 1 or o.num_speculative_tokens == 0:
                continue
            w = o.kv_window
            reach = self.max_model_len - seq.num_tokens - 1 if w is None else w.chunk_limit(seq.num_computed_tokens, bs) - 1
            room = min(seq.request.params.max_tokens - len(seq.output_token_ids) - 1, reach)
            if o.num_speculative_tokens is not None:
                room = min(room, o.num_speculative_tokens)
            if room > 0:
                seqs.append(seq)
                rooms.append(room)
        if not seqs:
            return
        for seq, room, drafts in zip(seqs, rooms, self.drafter.propose(seqs, rooms, len(self.scheduler.running))):
            seq.draft_token_ids = list(drafts)[:room]
            grammar = seq.sampling.grammar
            if grammar is not None and seq.draft_token_ids:
                seq.draft_token_ids = grammar.valid_drafts(seq.draft_token_ids, seq.request.params.max_tokens
                                                           - len(seq.output_token_ids))
            g = seq.sampling.generator
            if seq.draft_token_ids and g is not None:
                self._noise_states[seq] = g.get_state()

    def _resolve_drafts(self, seq: Sequence, sampled: list[tuple[int, TokenLogprobs | None]]
                        ) -> list[tuple[int, TokenLogprobs | None]]:
        """A drafting sequence's rows were sampled each as if the drafts before it were accepted: keep the drafts
        the samples agree with and the sample after them (a draft accepted only when it equals the token sampled
        at its position, so the output is what decoding one token at a time samples), roll back the K/V of the
        rest, then settle it (commit its newly full blocks; a windowed one's eviction). -> the tokens to append,
        in order."""
        drafts = seq.draft_token_ids
        j = 0
        while j < len(drafts) and sampled[j][0] == drafts[j]:
            j += 1
        self.kv.rollback(seq, len(drafts) - j)
        seq.draft_token_ids = []
        self._settle(seq)
        state = self._noise_states.pop(seq, None)
        if state is not None and j < len(drafts):  # a seeded row drew noise for rows it did not keep: replay the kept
            seq.sampling.generator.set_state(state)
            replay_noise(seq.sampling.generator, seq.request.params, self.model.config.vocab_size, j + 1)
        self.drafter.resolved(seq, len(drafts), j)
        return sampled[: j + 1]

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if self.drafter is not None:
            self.drafter.release(seq)
            self._noise_states.pop(seq, None)
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def _admit_siblings(self) -> None:
        for req in self.requests.values():
            if req.pending_siblings:
                leader = req.seqs[0]
                if leader.is_finished or leader.num_computed_tokens >= leader.num_prompt_tokens:
                    for seq in req.pending_siblings:
                        self.scheduler.add(seq)
                    req.pending_siblings.clear()

    def _drop_finished_requests(self) -> None:
        for rid in [rid for rid, r in self.requests.items() if r.is_finished]:
            del self.requests[rid]


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
