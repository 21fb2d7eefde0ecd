"""The fused native path: every block of a step in one native call (model/kernels/csrc/step_layers.cpp).

The module path runs the very same native ops (RMSNorm, the linear layers, RoPE, the KV write, paged attention,
SiLU-mul) one module call at a time, each its own parallel region; at the default model's size that per-call cost
was a third of a quantized decode step, so the runner sends every step whose rows all attend over the paged pool
here: decode steps, and on CPU prefill chunks and mixed steps too (`PagedKVCache.paged_prefill`). The logits are
bitwise the module path's (a test holds it to that). The runner decides when this path runs; the model knows
nothing of it.
"""

from __future__ import annotations

from torch import Tensor, nn

from model import kernels
from model.kernels import ops
from model.engine.input_batch import StepBatch
from model.engine.forward_context import ForwardContext
from model.engine.paged_cache import kv_config
from model.features import registry as features
from model.quantize import QuantLinear, StackedLinear
from model.transformer import Transformer


def _linear_spec(layer: nn.Module) -> list[Tensor] | None:
    """A linear layer as step_layers takes it: [float weight, empty] or a quantized layer's two native buffers
    (a `StackedLinear`'s parts: each part's two, in order); None for anything else (a tensor-parallel row-parallel
    layer, say, whose output must be all-reduced)."""
    if isinstance(layer, nn.Linear):
        return [layer.weight.detach(), layer.weight.new_empty(0)]
    if isinstance(layer, StackedLinear):
        parts = layer.native_parts()
        if parts is None or any(p.out_features % 8 for p in layer.parts):
            return None
        return [b for pair in parts for b in pair]
    if isinstance(layer, QuantLinear) and layer.out_features % 8 == 0:  # (else its buffers hold zero rows past it)
        return layer.native_buffers()
    return None


class NativeStep:
    def __init__(self, model: nn.Module, layers: list[list[Tensor]], extras: list[list[Tensor]]) -> None:
        self.model, self.layers, self.extras = model, layers, extras
        c = model.config
        self.eps, self.H, self.K, self.E = c.norm_eps, c.n_heads, kv_config(model).n_kv_heads, c.head_dim
        # the family switches the fused step honours (step_layers.cpp's `Switches`)
        self.switches = dict(window=c.sliding_window, scale=c.attention_multiplier, residual=c.residual_multiplier,
                             post_norm=c.norm_placement == "post",
                             qk_norm={"none": 0, "head": 1, "projection": 2}[c.qk_norm])

    @classmethod
    def for_model(cls, model: nn.Module) -> "NativeStep | None":
        """The path for `model` when the native kernels are available and every block is in the form the kernel
        takes (CPU, float32 or bfloat16, plain or weight-only quantized linear layers); else None."""
        if not isinstance(model, Transformer) or model.device.type != "cpu" or kernels.usable(model.norm.weight) is None:
            return None  # (a tensor-parallel model runs its blocks across processes: the module path)
        layers: list[list[Tensor]] = []
        extras: list[list[Tensor]] = []  # per block [bqkv, q_norm, k_norm], empty where the model has none
        none = model.norm.weight.new_empty(0)
        for block in model.layers:
            att, ffn = block.attention, block.feed_forward
            if block.attention_norm.weight.dtype != model.dtype:
                return None
            extras.append([att.bqkv.detach() if att.bqkv is not None else none,
                           att.q_norm.weight.detach() if att.q_norm is not None else none,
                           att.k_norm.weight.detach() if att.k_norm is not None else none])
            entry = [block.attention_norm.weight.detach(), block.ffn_norm.weight.detach()]
            for linear in (att.wqkv, att.wo, ffn.w13, ffn.w2):
                spec = _linear_spec(linear)
                if spec is None:
                    return None
                entry += spec
            layers.append(entry)
        return cls(model, layers, extras)

    def accepts(self, ctx: ForwardContext) -> bool:
        """A step whose every row attends over the paged pool (decode rows; prefill rows too where the cache does
        `paged_prefill`), over a cache of the model's dtype (or a 16-bit or int8 one under float32), with the kernels on."""
        meta = ctx.meta
        if ctx.parts and not ctx.parts.allow("native"):
            return False
        if ctx.edits is not None and ctx.edits.module_only:  # head edits, full-encode clamps: the module path's
            return False
        return (meta.all_paged and meta.paged_rows.numel() == meta.num_tokens
                and ops.native_pool(self.model.dtype, ctx.cache.k.dtype) and kernels.native() is not None)

    def run(self, batch: StepBatch, ctx: ForwardContext, greedy: bool = False) -> Tensor:
        """-> logits (M, V) at the batch's logits rows. `greedy` (every logits row is a plain greedy row): the rows'
        greedy picks (M,) int64 instead where the head makes them without the logits (`Transformer.greedy_picks`);
        the result's dim tells which."""
        m, meta, cache, E = self.model, ctx.meta, ctx.cache, self.E
        h, cos, sin = m.embed(batch.tokens[None], batch.positions[None])  # (1, N, D), (1, N, 1, E) x 2
        args = features.native_args(ctx.parts)  # the per-row features' arguments, or their empty values
        h = kernels.native().step_layers(
            h[0], self.layers, self.eps, cos.view(-1, E), sin.view(-1, E), cache.k, cache.v, meta.slot_mapping,
            meta.paged_rows, meta.paged_tables, meta.paged_lens, self.H, self.K, E,
            edits=ctx.edits.tensors() if ctx.edits is not None else [],
            extras=self.extras, **args, **self.switches,
        )  # (N, D); the rows' interventions and features applied inside the block loop, their reads taken
        # logits rows are distinct and in order: as many as the rows means every row (a decode step), no gather
        every = batch.logits_rows.numel() == batch.tokens.numel()
        if greedy:
            picks = m.greedy_picks(h if every else h[batch.logits_rows])  # (M,)
            if picks is not None:
                return picks
        return m.head(h[None], None if every else batch.logits_rows)[0]  # (M, V)
