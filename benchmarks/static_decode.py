"""The benchmark's peer within the same modules: greedy decode over a static KV slab, on CUDA one graph per step.

`StaticDecoder` runs the same `Transformer` modules as the engine with nothing of the engine around them: a KV slab
of fixed shape (no paging, no scheduler, no sampler, no detokenizer) and, on CUDA, the whole step (forward + greedy
argmax + cache write) captured in one CUDA graph per batch size, so decode makes no host round trip. It is what the
engine's decode could cost at best with these modules (benchmarks/gpu.py).
"""

from __future__ import annotations

import time

import torch

from benchmarks.agreement import TOP_K, StepLogprobs
from model.attention import sdpa
from model.transformer import Transformer


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class StaticKV:
    """A KV slab of fixed shape (L, B, S_max, K, E) whose every per-step input is a device tensor: no host sync
    (unlike `KVCache.begin_forward`'s `int(positions.max())`), so a whole decode step can be graph-captured.
    Attention runs over all S_max slots with a mask (slots > position masked out)."""

    def __init__(self, model: Transformer, batch: int, max_len: int) -> None:
        c, dev = model.config, model.device
        shape = (c.n_layers, batch, max_len, c.n_kv_heads, c.head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype, device=dev)
        self.v = torch.zeros(shape, dtype=model.dtype, device=dev)
        self.slots = torch.arange(max_len, device=dev)  # (S,)
        self.rows = torch.arange(batch, device=dev).unsqueeze(1)  # (B, 1)

    def begin_forward(self, positions: torch.Tensor) -> None:  # (B, T)
        self.positions = positions
        self.mask = (self.slots <= positions.unsqueeze(-1)).unsqueeze(1)  # (B, 1, T, S)

    def edit(self, layer: int, site: str, x: torch.Tensor) -> torch.Tensor:
        return x  # no interventions here

    def adapt(self, layer: int, site: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y  # no adapters here

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k[layer][self.rows, self.positions] = k  # (B, T, K, E) at their positions
        self.v[layer][self.rows, self.positions] = v
        return sdpa(q, self.k[layer], self.v[layer], self.mask)


class StaticDecoder:
    """Greedy lock-step decode of `batch` equal-length prompts; on CUDA one graph replays the whole step."""

    def __init__(self, model: Transformer, batch: int, max_len: int, use_graph: bool) -> None:
        self.model, dev = model, model.device
        self.cache = StaticKV(model, batch, max_len)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=dev)  # (B, 1) the step's input token
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=dev)  # (B, 1)
        self.graph = None
        if use_graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.inference_mode():
                for _ in range(2):  # warm-up outside the graph (kernel selection, allocator pools)
                    self._step()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), torch.inference_mode():
                self._step()

    def _step(self) -> None:
        logits = self.model(self.tokens, self.positions, self.cache)  # (B, 1, V)
        self.tokens.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.positions.add_(1)
        self.logits = logits[:, -1]  # (B, V): under capture, the graph's output, rewritten by every replay

    def _prefill(self, prompts: torch.Tensor) -> torch.Tensor:
        """prompts (B, P) -> last-position logits (B, V); the first generated token is then in `self.tokens`."""
        B, P = prompts.shape
        pos = torch.arange(P, device=prompts.device).expand(B, P)
        logits = self.model(prompts, pos, self.cache, logits_indices=torch.tensor([P - 1], device=prompts.device))
        self.tokens.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.positions.fill_(P)
        return logits[:, -1]

    @torch.inference_mode()
    def run(self, prompts: torch.Tensor, new_tokens: int) -> tuple[list[list[int]], float]:
        """prompts (B, P) -> (tokens per row, decode seconds for new_tokens - 1 steps after the first token)."""
        self._prefill(prompts)
        out = [self.tokens.clone()]
        sync(prompts.device)
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.graph.replay() if self.graph is not None else self._step()
            out.append(self.tokens.clone())  # a device copy: no host round trip
        sync(prompts.device)
        seconds = time.perf_counter() - t0
        return torch.cat(out, dim=1).tolist(), seconds

    @torch.inference_mode()
    def logprob_steps(self, prompts: torch.Tensor, new_tokens: int, k: int = TOP_K) -> list[StepLogprobs]:
        """Untimed: prompts (B, P) -> row 0's greedy tokens with their top-k log-probabilities (benchmarks/agreement.py)."""
        steps = [StepLogprobs.from_logits(self._prefill(prompts)[0], k)]
        for _ in range(new_tokens - 1):
            self.graph.replay() if self.graph is not None else self._step()
            steps.append(StepLogprobs.from_logits(self.logits[0], k))
        return steps
