"""The LLaMA-family checkpoints this implementation serves, as one table: each family's name in HF `config.json`
(`model_type`) and in GGUF (`general.architecture`), the switches of `ModelConfig` it sets, and where its tensor
names differ from LLaMA's. The block is one implementation (model/transformer.py); a family is data.

Sources, family by family: transformers' modeling_<family>.py and configuration_<family>.py (the reference the tests
compare with), and llama.cpp's converter (`convert_hf_to_gguf.py` and its conversion/ modules: which GGUF
architecture a checkpoint becomes, its metadata keys, tensor names, and whether q/k rows are permuted) with
`src/models/<arch>.cpp` (how llama.cpp runs it).

| family   | GGUF arch | switches                                                    | names                          |
|----------|-----------|-------------------------------------------------------------|--------------------------------|
| llama    | llama     | (none)                                                      | LLaMA's                        |
| mistral  | llama     | sliding_window (v0.1)                                       | LLaMA's                        |
| qwen2    | qwen2     | qkv_bias                                                    | + q/k/v biases                 |
| qwen3    | qwen3     | qk_norm "head", head_dim                                    | + q_norm, k_norm               |
| phi3     | phi3      | longrope scaling, sliding_window                            | fused qkv_proj, gate_up_proj   |
| granite  | granite   | embedding / residual / attention multipliers, logits scaling | LLaMA's                        |
| olmo2    | olmo2     | norm_placement "post", qk_norm "projection"                 | post norms, q_norm, k_norm     |

GGUF q/k rows: llama.cpp's converter permutes them into ggml's interleaved RoPE layout for the architectures it
runs with LLAMA_ROPE_TYPE_NORM (llama, granite: `LlamaModel.permute`), and leaves them in HF's rotate-half order
for the NEOX ones (qwen2, qwen3, phi3, olmo2: `llama_model_rope_type` in src/llama-model.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    name: str  # transformers' model_type
    gguf_arch: str  # llama.cpp's general.architecture for it
    permuted_qk: bool  # GGUF q/k rows (and biases) in ggml's interleaved RoPE layout (module doc)
    # ours -> the file's name, where it differs from the LLaMA tables (model/loaders/assemble.py LAYER_NAMES)
    hf_names: dict[str, str] = field(default_factory=dict)
    gguf_names: dict[str, str] = field(default_factory=dict)


# The optional tensors every family may carry (biases, q/k norms), ours -> HF / GGUF block suffix.
OPTIONAL_NAMES: list[tuple[str, str, str]] = [
    ("attention.bq", "self_attn.q_proj.bias", "attn_q.bias"),
    ("attention.bk", "self_attn.k_proj.bias", "attn_k.bias"),
    ("attention.bv", "self_attn.v_proj.bias", "attn_v.bias"),
    ("attention.q_norm.weight", "self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("attention.k_norm.weight", "self_attn.k_norm.weight", "attn_k_norm.weight"),
]

FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("llama", "llama", True),
    Family("mistral", "llama", True),
    Family("qwen2", "qwen2", False),
    Family("qwen3", "qwen3", False),
    # Phi-3 stores q/k/v as one matrix and gate/up as one (HF qkv_proj, gate_up_proj; GGUF attn_qkv, and ffn_up of
    # 2F rows holding gate then up: llama.cpp src/models/phi3.cpp's LLM_FFN_SWIGLU over ffn_up)
    Family("phi3", "phi3", False,
           hf_names={"attention.wqkv.weight": "self_attn.qkv_proj.weight", "feed_forward.w13.weight": "mlp.gate_up_proj.weight"},
           gguf_names={"attention.wqkv.weight": "attn_qkv.weight", "feed_forward.w13.weight": "ffn_up.weight"}),
    Family("granite", "granite", True),
    # OLMo-2 has no norm before its sub-blocks: its post_attention_layernorm / post_feedforward_layernorm follow them,
    # and serve as our attention_norm / ffn_norm with norm_placement "post"
    Family("olmo2", "olmo2", False,
           hf_names={"attention_norm.weight": "post_attention_layernorm.weight",
                     "ffn_norm.weight": "post_feedforward_layernorm.weight"},
           gguf_names={"attention_norm.weight": "post_attention_norm.weight", "ffn_norm.weight": "post_ffw_norm.weight"}),
]}

# GGUF architecture -> the family its metadata is read as (mistral files say llama)
BY_GGUF_ARCH: dict[str, Family] = {f.gguf_arch: f for f in reversed(list(FAMILIES.values()))}


def supported_hf() -> str:
    return ", ".join(FAMILIES)


def supported_gguf() -> str:
    return ", ".join(dict.fromkeys(f.gguf_arch for f in FAMILIES.values()))
