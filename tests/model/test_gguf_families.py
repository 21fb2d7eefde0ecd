"""The families' GGUF files as llama.cpp's converter writes them (tests/gguf_writer.py: qwen2.*, qwen3.*, phi3.*,
granite.*, olmo2.* keys; attn_q.bias, attn_q_norm, attn_qkv, Phi-3's fused ffn_up, post norms; Mistral as llama) load
to transformers' model: F32 within 1e-4, Q8_0 and a Q4_K_M mix within the LLaMA files' bounds (tests/model/
test_gguf.py, test_gguf_kquants.py), the native step bitwise the module path on the quantized layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gguf_writer import PERMUTED, gguf_name, permute, write_tiny_gguf
from hf_checkpoints import FAMILIES, save_tiny_family
from model.loaders.errors import CheckpointError
from model.loaders.gguf_file import load_gguf, open_gguf, read_metadata
from model.quantize import QuantLinear
from kquants import q4_k, q6_k
from test_native_kernels import _decode_run
from test_parity_hf import _prompts

# Shapes whose matrices are whole K-quant super-blocks (256 inputs): D 256, F 512, head_dim 64 (Qwen3: 32), with
# weights of about 1.3 / sqrt(D), so activations stay as large as the small models' (a random model 4x as wide at
# their spread is chaotic: rounding its weights by 1/254 moved its logits by a quarter)
BIG = dict(hidden_size=256, intermediate_size=512, vocab_size=512, weight_std=0.08)


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_matches_transformers(tmp_path, family):
    hf = save_tiny_family(tmp_path / "hf", family)
    write_tiny_gguf(tmp_path / "m.gguf", hf)
    meta = read_metadata(open_gguf(tmp_path / "m.gguf"))
    assert meta["general.architecture"] == {"mistral": "llama"}.get(family, family)
    ours = load_gguf(tmp_path / "m.gguf")
    tokens = _prompts(hf.config.vocab_size, length=40)
    if family == "mistral":  # the converter writes no window for Mistral: llama.cpp runs it with full attention
        assert ours.config.sliding_window == 0
        hf.config.sliding_window = None
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


def test_mistral_window_from_the_sliding_window_key(tmp_path):
    """A Mistral file that carries `llama.attention.sliding_window` gets its window, and transformers' logits."""
    hf = save_tiny_family(tmp_path / "hf", "mistral")
    write_tiny_gguf(tmp_path / "m.gguf", hf, sliding_window_key=True)
    ours = load_gguf(tmp_path / "m.gguf")
    assert ours.config.sliding_window == hf.config.sliding_window
    tokens = _prompts(hf.config.vocab_size, length=40)
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


def test_the_files_use_the_converters_names(tmp_path):
    for family, names in {"qwen2": ["blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"],
                          "qwen3": ["blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"],
                          "phi3": ["blk.0.attn_qkv.weight", "blk.0.ffn_up.weight", "rope_factors_long.weight"],
                          "olmo2": ["blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"]}.items():
        hf = save_tiny_family(tmp_path / family, family)
        write_tiny_gguf(tmp_path / f"{family}.gguf", hf)
        have = {t.name for t in open_gguf(tmp_path / f"{family}.gguf").tensors}
        assert set(names) <= have, (family, sorted(have))
        assert family != "phi3" or not any("ffn_gate" in n or "attn_q." in n for n in have)
        assert family != "olmo2" or not any("attn_norm" in n or "ffn_norm" in n for n in have)


def _quantized_file(tmp_path, family: str, qtype_of, **shapes) -> tuple:
    """A `family` model (`shapes`: save_tiny_family's overrides) written with each 2-D tensor as `qtype_of(name,
    cols, tied)` (K-quant blocks by tests/kquants.py: gguf cannot encode those) -> (the HF model, the file)."""
    hf = save_tiny_family(tmp_path / "hf", family, **shapes)
    raw = {}
    for name, t in hf.state_dict().items():
        if t.dim() != 2 or (name == "lm_head.weight" and hf.config.tie_word_embeddings):
            continue
        qtype = qtype_of(gguf_name(name, family), t.shape[1], hf.config.tie_word_embeddings)
        if qtype in (Q.Q4_K, Q.Q6_K):
            w, c = t.float().numpy(), hf.config
            if family in PERMUTED and ("q_proj" in name or "k_proj" in name):  # rows as the converter permutes them
                w = permute(w, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
            raw[gguf_name(name, family)] = ((q4_k if qtype == Q.Q4_K else q6_k)(w), qtype)
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, hf, qtype_for=lambda name, w: qtype_of(name, w.shape[1], hf.config.tie_word_embeddings),
                    raw_tensors=raw)
    return hf, path


def _native_equals_module(model) -> None:
    fast, paths = _decode_run(model, native_step=True)
    slow, _ = _decode_run(model, native_step=False)
    assert paths["native"] >= 6 and paths["module"] == 0
    assert fast == slow


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_gguf_within_the_llama_bound(tmp_path, family):
    """Every matrix Q8_0: the file's values (dequantized, float32) within 5% of the largest logit of transformers'
    forward (test_gguf.py's bound for LLaMA, whose file rounds half its matrices at twice this spread), served as int8
    (`--quantization auto`: activations rounded too) within 10% of the file's values (test_gguf_kquants.py's), and
    the native step bitwise the module path."""
    hf, path = _quantized_file(tmp_path, family, lambda name, cols, tied: Q.Q8_0, weight_std=0.15)
    m = load_gguf(path, quantization="int8", per_tensor=True)
    assert all(isinstance(layer.attention.wqkv, QuantLinear) for layer in m.layers)
    tokens = _prompts(hf.config.vocab_size, length=24)
    if family == "mistral":
        hf.config.sliding_window = None  # (the converter's file has none)
    with torch.no_grad():
        ref, values = hf(tokens).logits, load_gguf(path)(tokens)
        assert ((values - ref).abs().max() / ref.abs().max()).item() < 0.05
        assert ((m(tokens) - values).abs().max() / values.abs().max()).item() < 0.1
    _native_equals_module(m)


def test_the_test_encoders_write_what_gguf_decodes():
    """tests/kquants.py's Q4_K and Q6_K blocks decode (gguf.quants.dequantize) to within half a step of the weights."""
    from gguf.quants import dequantize

    w = (np.random.default_rng(0).standard_normal((8, 512)) * 0.2).astype(np.float32)
    for encode, qtype, levels in ((q4_k, Q.Q4_K, 15), (q6_k, Q.Q6_K, 63)):
        got = dequantize(encode(w), qtype).reshape(w.shape)
        assert 0 < np.abs(got - w).max() <= 1.3 * (w.max() - w.min()) / levels / 2


@pytest.mark.parametrize("family", FAMILIES)
def test_q4_k_m_gguf_within_the_llama_bound(tmp_path, family):
    """Q4_K_M's pattern (Q4_K matrices, Q6_K attn_v / ffn_down in block 0 and the head; Q8_0 where a matrix's input
    is not whole 256-blocks, as llama-quantize falls back): served per tensor at the file's own precision, within
    10% of the largest logit of the file's values in float32 (test_gguf_kquants.py's bound), native == module."""
    def q4_k_m(name: str, cols: int, tied: bool):
        if cols % 256:
            return Q.Q8_0
        if name == "output.weight" or name in ("blk.0.attn_v.weight", "blk.0.ffn_down.weight"):
            return Q.Q6_K
        if name == "token_embd.weight" and tied:  # llama-quantize: a tied table takes the head's type
            return Q.Q6_K
        return Q.Q4_K

    hf, path = _quantized_file(tmp_path, family, q4_k_m, **BIG)
    m = load_gguf(path, quantization="int4", per_tensor=True)
    assert any(k.startswith("Q4_K") for k in m.weight_mix) and any(k.startswith("Q6_K") for k in m.weight_mix)
    tokens = _prompts(hf.config.vocab_size, length=24)
    with torch.no_grad():
        ref = load_gguf(path)(tokens)  # the file's values in float32
        assert ((m(tokens) - ref).abs().max() / ref.abs().max()).item() < 0.1
    _native_equals_module(m)


def test_a_bias_in_a_llama_file_is_refused(tmp_path):
    hf = save_tiny_family(tmp_path / "hf", "qwen2")
    write_tiny_gguf(tmp_path / "m.gguf", hf, architecture="llama")
    with pytest.raises(CheckpointError, match=r"attn_q\.bias.*which this config does not have"):
        load_gguf(tmp_path / "m.gguf")
