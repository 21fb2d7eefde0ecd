"""Tensor parallelism, the process side: what rank 0 broadcasts, and the loop ranks 1..N-1 run.

One scheduler (rank 0's engine) decides every step. Per step rank 0 broadcasts one `StepMsg`: the packed tokens and
positions and the step's `SeqSlice`s (start, num_new, context_len, block ids: the paged-cache metadata), plus, when
the engine's cache is new, its size. Every rank then builds the same attention metadata from the same slices
(`PagedKVCache.set_step`), runs the same forward on its shard of heads and FFN columns (the all-reduces inside keep
them in lockstep), and only rank 0 computes logits and samples: workers ask for no logits rows, so their head
costs nothing. Aborts, preemptions and prefix reuse are block-table decisions made on rank 0 alone, so they need no
message: the next step's slices carry their effect.

Inspection (`/inspect`) runs block by block: per block rank 0 broadcasts a `ProbeLayerMsg` and the block input h
(1, T, D); each rank runs the block with a `ProbeAttention` over the selected heads it owns; rank 0 gathers the
per-head statistics and maps and concatenates them in global head order (ranks own ascending head ranges).

Workers are plain `python -m model.parallel.worker` processes (not multiprocessing spawn, which would re-import the
parent's `__main__`, i.e. the HTTP service, in every worker): they import torch and `model` only.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from model.engine.paged_cache import PagedKVCache, SeqSlice
from model.probes import AttentionMaps, ProbeAttention, ProbeOptions
from model.parallel.plan import ShardPlan, TPRank, cuda_device, install_all_reduce
from model.transformer import Transformer

log = logging.getLogger("llamascope.tp")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Workers wait for rank 0's next message for as long as the server idles: that broadcast gets its own group with
# a timeout this long. The all-reduces inside a forward use the default group's short one, so a lost rank fails
# a step instead of hanging it.
IDLE_TIMEOUT = timedelta(days=30)


@dataclass
class CacheSpec:
    generation: int  # a new engine (cache) on rank 0 -> a new cache on every rank
    num_blocks: int
    block_size: int


@dataclass
class StepMsg:
    tokens: list[list[int]]  # (B, T)
    positions: list[list[int]] | None  # (B, T); None: 0..T-1
    slices: list[SeqSlice] | None  # None: an uncached forward
    cache: CacheSpec | None = None  # set when the cache is (re)built


@dataclass
class ProbeLayerMsg:
    layer: int
    opts: ProbeOptions
    stats: bool  # reduce attention in this block
    maps: bool  # and fill maps
    shape: tuple[int, int, int]  # of h, broadcast next as a tensor


STOP = "stop"
Stats = tuple[Tensor, Tensor, AttentionMaps | None]


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


def run_step(model: Transformer, msg: StepMsg, cache: PagedKVCache | None, logits_indices: Tensor | None) -> Tensor:
    """The step's forward on this rank's shard (every rank runs this; workers pass empty `logits_indices`)."""
    dev = model.device
    tokens = torch.tensor(msg.tokens, device=dev)
    positions = torch.tensor(msg.positions, device=dev) if msg.positions is not None else None
    if msg.slices is not None:
        cache.set_step(msg.slices)
        return model(tokens, positions, cache, logits_indices=logits_indices)
    return model(tokens, positions, logits_indices=logits_indices)


def probe_layer(model: Transformer, plan: ShardPlan, msg: ProbeLayerMsg, h: Tensor) -> tuple[Tensor, Stats | None]:
    """Block `msg.layer` on h (1, T, D) with probes over the selected heads this rank owns -> (block output, their
    stats in local head order or None when it owns none)."""
    heads = plan.local_heads(msg.opts.heads)
    mine = msg.stats and heads != []
    c = model.config
    ctx = ProbeAttention(dataclasses.replace(msg.opts, heads=heads), c.n_heads, c.n_kv_heads,
                         {msg.layer} if mine else set(), {msg.layer} if mine and msg.maps else set())
    positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)  # (1, T)
    cos, sin = model.rope(positions)
    out = model.layers[msg.layer](h, cos, sin, ctx)  # (1, T, D), all-reduced
    return out, ctx.stats.pop(msg.layer, None)


def merge_stats(parts: list[Stats | None]) -> Stats:
    """Per-rank stats (rank order = ascending head ranges) -> the selected heads' stats in global order."""
    parts = [p for p in parts if p is not None]
    received = torch.cat([p[0] for p in parts])  # (Hs, T)
    entropy = torch.cat([p[1] for p in parts])  # (Hs,)
    maps = None
    if parts[0][2] is not None:
        m = parts[0][2]
        maps = AttentionMaps(m.mode, torch.cat([p[2].values for p in parts]),
                             torch.cat([p[2].indices for p in parts]) if m.indices is not None else None, m.rows)
    return received, entropy, maps


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
    install_all_reduce(model)
    return model, model.tp_plan


@torch.inference_mode()
def serve(model: Transformer, plan: ShardPlan, channel: Channel) -> None:
    """Follow rank 0: run each step and probe block it broadcasts, until STOP."""
    cache: PagedKVCache | None = None
    no_logits = torch.empty(0, dtype=torch.long, device=model.device)
    while True:
        msg = channel.recv()
        if isinstance(msg, StepMsg):
            if msg.cache is not None:
                cache = None  # free the old pool before allocating the new one
                cache = PagedKVCache.for_model(model, msg.cache.num_blocks, msg.cache.block_size)
            run_step(model, msg, cache, no_logits)
        elif isinstance(msg, ProbeLayerMsg):
            h = channel.broadcast(torch.empty(msg.shape, dtype=model.dtype, device=model.device))
            _, stats = probe_layer(model, plan, msg, h)
            channel.gather(stats)
        elif msg == STOP:
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel message {msg!r}")


if __name__ == "__main__":
    # run the module's own import, not this `__main__` copy: rank 0 pickles messages as model.parallel.worker classes
    from model.parallel.worker import worker_main as main

    sys.exit(main())
