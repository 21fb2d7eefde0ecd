"""An independent reference for the sink + window cache (model/features/kv_window/schedule.py): the paper's own formulation
(mit-han-lab/streaming-llm, `pos_shift/modify_llama.py`): keys are cached *before* RoPE and rotated at their
positions within the cache at attention time, the query at its own cache position; one token at a time, with the
attended set picked by the schedule's rule (sinks, then the tokens after the first `evicted(t)` non-sink ones).

Nothing of the engine's machinery is shared with it: no blocks, no chunking, no eviction copies, no re-rotation."""

from __future__ import annotations

import torch
from torch import Tensor

from model.attention import sdpa
from model.features.kv_window import KVWindow
from model.kernels.ops import apply_rotary_tables
from model.transformer import Transformer, rotary_tables


class StreamingReference:
    """An attention context for `Transformer.forward`, fed one token per call by `logprobs`."""

    def __init__(self, model: Transformer, window: KVWindow, block_size: int) -> None:
        self.model, self.window, self.bs = model, window, block_size
        self.keys: dict[int, list[Tensor]] = {}  # layer -> unrotated keys (K, E), one per token so far
        self.values: dict[int, list[Tensor]] = {}
        self.t = 0

    def cache_position(self, i: int, t: int) -> int:
        """Where token i sits in the cache when token t is computed."""
        S = self.window.sink_tokens
        return i if i < S else i - self.window.evicted(t, self.bs)

    def begin_forward(self, positions: Tensor) -> None:
        pass

    def _rotate(self, x: Tensor, positions: list[int]) -> Tensor:  # x (n, heads, E) rotated by `positions`
        cos, sin = rotary_tables(*self.model.rope(torch.tensor([positions])), torch.float32)
        return apply_rotary_tables(x[None].float(), cos, sin)[0].to(x.dtype)

    def edit(self, layer: int, site: str, x: Tensor) -> Tensor:
        return x  # no interventions here

    def adapt(self, layer: int, site: str, x: Tensor, y: Tensor) -> Tensor:
        return y

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (1, 1, H, E), k/v (1, 1, K, E) of token t, both rotated at its cache position."""
        t, S = self.t, self.window.sink_tokens
        keys, values = self.keys.setdefault(layer, []), self.values.setdefault(layer, [])
        keys.append(self._rotate(k[0], [-self.cache_position(t, t)])[0])  # back to unrotated
        values.append(v[0, 0])
        kept = [i for i in range(t + 1) if i < S or i >= S + self.window.evicted(t, self.bs)]
        c = self.model.config  # the model's own sliding window (Mistral) over cache positions, its attention scale
        if c.sliding_window:
            kept = [i for i in kept if self.cache_position(i, t) > self.cache_position(t, t) - c.sliding_window]
        kk = self._rotate(torch.stack([keys[i] for i in kept]), [self.cache_position(i, t) for i in kept])
        return sdpa(q, kk[None], torch.stack([values[i] for i in kept])[None], None, scale=c.attention_multiplier)

    @torch.inference_mode()
    def logprobs(self, tokens: list[int]) -> Tensor:
        """-> (T, V) log-softmax of each position's next-token logits."""
        out = []
        for t, token in enumerate(tokens):
            self.t = t
            pos = torch.tensor([[self.cache_position(t, t)]])
            out.append(self.model(torch.tensor([[token]]), pos, self)[0, -1].float().log_softmax(-1))
        return torch.stack(out)
