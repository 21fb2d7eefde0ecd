"""Write a tiny GGUF from an HF model the way llama.cpp's `convert_hf_to_gguf.py` does: names, metadata keys and the
Q/K permute, for LLaMA and the other families llamascope serves (model/loaders/families.py): conversion/llama.py
(llama, and Mistral as llama), qwen.py (qwen2, qwen3), phi.py (phi3: attn_qkv, ffn_up holding gate and up, longrope
factor tensors), granite.py (the multipliers as *_scale keys), olmo.py (olmo2: post norms) and base.py's generic keys."""

from __future__ import annotations

import math
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


# gguf-py/gguf/tensor_mapping.py, the names the other families add
FAMILY_NAMES = {
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",  # phi3
    "mlp.gate_up_proj": "ffn_up",  # phi3: gate and up in one tensor (src/models/phi3.cpp)
    "post_feedforward_layernorm": "post_ffw_norm",  # olmo2
}
ARCH = {"mistral": "llama"}  # HF model_type -> GGUF architecture where they differ (MistralForCausalLM -> LlamaModel)
PERMUTED = ("llama", "mistral", "granite")  # LlamaModel.permute applies (undo_permute): LLAMA_ROPE_TYPE_NORM archs


def gguf_name(hf_name: str, family: str = "llama") -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, i, rest = hf_name.split(".", 3)  # model.layers.{i}.{module}.weight / .bias
    module, _, suffix = rest.rpartition(".")
    if family == "olmo2" and module == "post_attention_layernorm":
        return f"blk.{i}.post_attention_norm.{suffix}"
    return f"blk.{i}.{FAMILY_NAMES.get(module) or HF_TO_GGUF[module]}.{suffix}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp `LlamaModel.permute`: rotate-half rows -> ggml's interleaved RoPE rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    hf_model,
    qtype_for=lambda name, w: GGMLQuantizationType.F32,
    architecture: str | None = None,
    rope_freqs: np.ndarray | None = None,
    extra_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    raw_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    sliding_window_key: bool = False,
    tokenizer: bool = False,
) -> dict[str, np.ndarray]:
    """Returns the float32 weights (before quantization, after permute) by GGUF name. `architecture`: the file's
    general.architecture (default: the model's, as the converter maps it). `raw_tensors` replaces a model tensor's
    data with given encoded bytes (for types gguf cannot quantize, such as the K-quants); `extra_tensors` adds
    tensors the model does not have. `sliding_window_key`: write `<arch>.attention.sliding_window` where the model
    has a window (llama.cpp's converter drops Mistral's). `tokenizer`: the byte-level tokenizer (tests/tiny.py) as
    a GGUF vocabulary, so the file serves alone (its vocabulary must be 258)."""
    cfg = hf_model.config
    family = getattr(cfg, "model_type", "llama")
    w = GGUFWriter(str(path), architecture or ARCH.get(family, family))
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if family in PERMUTED or family == "phi3":  # LlamaModel and Phi3MiniModel write it; base.py does not
        w.add_rope_dimension_count(head_dim)
    if getattr(cfg, "head_dim", None) and family != "granite":  # base.py: key/value length where head_dim is set
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if family == "granite":  # conversion/granite.py: the multipliers as scales
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    if family == "phi3":  # conversion/phi.py: the original context, the window (0 where none), longrope's factors
        w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings") or cfg.original_max_position_embeddings)
        w.add_sliding_window(cfg.sliding_window or 0)
    if sliding_window_key and getattr(cfg, "sliding_window", None):  # (not the converter: it drops Mistral's)
        w.add_sliding_window(cfg.sliding_window)
    if family == "phi3" and rope.get("long_factor"):
        original = rope.get("original_max_position_embeddings") or cfg.original_max_position_embeddings
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        for name in ("long", "short"):
            w.add_tensor(f"rope_factors_{name}.weight", np.array(rope[f"{name}_factor"], dtype=np.float32),
                         raw_dtype=GGMLQuantizationType.F32)
    tied = cfg.tie_word_embeddings
    encoded: dict[str, np.ndarray] = {}
    for hf_name, t in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and tied:
            continue
        name = gguf_name(hf_name, family)
        arr = t.float().numpy()
        if family in PERMUTED and ".attn_q." in name:
            arr = permute(arr, cfg.num_attention_heads)
        elif family in PERMUTED and ".attn_k." in name:
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
    if tokenizer:
        from model.text.gguf_vocab import _BYTE_CHARS

        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list([_BYTE_CHARS[b] for b in range(256)] + ["<eos>", "<bos>"])
        w.add_token_types([1] * 256 + [3, 3])
        w.add_token_merges([])
        w.add_eos_token_id(256)
        w.add_bos_token_id(257)
        w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return encoded


def write_lora_gguf(path: Path, peft_dir: Path, n_heads: int, n_kv_heads: int, architecture: str = "llama") -> None:
    """A PEFT LoRA folder written as llama.cpp's `convert_lora_to_gguf.py` writes it (f32): general.type "adapter",
    adapter.type "lora", adapter.lora.alpha, and `<base tensor>.lora_a` (r, in) / `.lora_b` (out, r) for each adapted
    tensor, lora_b's q/k rows permuted as the base's are (its LoraTorchTensor.permute moves B's rows)."""
    import json

    from safetensors.numpy import load_file

    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    w = GGUFWriter(str(path), architecture)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(cfg["lora_alpha"]))
    for key, arr in sorted(load_file(str(peft_dir / "adapter_model.safetensors")).items()):
        base = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight").replace(".lora_B.weight", ".weight")
        name = gguf_name(base) + (".lora_a" if ".lora_A." in key else ".lora_b")
        arr = arr.astype(np.float32)
        if ".lora_B." in key and architecture in PERMUTED and ("q_proj" in key or "k_proj" in key):
            arr = permute(arr, n_heads if "q_proj" in key else n_kv_heads)
        w.add_tensor(name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
