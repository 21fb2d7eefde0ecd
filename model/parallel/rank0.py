"""Tensor parallelism, rank 0's side: `launch` starts the workers and loads rank 0's shard; `TPModel` is what the
engine, the probes and the service then use as "the model".

`TPModel` answers like a `Transformer`: `config` is the whole model's (vocabulary, heads, layers as clients see
them), `kv_config` this rank's (the KV heads its paged cache holds, what the engine sizes its block pool with), and
calling it broadcasts the step (model/tp_worker.py) before running rank 0's own shard. `layers[i]` called with a
`ProbeAttention` runs block i on every rank and gathers the per-head probe statistics, so `probes.ProbeRun` works
on it unchanged.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from model.loaders.checkpoint import LoadedModel, default_model_path, load_model
from model.loaders.errors import CheckpointError
from model.loaders.hub import resolve_checkpoint
from model.features.lora import LoRAAdapter, step_rows
from model.dtypes import dtype_name
from model.engine.forward_context import ForwardContext
from model.parallel.plan import ShardPlan, TPRank, cuda_device, install_row_parallel, parameter_bytes
from model.parallel.worker import STOP, BlockMsg, CacheSpec, Channel, LoRAMsg, StepMsg, init_group, run_block, run_step
from model.transformer import Transformer

log = logging.getLogger("llamascope.tp")


class _DistributedBlock:
    """Block i of a TPModel as `ProbeRun` calls it: (h, cos, sin, ctx) -> h, on all ranks at once; `ctx` says what
    each rank should measure (`rank_probe(i)`) and merges what they measured (`merge_ranks`)."""

    def __init__(self, tp: "TPModel", index: int) -> None:
        self.tp, self.index = tp, index

    def __call__(self, h: Tensor, cos: Tensor, sin: Tensor, ctx) -> Tensor:
        i, tp = self.index, self.tp
        msg = BlockMsg(i, ctx.rank_probe(i), tuple(h.shape))
        tp.channel.send(msg)
        tp.channel.broadcast(h.contiguous())
        out, measured = run_block(tp.shard, tp.plan, msg, h)
        ctx.merge_ranks(i, tp.channel.gather(measured))
        return out


class TPModel:
    # An inspection runs each block across every rank in one message (`_DistributedBlock`), so whole blocks at a time.
    supports_row_chunks = False

    def __init__(self, shard: Transformer, channel: Channel, workers: list[subprocess.Popen]) -> None:
        self.shard, self.channel, self.workers = shard, channel, workers
        self.plan: ShardPlan = shard.tp_plan
        self.config = self.plan.config
        self.kv_config = shard.config
        self.tok_embeddings, self.rope, self.norm, self.output = shard.tok_embeddings, shard.rope, shard.norm, shard.output
        self.layers = [_DistributedBlock(self, i) for i in range(self.config.n_layers)]
        self._cache = lambda: None  # weak reference to the cache the workers mirror
        self._generation = 0
        self.closed = False

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        return self.shard.embed_tokens(tokens)  # (replicated on every rank)

    def logits(self, h: Tensor) -> Tensor:
        return self.shard.logits(h)

    @property
    def device(self) -> torch.device:
        return self.shard.device

    @property
    def dtype(self) -> torch.dtype:
        return self.shard.dtype

    @property
    def world_size(self) -> int:
        return self.plan.tp.world_size

    def __call__(
        self, tokens: Tensor, positions: Tensor | None = None, ctx: ForwardContext | None = None,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """As `Transformer.forward`; the context, if any, must be an engine step's `ForwardContext` (each worker
        mirrors its cache and rebuilds the same context from its slices and edits)."""
        if self.closed:
            raise RuntimeError("the tensor-parallel workers have been stopped")
        for rank, p in enumerate(self.workers, 1):  # a lost rank fails this step at once rather than in a collective
            if p.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {p.returncode})")
        spec = None
        if ctx is not None:
            if not isinstance(ctx, ForwardContext):
                raise TypeError(f"tensor parallelism serves engine steps (a ForwardContext), not {type(ctx).__name__}")
            cache = ctx.cache
            if self._cache() is not cache:  # a new engine: the workers build a pool of the same blocks
                self._generation += 1
                self._cache = weakref.ref(cache)
                spec = CacheSpec(self._generation, cache.num_blocks, cache.block_size, cache.k.dtype)
        edits = ctx.edits if ctx is not None else None
        rows = step_rows(ctx.parts) if ctx is not None else None  # the step's rows under adapters
        lora = [(a.name, rows.rows_on_host(g)) for g, (a, _) in enumerate(rows.groups)] if rows else None
        msg = StepMsg(tokens.tolist(), positions.tolist() if positions is not None else None,
                      ctx.slices if ctx is not None else None, spec,
                      edits.without_reads() if edits is not None and edits.has_edits else None, lora)
        self.channel.send(msg)
        if ctx is None:
            return run_step(self.shard, msg, None, logits_indices)
        return self.shard(tokens, positions, ctx, logits_indices=logits_indices)

    def add_lora(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """Serve a LoRA adapter of the whole model on every rank: the workers are sent it and each keeps its share;
        -> rank 0's share (`ShardPlan.shard_adapter`), what its runner applies."""
        self.channel.send(LoRAMsg(adapter.name, adapter))
        return self.plan.shard_adapter(adapter)

    def remove_lora(self, name: str) -> None:
        self.channel.send(LoRAMsg(name, None))

    def abort(self) -> None:
        """After a failed step: the workers may be blocked in a collective that will never complete, so they are
        killed rather than asked to stop (the process group is left to the process's exit)."""
        self.closed = True
        for p in self.workers:
            p.kill()
        _reap(self.workers, 10)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.channel.send(STOP)
        except Exception as e:  # a worker already gone: the others are stopped below
            log.warning("tensor parallel: sending stop failed: %s", e)
        _reap(self.workers, timeout)
        if dist.is_initialized():
            dist.destroy_process_group()


def _reap(workers: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in workers:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    path: str | Path | None, tp_size: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    threads: int | None = None, timeout: timedelta = timedelta(minutes=10),
) -> LoadedModel:
    """Start ranks 1..tp_size-1 as `python -m model.parallel.worker` processes, join them as rank 0 (gloo on CPU, NCCL on
    CUDA, one GPU per rank), and load rank 0's shard. Every rank reads only its own slices of the checkpoint.
    `threads`: torch threads per worker on CPU (default: the cores split among the ranks). `timeout`: for the
    rendezvous, the load, and each collective inside a step."""
    if tp_size < 2:
        raise ValueError("tensor parallelism needs at least 2 ranks")
    path = resolve_checkpoint(path).resolve() if path is not None else default_model_path()  # a Hub id: its snapshot
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.device_count() < tp_size:
        raise ValueError(f"tensor-parallel size {tp_size} needs {tp_size} GPUs; {torch.cuda.device_count()} visible")
    threads = threads or max(1, (os.cpu_count() or 1) // tp_size)
    init = f"tcp://127.0.0.1:{_free_port()}"
    root = str(Path(__file__).resolve().parents[2])  # so `-m model.parallel.worker` resolves from a source checkout too
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    workers = [
        subprocess.Popen([sys.executable, "-m", "model.parallel.worker", "--init-method", init, "--rank", str(r),
                          "--world-size", str(tp_size), "--model", str(path), "--dtype", dtype_name(dtype),
                          "--device", device.type, "--threads", str(threads),
                          "--timeout-s", str(timeout.total_seconds())],
                         env=env)
        for r in range(1, tp_size)
    ]
    try:
        start = time.perf_counter()
        channel = init_group(init, TPRank(0, tp_size), cuda_device(device, 0), timeout)
        error = None
        try:
            loaded = load_model(path, dtype, cuda_device(device, 0), shard=TPRank(0, tp_size).plan)
            install_row_parallel(loaded.model)
        except Exception as e:
            error = e
        reports = channel.gather(None)  # every worker says whether its shard loaded
        failed = [r for r in reports if r is not None]
        if error is not None or failed:
            if error is None:
                channel.send(STOP)
            raise error or CheckpointError("tensor-parallel worker failed to load: " + "; ".join(failed), path=str(path))
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        for p in workers:
            p.kill()
        _reap(workers, 10)
        raise
    model = TPModel(loaded.model, channel, workers)
    log.info("tensor parallel: %d ranks (%s), %d parameter MB on rank 0, loaded in %.1fs", tp_size,
             dist.get_backend(), parameter_bytes(loaded.model) // 2**20, time.perf_counter() - start)
    return LoadedModel(model, loaded.tokenizer, loaded.path, loaded.name, time.perf_counter() - start)
