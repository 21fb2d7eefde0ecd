"""Tensor parallelism, the process side: what rank 0 broadcasts, and the loop ranks 1..N-1 run.

One scheduler (rank 0's engine) decides every step. Per step rank 0 broadcasts one `StepMsg`: the packed tokens and
positions and the step's `SeqSlice`s (start, num_new, context_len, block ids: the paged-cache metadata), the step's
interventions table when a row has one (model/edits.py: every rank applies the same edits to the residual stream,
which the row-parallel all-reduces keep equal on all of them), plus, when the engine's cache is new, its size. Every rank then builds the same attention metadata from the same slices
(`ForwardContext.from_slices`), runs the same forward on its shard of heads and FFN columns (the all-reduces inside keep
them in lockstep), and only rank 0 computes logits and samples: workers ask for no logits rows, so their head
costs nothing. Aborts, preemptions and prefix reuse are block-table decisions made on rank 0 alone, so they need no
message: the next step's slices carry their effect.

Inspection (`/inspect`) runs block by block: per block rank 0 broadcasts a `BlockMsg` and the block input h
(1, T, D). The message carries the caller's rank request (model/probes' `RankProbe`, opaque here): each rank builds
its attention context from it (a probe over the selected heads it owns), runs the block, and rank 0 gathers what
each context measured for the caller to merge in global head order (ranks own ascending head ranges).

Workers are plain `python -m model.parallel.worker` processes (not multiprocessing spawn, which would re-import the
parent's `__main__`, i.e. the HTTP service, in every worker): they import torch and `model` only.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from model.edits import StepEdits
from model.engine.forward_context import ForwardContext
from model.engine.paged_cache import PagedKVCache, SeqSlice
from model.features.lora import LoRAAdapter, LoRARows, StepLoRA
from model.features.protocol import StepParts
from model.parallel.plan import ShardPlan, TPRank, cuda_device, install_row_parallel
from model.transformer import Transformer
from model.dtypes import DTYPES

log = logging.getLogger("llamascope.tp")

# Workers wait for rank 0's next message for as long as the server idles: that broadcast gets its own group with
# a timeout this long. The all-reduces inside a forward use the default group's short one, so a lost rank fails
# a step instead of hanging it.
IDLE_TIMEOUT = timedelta(days=30)


@dataclass
class CacheSpec:
    generation: int  # a new engine (cache) on rank 0 -> a new cache on every rank
    num_blocks: int
    block_size: int
    dtype: torch.dtype  # the cache's: the model's, or a 16-bit or int8 cache under float32 (EngineConfig.kv_cache_dtype)


@dataclass
class StepMsg:
    tokens: list[list[int]]  # (B, T)
    positions: list[list[int]] | None  # (B, T); None: 0..T-1
    slices: list[SeqSlice] | None  # None: an uncached forward
    cache: CacheSpec | None = None  # set when the cache is (re)built
    edits: StepEdits | None = None  # the step's interventions (reads left to rank 0), applied alike on every rank
    lora: list[tuple[str, list[int]]] | None = None  # the packed rows under each LoRA adapter, by name


@dataclass
class LoRAMsg:
    """A LoRA adapter of the whole model to serve (each rank keeps its share: `ShardPlan.shard_adapter`), or with
    `adapter` None, the adapter `name` to drop."""

    name: str
    adapter: LoRAAdapter | None


class RankRequest(Protocol):
    """What the caller of a block run across ranks asks of each rank (model/probes' `RankProbe` is one)."""

    def build(self, plan: ShardPlan, config) -> Any:
        """This rank's attention context for the block."""
        ...

    def result(self, ctx: Any) -> Any:
        """What that context measured, gathered back to rank 0 (None: nothing)."""
        ...


@dataclass
class BlockMsg:
    layer: int
    request: RankRequest  # pickled by reference to its class: the worker imports its module when it unpickles
    shape: tuple[int, int, int]  # of h, broadcast next as a tensor


STOP = "stop"


class Channel:
    """Rank 0 -> all: messages (pickled by `broadcast_object_list`: fine for a step's few hundred ints) through a
    gloo group on the CPU whatever the device; tensors and probe gathers through the default group (NCCL on CUDA,
    where `gather_object` stages through the current GPU)."""

    def __init__(self) -> None:
        self.msg_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)  # the idle wait: CPU, long timeout

    def send(self, msg) -> None:
        dist.broadcast_object_list([msg], src=0, group=self.msg_group)

    def recv(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.msg_group)
        return box[0]

    def broadcast(self, t: Tensor) -> Tensor:
        dist.broadcast(t, src=0)
        return t

    def gather(self, obj) -> list | None:
        out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out


def run_step(model: Transformer, msg: StepMsg, cache: PagedKVCache | None, logits_indices: Tensor | None,
             adapters: dict[str, LoRAAdapter] | None = None) -> Tensor:
    """The step's forward on this rank's shard (every rank runs this; workers pass empty `logits_indices`), its
    adapter rows under this rank's share of each adapter (`adapters`, by name)."""
    dev = model.device
    tokens = torch.tensor(msg.tokens, device=dev)
    positions = torch.tensor(msg.positions, device=dev) if msg.positions is not None else None
    if msg.slices is not None:
        lora = LoRARows([(adapters[name], torch.tensor(rows, dtype=torch.long, device=dev)) for name, rows in msg.lora]) \
            if msg.lora else None
        parts = StepParts([StepLoRA(lora, model.config.n_layers)]) if lora is not None else None
        ctx = ForwardContext.from_slices(cache, msg.slices, msg.edits, parts)  # the same metadata rank 0's runner built
        return model(tokens, positions, ctx, logits_indices=logits_indices)
    return model(tokens, positions, logits_indices=logits_indices)


def run_block(model: Transformer, plan: ShardPlan, msg: BlockMsg, h: Tensor) -> tuple[Tensor, Any]:
    """Block `msg.layer` on h (1, T, D) with the attention context `msg.request` builds for this rank -> (block
    output, all-reduced; what the context measured)."""
    ctx = msg.request.build(plan, model.config)
    positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)  # (1, T)
    cos, sin = model.rope(positions)
    out = model.layers[msg.layer](h, cos, sin, ctx)  # (1, T, D), all-reduced
    return out, msg.request.result(ctx)


def init_group(init_method: str, tp: TPRank, device: torch.device, timeout: timedelta) -> Channel:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=tp.rank, world_size=tp.world_size, timeout=timeout)
    return Channel()


def _exit_with_parent() -> None:
    """A worker whose rank 0 died (killed, crashed) must not linger holding memory."""
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def worker_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model.parallel.worker", description="a tensor-parallel worker (rank >= 1)")
    p.add_argument("--init-method", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=600.0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{a.rank} %(name)s %(message)s",
                        stream=sys.stderr)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    torch.set_num_threads(a.threads)  # N processes on shared cores: more threads each only makes OpenMP spin
    tp = TPRank(a.rank, a.world_size)
    device = cuda_device(a.device, a.rank)
    channel = init_group(a.init_method, tp, device, timedelta(seconds=a.timeout_s))
    error = None
    try:
        model, plan = load_shard(a.model, DTYPES[a.dtype], device, tp)
    except Exception as e:  # reported to rank 0, which fails the launch with it
        error = f"rank {a.rank}: {type(e).__name__}: {e}"
    channel.gather(error)
    if error is not None:
        return 1
    serve(model, plan, channel)
    dist.destroy_process_group()
    return 0


def load_shard(path: str, dtype: torch.dtype, device: torch.device, tp: TPRank) -> tuple[Transformer, ShardPlan]:
    """This rank's shard of the checkpoint (its slices only, no tokenizer), its all-reduces installed."""
    from pathlib import Path

    from model.loaders.checkpoint import _return_freed_memory
    from model.loaders.gguf_file import load_gguf
    from model.loaders.hf import load_hf

    model = load_hf(path, dtype, device, shard=tp.plan) if Path(path).is_dir() else load_gguf(path, dtype, device, shard=tp.plan)
    _return_freed_memory()
    install_row_parallel(model)
    return model, model.tp_plan


@torch.inference_mode()
def serve(model: Transformer, plan: ShardPlan, channel: Channel) -> None:
    """Follow rank 0: run each step and probe block it broadcasts, until STOP."""
    cache: PagedKVCache | None = None
    adapters: dict[str, LoRAAdapter] = {}  # this rank's share of each LoRA adapter served
    no_logits = torch.empty(0, dtype=torch.long, device=model.device)
    while True:
        msg = channel.recv()
        if isinstance(msg, StepMsg):
            if msg.cache is not None:
                cache = None  # free the old pool before allocating the new one
                cache = PagedKVCache.for_model(model, msg.cache.num_blocks, msg.cache.block_size, msg.cache.dtype)
            run_step(model, msg, cache, no_logits, adapters)
        elif isinstance(msg, LoRAMsg):
            if msg.adapter is None:
                adapters.pop(msg.name, None)
            else:
                adapters[msg.name] = plan.shard_adapter(msg.adapter).to(model.dtype, model.device)
        elif isinstance(msg, BlockMsg):
            h = channel.broadcast(torch.empty(msg.shape, dtype=model.dtype, device=model.device))
            _, measured = run_block(model, plan, msg, h)
            channel.gather(measured)
        elif msg == STOP:
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel message {msg!r}")


if __name__ == "__main__":
    # run the module's own import, not this `__main__` copy: rank 0 pickles messages as model.parallel.worker classes
    from model.parallel.worker import worker_main as main

    sys.exit(main())
