"""The LLaMA block stack, written from the equations.

Notation (shapes in comments use these letters):
    B  batch rows             T  query tokens in this call      S  key/value positions attended over
    D  model width (dim)      H  query heads                    K  key/value heads (H % K == 0)
    E  head_dim               F  SwiGLU inner width             V  vocabulary size

References:
    RMSNorm   Zhang & Sennrich 2019, "Root Mean Square Layer Normalization".
    RoPE      Su et al. 2021, "RoFormer", in the rotate-half layout of Meta's LLaMA / HF transformers
              (dims i and i + E/2 form a pair); Llama 3.1 frequency scaling in model/config.py.
    GQA       Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models" (K=1 is MQA,
              Shazeer 2019).
    SwiGLU    Shazeer 2020, "GLU Variants Improve Transformer": w2(silu(w1 x) * w3 x).
    LLaMA     Touvron et al. 2023; pre-norm residual blocks, no biases.

Weight names follow Meta's llama `model.py` (wq wk wv wo w1 w2 w3 attention_norm ffn_norm tok_embeddings output).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import kernels
from model.attention import AttentionContext, CausalAttention, KVCacheContext
from model.config import ModelConfig, RopeScaling
from model.engine.paged_cache import PagedKVCache, kv_config
from model.quantize import QuantLinear, apply_linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:  # (..., D) -> (..., D)
        native = kernels.usable(x, self.weight)
        if native is not None and x.dtype == self.weight.dtype:
            return native.rms_norm(x.contiguous(), self.weight, self.eps)  # the same math in one pass per row
        # Statistics in float32 whatever the activation dtype, cast back before the gain (as Meta and HF do).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> Tensor:
    """Per-pair inverse frequencies theta^(-2i/E), i < E/2, with the configured scaling.  -> (E/2,) float32"""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        # Meta llama-models `apply_scaling` (Llama 3.1): keep high frequencies, divide low ones by `factor`,
        # interpolate linearly in between by wavelength.
        old_ctx = scaling.original_max_position_embeddings
        low_freq_wavelen = old_ctx / scaling.low_freq_factor
        high_freq_wavelen = old_ctx / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed per call from positions: O(T x E) work, no max_seq_len-sized table in memory."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling), persistent=False)

    def reset(self, device: torch.device | str, freq_factors: Tensor | None = None) -> None:
        """Recompute `inv_freq` on `device` (after meta-device construction); GGUF's `rope_freqs` divides it."""
        c = self.config
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.float().cpu()
        self.inv_freq = inv_freq.to(device)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:  # (B, T) -> cos, sin (B, T, E) float32
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # (B, T, E/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # rotate-half layout: pair (i, i + E/2) shares frequency i
        return emb.cos(), emb.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, T, heads, E), cos/sin (B, T, E) -> (B, T, heads, E): x*cos + rotate_half(x)*sin."""
    cos = cos.to(x.dtype).unsqueeze(2)
    sin = sin.to(x.dtype).unsqueeze(2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rotary_tables(cos: Tensor, sin: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin (B, T, E) -> cos (B, T, 1, E) and a signed sin (B, T, 1, E) in `dtype`, once per forward, for
    `apply_rotary_tables`: rotate_half(x) * sin == swap_halves(x) * cat(-sin_lo, sin_hi)."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos.to(dtype).unsqueeze(2), signed.to(dtype).unsqueeze(2)


def apply_rotary_tables(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """`apply_rotary` over `rotary_tables`' output: four ops per call instead of eight (decode runs 30 of these
    per token on the default model, where per-op overhead is a visible share of the step)."""
    B, T, n, E = x.shape
    swapped = x.view(B, T, n, 2, E // 2).flip(3).view(B, T, n, E)  # (x2, x1)
    return x * cos + swapped * signed_sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        # ((H + 2K) * E, D) once fused; wq/wk/wv are then views into it. Under weight-only quantization
        # (model/quantize.py) a callable QuantLinear module instead, and wq/wk/wv are None.
        self.wqkv: Tensor | nn.Module | None = None

    def fuse(self) -> None:
        """One matmul for q, k and v instead of three (fewer, larger GEMMs: less per-call overhead in decode).
        wq/wk/wv become views into the fused weight, so names, state_dict and memory stay as they were."""
        self.wqkv = _fuse_linears(self.wq, self.wk, self.wv)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext) -> Tensor:
        """cos/sin: `RotaryEmbedding`'s (B, T, E) tables, or `rotary_tables`' (B, T, 1, E) prepared ones."""
        B, T, _ = x.shape
        H, K, E = self.n_heads, self.n_kv_heads, self.head_dim
        if cos.dim() == 3:
            cos, sin = rotary_tables(cos, sin, x.dtype)
        if self.wqkv is not None:
            qkv = apply_linear(x, self.wqkv).view(B, T, H + 2 * K, E)  # (B, T, H + 2K, E)
            native = kernels.usable(qkv, cos)
            if native is not None and cos.dtype == qkv.dtype and qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous():
                native.rope_(qkv, cos, sin, H + K)  # q and k heads rotated in place, one pass
                qk = qkv
            else:
                qk = apply_rotary_tables(qkv[:, :, : H + K], cos, sin)  # rotate q and k heads in one pass
            q, k, v = qk[:, :, :H], qk[:, :, H : H + K], qkv[:, :, H + K :]
        else:
            q = self.wq(x).view(B, T, H, E)  # (B, T, H, E)
            k = self.wk(x).view(B, T, K, E)  # (B, T, K, E)
            v = self.wv(x).view(B, T, K, E)  # (B, T, K, E)
            q, k = apply_rotary_tables(q, cos, sin), apply_rotary_tables(k, cos, sin)
        out = ctx.attend(self.layer_idx, q, k, v)  # (B, T, H, E); a cache stores k, v and attends over its keys
        return self.wo(out.reshape(B, T, self.n_heads * self.head_dim))  # (B, T, D)


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)  # down
        self.w13: Tensor | nn.Module | None = None  # (2F, D) once fused (w1/w3 then views into it), or a QuantLinear

    def fuse(self) -> None:
        self.w13 = _fuse_linears(self.w1, self.w3)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D) -> (B, T, D), via (B, T, F)
        if self.w13 is not None:
            gate_up = apply_linear(x, self.w13)  # (B, T, 2F)
            native = kernels.usable(gate_up)
            if native is not None:
                return self.w2(native.silu_mul(gate_up))  # (B, T, F) in one pass
            gate, up = gate_up.chunk(2, dim=-1)  # (B, T, F) each
            return self.w2(F.silu(gate) * up)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _fuse_linears(*linears: nn.Linear) -> Tensor:
    """Concatenate the linears' weights along the output dim and re-point each weight at its slice."""
    fused = torch.cat([lin.weight.detach() for lin in linears])  # (sum out, D)
    row = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[row : row + rows], requires_grad=lin.weight.requires_grad)
        row += rows
    return fused


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, layer_idx)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext) -> Tensor:
        # (B, T, D) -> (B, T, D): the residual stream after both residual adds
        h = h + self.attention(self.attention_norm(h), cos, sin, ctx)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """(tokens, positions, cache) -> logits. No sampling, text or HTTP in here (house rule 2)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.rope = RotaryEmbedding(config)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.quantization = "none"  # model/quantize.py's quantize_model sets "int8" / "int4"
        self.native_decode: NativeDecode | None = None  # see `_native_decode_layers`
        self.tie_weights()

    def fuse_projections(self) -> "Transformer":
        """Fuse q/k/v and gate/up matmuls in every block (call after the weights are loaded and placed)."""
        for layer in self.layers:
            layer.attention.fuse()
            layer.feed_forward.fuse()
        self.native_decode = None
        return self

    def tie_weights(self) -> None:
        if self.config.tie_embeddings and isinstance(self.output, nn.Linear):
            self.output.weight = self.tok_embeddings.weight

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        cache: KVCacheContext | None = None,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """tokens (B, T) int64, positions (B, T) int64 (default 0..T-1) -> logits (B, T, V), or (B, M, V) at
        `logits_indices` (M,) along T (the head over 49k-150k vocab entries is costly; compute only what is used).

        Query at position p attends to keys at positions <= p. Without a cache the keys are this call's tokens.
        With one, the cache writes this call's K/V and supplies the keys: `kv_cache.KVCache` (rows of a batch)
        or `paged_kv_cache.PagedKVCache` (a ragged batch of sequences packed as B=1, T=total tokens).
        """
        B, T = tokens.shape
        if cache is not None:
            if positions is None:
                raise ValueError("a cached forward needs explicit positions")
            cache.begin_forward(positions)
            ctx: AttentionContext = cache
        else:
            ctx = CausalAttention(positions)
            if positions is None:
                positions = torch.arange(T, device=tokens.device).expand(B, T)
        h = self.tok_embeddings(tokens)  # (B, T, D)
        cos, sin = rotary_tables(*self.rope(positions), h.dtype)  # (B, T, 1, E) each, shared by every layer
        native = self._native_decode_step(h, cache)
        if native is not None:  # the same ops as the blocks below, composed in C++ (model/kernels/csrc/decode_layers.cpp)
            c, E = self.config, self.config.head_dim
            h = native.decode_layers(
                h[0], self.native_decode.layers, c.norm_eps, cos.view(-1, E), sin.view(-1, E), cache.k, cache.v,
                cache.slot_mapping, cache.decode_rows, cache.decode_tables, cache.decode_lens,
                c.n_heads, kv_config(self).n_kv_heads, E,
            )[None]  # (1, N, D)
        else:
            for layer in self.layers:
                h = layer(h, cos, sin, ctx)
        if logits_indices is not None:
            h = h[:, logits_indices]  # (B, M, D)
        return self.output(self.norm(h))  # (B, T|M, V)

    def _native_decode_step(self, h: Tensor, cache: KVCacheContext | None):
        """The native kernels' module when this forward can run every block in one native call: a paged step in
        which each sequence adds one token, CPU, float32/bfloat16, fused projections, quantized layers within their
        kernels' row limit, and no hooks on any block (tensor-parallel all-reduces and probes are hooks)."""
        if not isinstance(cache, PagedKVCache) or not cache.pure_decode or cache.k.dtype != h.dtype:
            return None
        native = kernels.usable(h)
        if native is None:
            return None
        if self.native_decode is None:
            self.native_decode = _native_decode_layers(self)
        nd = self.native_decode
        if not nd.layers or h.shape[1] > min((m.kernel_row_limit(True) for m in nd.quantized), default=h.shape[1]):
            return None
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks or any(nd.hooks):
            return None
        return native


@dataclass
class NativeDecode:
    layers: list[list[Tensor]]  # per block: [attention_norm, ffn_norm, then (a, b) for wqkv, wo, w13, w2]
    quantized: list[nn.Module]  # the quantized layers, whose `kernel_row_limit` bounds the step's rows
    hooks: list[dict]  # every block module's forward (pre-)hook dicts: hooks are never skipped


def _native_decode_layers(model: Transformer) -> NativeDecode:
    """The blocks' tensors as `decode_layers` takes them; no layers where a block is not in that form."""
    nd = NativeDecode([], [], [])
    for layer in model.layers:
        att, ffn = layer.attention, layer.feed_forward
        if att.wqkv is None or ffn.w13 is None or layer.attention_norm.weight.dtype != model.dtype:
            return NativeDecode([], [], [])
        entry = [layer.attention_norm.weight.detach(), layer.ffn_norm.weight.detach()]
        for w in (att.wqkv, att.wo, ffn.w13, ffn.w2):
            spec = native_linear_spec(w)
            if spec is None:
                return NativeDecode([], [], [])
            entry += spec
        nd.layers.append(entry)
        for m in layer.modules():
            nd.hooks += [m._forward_hooks, m._forward_pre_hooks]  # dicts that register_forward_hook fills in place
            if isinstance(m, QuantLinear):
                nd.quantized.append(m)
    return nd


def native_linear_spec(w: Tensor | nn.Module) -> list[Tensor] | None:
    """A weight as the native `decode_layers` takes it: [float weight, empty] or a quantized layer's two buffers."""
    if isinstance(w, nn.Linear):
        w = w.weight
    if isinstance(w, Tensor):
        return [w.detach(), torch.empty(0)]
    if isinstance(w, QuantLinear):
        return w.native_buffers()
    return None

