"""Write a tiny LLaMA GGUF from an HF model the way llama.cpp's `convert_hf_to_gguf.py` does (names, Q/K permute)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, i, rest = hf_name.split(".", 3)  # model.layers.{i}.{module}.weight
    return f"blk.{i}.{HF_TO_GGUF[rest.removesuffix('.weight')]}.weight"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp `LlamaModel.permute`: rotate-half rows -> ggml's interleaved RoPE rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    hf_model,
    qtype_for=lambda name, w: GGMLQuantizationType.F32,
    architecture: str = "llama",
    rope_freqs: np.ndarray | None = None,
    extra_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    raw_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
) -> dict[str, np.ndarray]:
    """Returns the float32 weights (before quantization, after permute) by GGUF name. `raw_tensors` replaces a
    model tensor's data with given encoded bytes (for types gguf cannot quantize, such as the K-quants);
    `extra_tensors` adds tensors the model does not have."""
    cfg = hf_model.config
    w = GGUFWriter(str(path), architecture)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    encoded: dict[str, np.ndarray] = {}
    for hf_name, t in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = gguf_name(hf_name)
        arr = t.float().numpy()
        if name.endswith("attn_q.weight"):
            arr = permute(arr, cfg.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            arr = permute(arr, cfg.num_key_value_heads)
        if raw_tensors and name in raw_tensors:
            data, qtype = raw_tensors[name]
        else:
            qtype = qtype_for(name, arr) if arr.ndim == 2 else GGMLQuantizationType.F32
            data = quantize(arr, qtype)
        w.add_tensor(name, data, raw_dtype=qtype)
        encoded[name] = arr
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32), raw_dtype=GGMLQuantizationType.F32)
    for name, (data, qtype) in (extra_tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return encoded
