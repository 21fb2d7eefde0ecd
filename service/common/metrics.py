"""Prometheus metrics on an app-owned registry, all under `llamascope_`, units in the names.

Routes record per-request figures; an AsyncEngine step hook records per-step ones (engine thread).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TOKENS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "llamascope_"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "request start to first generated token", registry=r, buckets=_LATENCY)
        self.itl = Histogram(p + "inter_token_latency_seconds", "time between streamed tokens of a choice", registry=r, buckets=_LATENCY)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "request start to last token", registry=r, buckets=_LATENCY)
        self.queue = Histogram(p + "request_queue_time_seconds", "request start to first engine output", registry=r, buckets=_LATENCY)
        self.prompt_len = Histogram(p + "request_prompt_tokens", "prompt tokens per request", registry=r, buckets=_TOKENS)
        self.gen_len = Histogram(p + "request_generation_tokens", "generated tokens per request (all choices)", registry=r, buckets=_TOKENS)
        self.step = Histogram(p + "engine_step_seconds", "one engine step (schedule, forward, sample, update)", registry=r, buckets=_LATENCY)
        self.requests = Counter(p + "requests", "finished HTTP requests", ["endpoint", "status"], registry=r)
        self.steps = Counter(p + "engine_steps", "engine steps by the execution path the model runner chose "
                             "(cuda_graph, native, module)", ["path"], registry=r)
        self.finished = Counter(p + "request_finish", "finished choices by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated", registry=r)
        self.cached_tokens = Counter(p + "prefix_cache_hit_tokens", "prompt tokens served from the prefix cache", registry=r)
        self.preemptions = Counter(p + "preemptions", "sequences preempted for KV blocks", registry=r)
        self.aborts = Counter(p + "aborted_requests", "requests aborted (client gone or cancelled)", registry=r)
        self.lora_requests = Counter(p + "lora_requests", "requests finished under a LoRA adapter (200s)", ["adapter"], registry=r)
        self.lora_generation_tokens = Counter(p + "lora_generation_tokens", "tokens generated under a LoRA adapter",
                                              ["adapter"], registry=r)
        self.inspect_seconds = Histogram(p + "inspect_seconds", "one /inspect probe on the engine thread (queue + compute)", registry=r, buckets=_LATENCY)
        self.inspect_tokens = Counter(p + "inspect_tokens", "tokens run through /inspect probes", registry=r)
        self.running = Gauge(p + "num_requests_running", "sequences in the running batch", registry=r)
        self.fallbacks = Gauge(p + "engine_fallbacks", "times the engine fell back from a faster path, by kind "
                               "(triton_decode_attention, triton_cache, decode_graphs, graph_capture)", ["kind"],
                               registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "sequences waiting to run", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "fraction of KV blocks held by live sequences", registry=r)
        self.kv_blocks = Gauge(p + "kv_cache_blocks_in_use", "KV blocks held by live sequences", registry=r)
        # speculative decoding (vLLM's vllm:spec_decode_* counters), counted when --speculative-config is on
        self.spec_drafts = Counter(p + "spec_decode_num_drafts", "engine-step rows that verified drafts", registry=r)
        self.spec_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "draft tokens verified", registry=r)
        self.spec_accepted = Counter(p + "spec_decode_num_accepted_tokens", "draft tokens accepted", registry=r)
        self.spec_emitted = Counter(p + "spec_decode_num_emitted_tokens", "tokens emitted by verifying rows "
                                    "(accepted drafts + the token sampled after them)", registry=r)
        self.spec_accepted_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos", "draft tokens accepted by "
                                         "position in the row's drafts (0: the first)", ["position"], registry=r)
        self.spec_drafted_pos = Counter(p + "spec_decode_num_draft_tokens_per_pos", "draft tokens verified by "
                                        "position in the row's drafts; accepted / verified is the acceptance rate "
                                        "per position", ["position"], registry=r)
        self._last_spec = None
        self._last_preemptions = 0
        self._last_steps: dict[str, int] = {}
        # llamascope_process_resident_memory_bytes and friends (Linux /proc): the load harness reads RSS growth here
        ProcessCollector(namespace="llamascope", registry=r)

    def on_step(self, stats, outputs, seconds: float) -> None:
        """AsyncEngine step hook (engine thread): `stats` is the snapshot the engine thread just published."""
        self.step.observe(seconds)
        self.set_gauges(stats)
        self.preemptions.inc(stats.num_preemptions - self._last_preemptions)
        self._last_preemptions = stats.num_preemptions
        for path, n in stats.steps_by_path.items():
            self.steps.labels(path).inc(n - self._last_steps.get(path, 0))
        self._last_steps = dict(stats.steps_by_path)
        if stats.spec_decode is not None:
            self._count_speculation(stats.spec_decode)

    def _count_speculation(self, now) -> None:
        last = self._last_spec
        if last is not None and now.num_drafts == last.num_drafts:
            return  # nothing verified since the last step
        for counter, name in ((self.spec_drafts, "num_drafts"), (self.spec_draft_tokens, "num_draft_tokens"),
                              (self.spec_accepted, "num_accepted_tokens"), (self.spec_emitted, "num_emitted_tokens")):
            counter.inc(getattr(now, name) - (getattr(last, name) if last is not None else 0))
        for pos, (acc, drafted) in enumerate(zip(now.accepted_per_position, now.drafted_per_position)):
            self.spec_accepted_pos.labels(str(pos)).inc(acc - (last.accepted_per_position[pos] if last else 0))
            self.spec_drafted_pos.labels(str(pos)).inc(drafted - (last.drafted_per_position[pos] if last else 0))
        self._last_spec = now

    def set_gauges(self, stats) -> None:
        """The gauges from an engine stats snapshot (a scrape refreshes them too: aborts move them between steps)."""
        for kind, n in stats.fallbacks.items():
            self.fallbacks.labels(kind).set(n)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.kv_blocks.set(stats.num_blocks - stats.num_free_blocks)
