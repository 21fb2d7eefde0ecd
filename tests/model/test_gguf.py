"""GGUF files written in the test with gguf.GGUFWriter load to exactly the weights they encode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from hf_checkpoints import save_tiny_llama
from gguf_writer import write_tiny_gguf
from model.loaders.gguf_file import load_gguf, unpermute_qk
from model.transformer import rope_inv_freq
from test_parity_hf import LLAMA3_ROPE, _prompts


def _ours_by_gguf_name(model) -> dict[str, np.ndarray]:
    from model.loaders.assemble import split_fused
    from model.loaders.gguf_file import gguf_to_ours

    sd = split_fused(model.state_dict(), model.config)
    names = [f"blk.{i}.{n}.weight" for i in range(model.config.n_layers) for n in
             ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")]
    names += ["token_embd.weight", "output_norm.weight", "output.weight"]
    return {n: sd[gguf_to_ours(n)].numpy() for n in names}


def test_f32_gguf_matches_transformers(tmp_path):
    hf = save_tiny_llama(tmp_path / "hf", num_key_value_heads=2)
    write_tiny_gguf(tmp_path / "m.gguf", hf)
    ours = load_gguf(tmp_path / "m.gguf")
    tokens = _prompts(hf.config.vocab_size)
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


def test_f32_and_q8_0_tensors_load_to_the_encoded_weights(tmp_path):
    """Matrices alternate F32 / Q8_0; every loaded weight equals what the file encodes, Q/K un-permuted."""
    hf = save_tiny_llama(tmp_path / "hf")
    matrices: list[str] = []
    q8: set[str] = set()

    def qtype_for(name, w):  # every other matrix, and every attn_k (permuted), as Q8_0
        matrices.append(name)
        if len(matrices) % 2 or name.endswith("attn_k.weight"):
            q8.add(name)
        return Q.Q8_0 if name in q8 else Q.F32

    encoded = write_tiny_gguf(tmp_path / "m.gguf", hf, qtype_for=qtype_for)
    assert 5 < len(q8) < len(matrices)  # both kinds occur, including a permuted (attn_k) Q8_0 tensor
    got = _ours_by_gguf_name(load_gguf(tmp_path / "m.gguf"))
    c = hf.config
    for name, src in encoded.items():
        want = dequantize(quantize(src, Q.Q8_0), Q.Q8_0).reshape(src.shape) if name in q8 else src
        np.testing.assert_array_equal(got[name], _unpermute(name, want, c), err_msg=name)
    ours = load_gguf(tmp_path / "m.gguf")
    tokens = _prompts(c.vocab_size)
    with torch.no_grad():  # and the model still computes what HF computes, within Q8_0's error
        ref = hf(tokens).logits
        assert ((ours(tokens) - ref).abs().max() / ref.abs().max()).item() < 0.05


def _unpermute(name: str, w: np.ndarray, c) -> np.ndarray:
    if name.endswith("attn_q.weight"):
        return unpermute_qk(w, c.num_attention_heads)
    if name.endswith("attn_k.weight"):
        return unpermute_qk(w, c.num_key_value_heads)
    return w


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_quantized_types_load_to_the_encoded_weights(tmp_path, qtype):
    hf = save_tiny_llama(tmp_path / "hf")
    encoded = write_tiny_gguf(tmp_path / "m.gguf", hf, qtype_for=lambda n, w: qtype)
    got = _ours_by_gguf_name(load_gguf(tmp_path / "m.gguf"))
    for name, src in encoded.items():
        want = dequantize(quantize(src, qtype), qtype).reshape(src.shape) if src.ndim == 2 else src
        np.testing.assert_array_equal(got[name], _unpermute(name, want, hf.config), err_msg=name)


def _k_quant_blocks(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random K-quant blocks with sane f16 scales (gguf can dequantize K-quants but not write them)."""
    rng = np.random.default_rng(seed)
    block_bytes = {Q.Q4_K: 144, Q.Q6_K: 210}[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if qtype == Q.Q4_K:
        raw[..., 0:2] = scale  # d
        raw[..., 2:4] = scale  # dmin
    else:
        raw[..., 208:210] = scale  # d
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_k_quants_load(tmp_path, qtype):
    hf = save_tiny_llama(tmp_path / "hf", intermediate_size=256)
    blocks = _k_quant_blocks(qtype, 64, 256)  # layer 0's ffn_down: 64 rows of one 256-wide super-block
    write_tiny_gguf(tmp_path / "k.gguf", hf, raw_tensors={"blk.0.ffn_down.weight": (blocks, qtype)})
    got = _ours_by_gguf_name(load_gguf(tmp_path / "k.gguf"))["blk.0.ffn_down.weight"]
    want = dequantize(blocks, qtype).reshape(64, 256)
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    np.testing.assert_array_equal(got, want)


def test_tied_embeddings_when_no_output_tensor(tmp_path):
    hf = save_tiny_llama(tmp_path / "hf", tie_word_embeddings=True)
    write_tiny_gguf(tmp_path / "m.gguf", hf)
    ours = load_gguf(tmp_path / "m.gguf")
    assert ours.config.tie_embeddings and ours.output.weight is ours.tok_embeddings.weight
    tokens = _prompts(hf.config.vocab_size)
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


def test_rope_freqs_tensor_carries_llama3_scaling(tmp_path):
    """llama.cpp stores Llama 3.1 scaling as `rope_freqs.weight` (divisors of inv_freq), not as metadata."""
    hf = save_tiny_llama(tmp_path / "hf", rope_parameters=LLAMA3_ROPE)
    ours_cfg_head_dim = hf.config.hidden_size // hf.config.num_attention_heads
    from model.config import RopeScaling

    base = rope_inv_freq(ours_cfg_head_dim, 5e5, RopeScaling())
    scaled = rope_inv_freq(ours_cfg_head_dim, 5e5, RopeScaling("llama3", 8.0, 1.0, 4.0, 64))
    assert not torch.allclose(base, scaled)
    write_tiny_gguf(tmp_path / "m.gguf", hf, rope_freqs=(base / scaled).numpy())
    ours = load_gguf(tmp_path / "m.gguf")
    torch.testing.assert_close(ours.rope.inv_freq, scaled, rtol=1e-6, atol=0)
    tokens = _prompts(hf.config.vocab_size)
    pos = (torch.arange(tokens.shape[1]) * 211).expand_as(tokens)
    with torch.no_grad():
        assert (ours(tokens, pos) - hf(tokens, position_ids=pos).logits).abs().max().item() <= 1e-4
