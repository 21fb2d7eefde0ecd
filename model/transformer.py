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

The LLaMA-family variants are switches of `ModelConfig` on this one block, never other classes (docs/engine.md
"Checkpoints"): q/k/v biases `bqkv` (Qwen2, transformers modeling_qwen2.py), q/k RMSNorm `q_norm`/`k_norm` per head
(Qwen3, modeling_qwen3.py) or over the whole projection (OLMo-2, modeling_olmo2.py), the norms after their sub-block
instead of before it (OLMo-2), Granite's multipliers (modeling_granite.py), a sliding window (the attention
contexts: Mistral, modeling_mistral.py), Phi-3's longrope frequencies (`rope_inv_freq`).
"""

from __future__ import annotations

import math
import torch
from torch import Tensor, nn

from model.attention import AttentionContext, CausalAttention, KVCacheContext
from model.config import ModelConfig, RopeScaling
from model.kernels import ops
from model.kernels.ops import apply_rotary_tables  # noqa: F401  (the reference rotation; tests import it here)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:  # (..., D) -> (..., D)
        return ops.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling, max_seq_len: int = 0) -> Tensor:
    """Per-pair inverse frequencies theta^(-2i/E), i < E/2, with the configured scaling.  -> (E/2,) float32
    `max_seq_len`: the context served, which picks longrope's long or short factors."""
    # computed on the CPU under any default device: E/2 values, and a first arithmetic op on the meta device (a model
    # built there by the loaders) would import a large part of PyTorch (seconds of a start-up)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling.rope_type == "longrope":
        # transformers `_compute_longrope_parameters`: inv_freq = 1 / (ext_factors * theta^(2i/E))
        long = max_seq_len > scaling.original_max_position_embeddings
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32)
        return 1.0 / (factors * theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, config.max_seq_len)
        self.register_buffer("inv_freq", inv_freq.to(torch.empty(0).device), persistent=False)
        # longrope's attention factor scales cos and sin, so q and k both (transformers' `attention_scaling`)
        self.attention_factor = config.rope_scaling.attention_factor if config.rope_scaling.rope_type == "longrope" else 1.0

    def reset(self, device: torch.device | str, freq_factors: Tensor | None = None) -> None:
        """Recompute `inv_freq` on `device` (after meta-device construction); GGUF's `rope_freqs` divides it."""
        c = self.config
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling, c.max_seq_len)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.float().cpu()
        self.inv_freq = inv_freq.to(device)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:  # (B, T) -> cos, sin (B, T, E) float32
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # (B, T, E/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # rotate-half layout: pair (i, i + E/2) shares frequency i
        if self.attention_factor != 1.0:
            return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
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


class Linear(nn.Linear):
    """A bias-free projection whose product goes through `ops.linear`: on CPU the native kernel, one reduction order
    per output for any number of rows, so a row's result does not depend on its step's other rows (PyTorch's GEMM
    sums a single row differently from several)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        return ops.linear(x, self.weight)


# Fused projections (gpt-fast's `wqkv`): one matmul where Meta's model has several with the same input. Each fused
# module's weight is its parts' weights stacked along the output dim, in this order; checkpoints name the parts
# (LLaMA names, docs/development.md rule 4), and the loaders stack them (model/loaders/assemble.py).
# The biases' parts (Qwen2's q/k/v biases) stack the same way into `attention.bqkv` (no ".weight": a bias vector).
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "attention.wqkv": ("attention.wq", "attention.wk", "attention.wv"),
    "feed_forward.w13": ("feed_forward.w1", "feed_forward.w3"),
}
FUSED_BIAS_PARTS: dict[str, tuple[str, ...]] = {"attention.bqkv": ("attention.bq", "attention.bk", "attention.bv")}


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        H, K, E = config.n_heads, config.n_kv_heads, config.head_dim
        self.wqkv = Linear(config.dim, (H + 2 * K) * E)  # wq, wk, wv stacked: ((H + 2K) E, D)
        self.wo = Linear(H * E, config.dim)
        # Qwen2: added after the product, so whatever serves wqkv (float, int8, int4, a stack) the bias stays float
        self.bqkv = nn.Parameter(torch.zeros((H + 2 * K) * E)) if config.qkv_bias else None  # ((H + 2K) E,)
        self.qk_norm = config.qk_norm
        width = {"head": (E, E), "projection": (H * E, K * E)}.get(config.qk_norm)
        self.q_norm = RMSNorm(width[0], config.norm_eps) if width else None  # (E,) or (H E,)
        self.k_norm = RMSNorm(width[1], config.norm_eps) if width else None  # (E,) or (K E,)

    def project(self, x: Tensor, ctx: AttentionContext) -> Tensor:
        """x (B, T, D) -> q, k, v (B, T, H + 2K, E) before RoPE: the projection (with its rows' adapters), its bias
        and the q/k norms."""
        B, T, _ = x.shape
        H, K, E = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = ctx.adapt(self.layer_idx, "qkv", x, self.wqkv(x))  # (B, T, (H + 2K) E)
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        qkv = qkv.view(B, T, H + 2 * K, E)
        if self.q_norm is not None:
            # Qwen3 normalizes each head's E values, OLMo-2 the whole projection (H E values, K E for k)
            shape = (B, T, H, E) if self.qk_norm == "head" else (B, T, H * E)
            qkv[:, :, :H] = self.q_norm(qkv[:, :, :H].reshape(shape)).view(B, T, H, E)
            shape = (B, T, K, E) if self.qk_norm == "head" else (B, T, K * E)
            qkv[:, :, H : H + K] = self.k_norm(qkv[:, :, H : H + K].reshape(shape)).view(B, T, K, E)
        return qkv

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext) -> Tensor:
        """x (B, T, D); cos/sin: `RotaryEmbedding`'s (B, T, E) tables, or `rotary_tables`' (B, T, 1, E) ones."""
        B, T, _ = x.shape
        H, K, E = self.n_heads, self.n_kv_heads, self.head_dim
        if cos.dim() == 3:
            cos, sin = rotary_tables(cos, sin, x.dtype)
        qkv = self.project(x, ctx)  # (B, T, H + 2K, E)
        q, k, v = qkv[:, :, :H], qkv[:, :, H : H + K], qkv[:, :, H + K :]  # views: (B, T, H | K | K, E)
        for site, heads in (("head_q", q), ("head_k", k), ("head_v", v)):  # before RoPE, as TransformerLens'
            ctx.edit(self.layer_idx, site, heads)  # hook_q / hook_k / hook_v: edited in place (interventions.py)
        qkv = ops.rope_(qkv, cos, sin, H + K)  # q, k rotated in place
        q, k, v = qkv[:, :, :H], qkv[:, :, H : H + K], qkv[:, :, H + K :]
        out = ctx.attend(self.layer_idx, q, k, v)  # (B, T, H, E); a cache stores k, v and attends over its keys
        out = ctx.edit(self.layer_idx, "head_output", out)  # each head's output before wo (TransformerLens' hook_z)
        out = out.reshape(B, T, H * E)
        return ctx.adapt(self.layer_idx, "o", out, self.wo(out))  # (B, T, D)


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.w13 = Linear(config.dim, 2 * config.hidden_dim)  # gate (w1) and up (w3) stacked: (2F, D)
        self.w2 = Linear(config.hidden_dim, config.dim)  # down

    def forward(self, x: Tensor, ctx: AttentionContext) -> Tensor:  # (B, T, D) -> (B, T, D), via (B, T, F)
        layer = self.layer_idx
        g = ops.silu_mul(ctx.adapt(layer, "w13", x, self.w13(x)))  # (B, T, 2F) -> (B, T, F)
        return ctx.adapt(layer, "w2", g, self.w2(g))  # (B, T, D)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        # "pre" (LLaMA): each norm before its sub-block; "post" (OLMo-2): after it, on what the residual add takes
        self.post_norm = config.norm_placement == "post"
        self.residual_multiplier = config.residual_multiplier  # Granite
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, layer_idx)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config, layer_idx)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext) -> Tensor:
        # (B, T, D) -> (B, T, D): the residual stream after both residual adds. The context may edit the block's
        # sites (model/interventions.py's SITES, in this order; contexts without edits return x as it is): a
        # sub-block's output is what its residual add takes (post-normed, scaled by Granite's residual multiplier);
        # resid_mid the stream between the two; mlp_input what the feed-forward takes.
        layer = self.attention.layer_idx
        if self.post_norm:
            a = self.attention_norm(self.attention(h, cos, sin, ctx))  # (B, T, D)
        else:
            a = self.attention(self.attention_norm(h), cos, sin, ctx)
        if self.residual_multiplier != 1.0:
            a = a * self.residual_multiplier
        h = ctx.edit(layer, "resid_mid", h + ctx.edit(layer, "attention_output", a))
        if self.post_norm:  # no norm before the MLP: its input is the stream itself, handed as a copy (an edit there
            m = self.ffn_norm(self.feed_forward(ctx.edit(layer, "mlp_input", h.clone()), ctx))  # is the MLP's alone)
        else:
            m = self.feed_forward(ctx.edit(layer, "mlp_input", self.ffn_norm(h)), ctx)
        if self.residual_multiplier != 1.0:
            m = m * self.residual_multiplier
        return ctx.edit(layer, "block_output", h + ctx.edit(layer, "mlp_output", m))


class Transformer(nn.Module):
    """(tokens, positions, cache) -> logits. No sampling, text or HTTP in here (docs/development.md rule 2)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Built on the meta device (loaders, model/loaders/assemble.py), the table needs no initial values, and a
        # first `normal_` on meta imports a large part of PyTorch: the empty tensor is passed as the weight.
        table = torch.empty(config.vocab_size, config.dim)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim, _weight=table if table.is_meta else None)
        self.rope = RotaryEmbedding(config)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = Linear(config.dim, config.vocab_size)
        self.quantization = "none"  # model/quantize/convert.py's quantize_model sets "int8" / "int4"
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_embeddings and isinstance(self.output, nn.Linear):
            self.output.weight = self.tok_embeddings.weight

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:  # the activations' (a quantized model's embedding table has none of its own)
        return self.norm.weight.dtype

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
        With one (an attention context that also stores K/V: `kv_cache.KVCache` for rows of a batch, or the engine's
        paged cache for a ragged batch packed as B=1) the cache writes this call's K/V and supplies the keys.
        """
        B, T = tokens.shape
        if cache is not None:
            if positions is None:
                raise ValueError("a cached forward needs explicit positions")
            cache.begin_forward(positions)
            ctx: AttentionContext = cache
        else:
            ctx = CausalAttention(positions, self.config.sliding_window, self.config.attention_multiplier)
            if positions is None:
                positions = torch.arange(T, device=tokens.device).expand(B, T)
        h, cos, sin = self.embed(tokens, positions)
        for layer in self.layers:
            h = layer(h, cos, sin, ctx)
        return self.head(h, logits_indices)

    def embed(self, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """tokens, positions (B, T) -> the residual stream's start h (B, T, D) and the RoPE tables every block shares,
        cos and signed sin (B, T, 1, E) (`rotary_tables`)."""
        h = self.embed_tokens(tokens)  # (B, T, D)
        cos, sin = rotary_tables(*self.rope(positions), h.dtype)
        return h, cos, sin

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """tokens (...) -> the residual stream's start (..., D): the table's rows, times Granite's embedding
        multiplier. Every path (the probes too) starts here."""
        h = self.tok_embeddings(tokens)
        return h * self.config.embedding_multiplier if self.config.embedding_multiplier != 1.0 else h

    def logits(self, h: Tensor) -> Tensor:
        """The final norm and the LM head on h (..., D) -> (..., V), divided by Granite's logits scaling. Every
        path (the logit lens too) ends here."""
        out = self.output(self.norm(h))
        return out / self.config.logits_scaling if self.config.logits_scaling != 1.0 else out

    def greedy_picks(self, h: Tensor) -> Tensor | None:
        """h (M, D) -> (M,) int64: `ops.greedy_pick(self.logits(h))`, without forming the (M, V) logits, where the
        head allows it (a float32 `Linear` with no logits scaling: `ops.linear_argmax`); else None."""
        if type(self.output) is not Linear or self.config.logits_scaling != 1.0:
            return None
        return ops.linear_argmax(self.norm(h), self.output.weight)

    def head(self, h: Tensor, logits_indices: Tensor | None = None) -> Tensor:
        """The final norm and the LM head: h (B, T, D) -> logits (B, T, V), or (B, M, V) at `logits_indices`."""
        if logits_indices is not None:
            h = h[:, logits_indices]  # (B, M, D)
        return self.logits(h)
