"""The engine: `step()` = schedule -> one forward over the ragged batch -> sample -> update.

Synchronous and single-threaded; `async_engine.AsyncEngine` runs it on its own thread for the HTTP service.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from model.engine.cuda_graphs import DecodeGraphMode, DecodeGraphs
from model.engine.kv_cache_manager import KVCacheManager
from model.engine.paged_cache import PagedKVCache, SeqSlice, kv_config
from model.engine.sampler import Sampler, SamplingRow, TokenLogprobs, prompt_logprobs
from model.engine.sampling_params import SamplingParams
from model.engine.scheduler import QueueFullError, ScheduledSeq, Scheduler, SchedulerConfig
from model.engine.structured import StructuredOutputs
from model.engine.request import FinishReason, Request, Sequence, SequenceStatus
from model.text.stop_strings import StopStringMatcher
from model.text.detokenizer import IncrementalDetokenizer
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
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30  # the block pool's budget; num_blocks, when set, wins
    num_blocks: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_waiting: int = 256
    max_model_len: int | None = None  # default: the model's context length
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    # Pure decode steps as CUDA graphs per batch-size bucket (model/decode_graphs.py): "auto" on CUDA with Triton,
    # "off" (--enforce-eager), "eager" (the same static-buffer step without capture: for tests on CPU).
    decode_graphs: DecodeGraphMode = "auto"


@dataclass
class RequestOutput:
    """What one step produced for one choice of a request (deltas, not totals)."""

    request_id: str
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once, with the first token
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # so far, this choice
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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


class _SeqState:
    """Per-choice output state: streaming detokenizer, stop-string matcher, seeded generator, logprobs."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, index: int, device: torch.device) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop)
        self.generator = params.make_generator(device, offset=index)  # choice i of a seeded request: seed + i
        # ids that end this choice (min_tokens aside): its stop_token_ids, plus the checkpoint's EOS set unless
        # ignore_eos; fixed for the request's life, so built once rather than per generated token
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else tokenizer.stop_ids)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = [None] if params.prompt_logprobs is not None else None
        self.prompt_logprobs_sent = False
        self.grammar = None  # structured outputs: its SequenceGrammar, set by Engine.add_request


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: EngineConfig | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or EngineConfig()
        per_block = PagedKVCache.bytes_per_block(kv_config(model), config.block_size, model.dtype)  # per rank under TP
        num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // per_block)
        self.max_model_len = resolve_max_model_len(config.max_model_len, model.config.max_seq_len,
                                                   num_blocks * config.block_size)
        graphs = DecodeGraphs.enabled(config.decode_graphs, model, config.block_size)
        # with decode graphs, one block more than the manager hands out: the padding rows' scratch block
        self.cache = PagedKVCache.for_model(model, num_blocks + graphs, config.block_size)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.decode_graphs = DecodeGraphs(
            model, self.cache, scratch_block=num_blocks, max_num_seqs=config.max_num_seqs,
            max_blocks_per_seq=-(-self.max_model_len // config.block_size), capture=config.decode_graphs == "auto",
        ) if graphs else None
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.max_waiting), self.kv
        )
        self.sampler = Sampler(model.config.vocab_size, model.device)
        # [structured outputs] grammar compiler + cache and the step's mask buffer (nothing is built until used); masks
        # overlap the forward only off-CPU: on CPU the forward owns every core (benchmarks/bench_structured.py)
        self.structured = StructuredOutputs(tokenizer, model.config.vocab_size, config.max_num_seqs,
                                            overlap=torch.device(model.device).type != "cpu")
        self.requests: dict[str, Request] = {}
        self._next_seq_id = 0
        self.distributed = getattr(model, "world_size", 1) > 1  # tensor parallelism: step failures are fatal
        # Test hook (fault injection): called with each step's scheduled sequences before the forward; whatever
        # it raises fails that step's requests exactly as a failing forward would.
        self.step_fault_hook: Callable[[list[ScheduledSeq]], None] | None = None
        log.info("engine: %d KV blocks of %d tokens (%.0f MB), max_model_len %d", num_blocks, config.block_size,
                 self.cache.nbytes / 1e6, self.max_model_len)

    # ---- requests ---------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request. ValueError for an invalid one, QueueFullError when the waiting queue is full."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        V = self.model.config.vocab_size
        if any(not 0 <= t < V for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {V})")
        params.validate(V, self.config.max_logprobs)
        P, total = len(prompt_token_ids), len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({P} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the context length of {self.max_model_len}"
            )
        share_prefix = params.n > 1 and self.config.enable_prefix_caching
        self.scheduler.check_capacity(1 if share_prefix else params.n)
        # [structured outputs] compiled once per request (a cache hit when the service compiled it already)
        grammar = self.structured.compile(params.structured) if params.structured is not None else None
        req = Request(request_id, list(prompt_token_ids), params)
        for i in range(params.n):
            seq = Sequence(self._next_seq_id, req, i, req.prompt_token_ids)
            self._next_seq_id += 1
            seq.state = _SeqState(self.tokenizer, params, i, self.model.device)
            seq.state.grammar = grammar.new_state() if grammar is not None else None  # [structured outputs]
            req.seqs.append(seq)
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        for seq in req.seqs[1:]:
            if share_prefix:
                req.pending_siblings.append(seq)  # admitted once the first choice's prompt is cached
            else:
                self.scheduler.add(seq)
        return req

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Cancel a request at any moment; its blocks return to the pool at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        outs = []
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
                outs.append(self._output(seq, finish=True))
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
        )

    # ---- the step ---------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self._admit_siblings()
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
            self._run(sched.scheduled, outs)
            return outs
        except Exception as e:  # a failing step fails its own requests; the engine keeps serving the rest
            if self.distributed:  # ... except across processes, where ranks may be stranded mid-collective (vLLM)
                raise FatalEngineError(f"a tensor-parallel step failed: {type(e).__name__}: {e}") from e
            log.exception("engine step failed")
            for s in sched.scheduled:
                if not s.seq.is_finished:
                    self._finish(s.seq, FinishReason.ERROR)
                    out = self._output(s.seq, finish=True)
                    out.error = f"generation failed: {type(e).__name__}"
                    outs.append(out)
            self._drop_finished_requests()
            return outs

    @torch.inference_mode()
    def _run(self, scheduled, outs: list[RequestOutput]) -> None:
        tokens: list[int] = []
        positions: list[int] = []
        slices: list[SeqSlice] = []
        logits_rows: list[int] = []  # flat token index of each logits row we need
        sample_at: list[tuple[Sequence, int]] = []  # (seq, logits row) for sequences that complete this step
        prompt_lp_at: list[tuple[Sequence, int, int, int]] = []  # (seq, first row, first position, count)
        for s in scheduled:
            seq, n = s.seq, s.num_new_tokens
            start, offset = seq.num_computed_tokens, len(tokens)
            tokens += seq.token_ids(start, start + n)
            positions += range(start, start + n)
            slices.append(SeqSlice(offset, n, start + n, seq.block_ids))
            state: _SeqState = seq.state
            if state.prompt_logprobs is not None and len(state.prompt_logprobs) < seq.num_prompt_tokens:
                # logits at position j score prompt token j + 1; skip positions already scored before a preemption
                # (the scheduler never lets the prefix cache skip past the ones not yet scored)
                assert start <= seq.num_scored_prompt_positions, "prompt logprobs would skip positions"
                first = max(start, seq.num_scored_prompt_positions)
                count = min(start + n, seq.num_prompt_tokens - 1) - first
                if count > 0:
                    prompt_lp_at.append((seq, len(logits_rows), first, count))
                    logits_rows += range(offset + first - start, offset + first - start + count)
            if start + n == seq.num_tokens:
                sample_at.append((seq, len(logits_rows)))
                logits_rows.append(offset + n - 1)
        dev = self.model.device
        # [structured outputs] the sampling rows' grammar masks, filled on a worker thread during the forward
        masks = self.structured.start_masks([(seq.state.grammar, seq.output_token_ids) for seq, _ in sample_at])
        if self.decode_graphs is not None and not prompt_lp_at and self.decode_graphs.accepts(slices):
            logits = self.decode_graphs.run(slices, tokens, positions).float()  # (M, V), one row per sequence
        else:
            self.cache.set_step(slices)
            logits = self.model(
                torch.tensor([tokens], device=dev),
                torch.tensor([positions], device=dev),
                self.cache,
                logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            )[0].float()  # (M, V)
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.kv.commit(s.seq)
        for seq, row, first, count in prompt_lp_at:
            targets = torch.tensor(seq.prompt_token_ids[first + 1 : first + 1 + count], device=dev)
            seq.state.prompt_logprobs += prompt_logprobs(logits[row : row + count], targets, seq.request.params.prompt_logprobs)
            seq.num_scored_prompt_positions = len(seq.state.prompt_logprobs) - 1
        if sample_at:
            rows = [
                SamplingRow(seq.request.params, seq.prompt_token_ids, seq.output_token_ids, seq.state.generator,
                            seq.state.stop_ids)
                for seq, _ in sample_at
            ]
            allowed = masks.result() if masks is not None else None  # [structured outputs]
            sampled = self.sampler(logits[[r for _, r in sample_at]], rows, allowed)
            for (seq, _), token, lp in zip(sample_at, sampled.token_ids, sampled.logprobs):
                outs.append(self._append_token(seq, token, lp))
        self._drop_finished_requests()

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> RequestOutput:
        p, state = seq.request.params, seq.state
        seq.output_token_ids.append(token)
        out = self._output(seq)
        out.token_ids = [token]
        out.logprobs = [lp] if lp is not None else None
        n_out = len(seq.output_token_ids)
        may_stop = n_out >= p.min_tokens  # neither stop tokens nor stop strings end it before min_tokens
        if may_stop and token in state.stop_ids:
            # The stop token's own text is not part of the completion (OpenAI / vLLM); text held back as a
            # possible stop-string start turned out not to be one.
            self._finish(seq, FinishReason.STOP, stop_reason=token if token in p.stop_token_ids else None)
            out.text = state.stops.flush()
            return self._final(seq, out)
        # [structured outputs] advance the grammar; a complete grammar ends the choice like a stop (min_tokens aside)
        grammar_done = state.grammar is not None and state.grammar.accept(token)
        ending = grammar_done or n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len
        delta = state.detok.feed(token) + (state.detok.flush() if ending else "")
        if may_stop:
            out.text, matched = state.stops.feed(delta)
            if matched is not None:
                self._finish(seq, FinishReason.STOP, stop_reason=matched)
                return self._final(seq, out)
        else:
            out.text = delta
        if ending:
            out.text += state.stops.flush()
            self._finish(seq, FinishReason.STOP if grammar_done else FinishReason.LENGTH)
            return self._final(seq, out)
        return out

    def _final(self, seq: Sequence, out: RequestOutput) -> RequestOutput:
        out.finish_reason = seq.finish_reason.value
        out.stop_reason = seq.stop_reason
        return out

    def _output(self, seq: Sequence, finish: bool = False) -> RequestOutput:
        state: _SeqState = seq.state
        out = RequestOutput(
            seq.request.request_id, seq.index,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            num_cached_tokens=max(0, seq.num_cached_tokens),
        )
        if state.prompt_logprobs is not None and not state.prompt_logprobs_sent:
            out.prompt_logprobs = state.prompt_logprobs
            state.prompt_logprobs_sent = True
        if finish:
            self._final(seq, out)
        return out

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
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
