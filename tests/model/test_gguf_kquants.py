"""GGUF K-quants and the other block types served at their own precision (`--quantization auto`), per tensor:
each layer against `gguf.quants.dequantize` of the file within the error model/loaders/gguf_blocks.py states."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from hf_checkpoints import save_tiny_llama
from gguf_writer import write_tiny_gguf
from model.loaders.gguf_blocks import unpermute_qk
from model.loaders.gguf_file import load_gguf, native_quantization, open_gguf
from model import huge_pages
from model.quantize import Int4Linear, Int6Linear, Int8Linear, QuantEmbedding, QuantLinear, StackedLinear, linear_weights

# Block bytes per 256 weights (or 32 for the legacy types) and where each block's float16 super-scales sit
# (ggml-common.h: block_q2_K {scales[16]; qs[64]; d; dmin}, block_q3_K {hmask[32]; qs[64]; scales[12]; d},
# block_q4_K {d; dmin; scales[12]; qs[128]}, block_q5_K {d; dmin; scales[12]; qh[32]; qs[128]},
# block_q6_K {ql[128]; qh[64]; scales[16]; d}, block_iq4_xs {d; scales_h; scales_l[4]; qs[128]}).
K_BLOCKS = {Q.Q2_K: (84, (80, 82)), Q.Q3_K: (110, (108,)), Q.Q4_K: (144, (0, 2)), Q.Q5_K: (176, (0, 2)),
            Q.Q6_K: (210, (208,)), Q.IQ4_XS: (136, (0,))}
SERVED = {Q.Q4_K: Int4Linear, Q.Q5_K: Int8Linear, Q.Q6_K: Int6Linear, Q.Q5_0: Int8Linear, Q.Q5_1: Int8Linear,
          Q.Q2_K: Int8Linear, Q.Q3_K: Int8Linear, Q.IQ4_XS: Int8Linear, Q.Q4_0: Int4Linear, Q.Q8_0: Int8Linear}


def random_blocks(qtype, rows: int, cols: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """Random blocks of a type gguf cannot write, with sane float16 super-scales: (rows, bytes per row) uint8."""
    size, scale_at = K_BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    for at in scale_at:
        raw[..., at : at + 2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, -1)


def encode(qtype, w: np.ndarray, seed: int) -> np.ndarray:
    return random_blocks(qtype, *w.shape, seed=seed) if qtype in K_BLOCKS else quantize(w, qtype)


def write_typed(path, hf, qtype_of) -> dict[str, tuple[np.ndarray, object]]:
    """A GGUF of `hf`'s shapes whose 2-D tensors are `qtype_of(name)` blocks -> {name: (the file's values, type)},
    values as our loader sees them (q/k rows un-permuted)."""
    raw: dict[str, tuple[np.ndarray, object]] = {}
    cfg = hf.config
    for i, (name, t) in enumerate(hf.state_dict().items()):
        if t.dim() != 2 or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        from gguf_writer import gguf_name

        qtype = qtype_of(gguf_name(name))
        raw[gguf_name(name)] = (encode(qtype, t.float().numpy(), i), qtype)
    write_tiny_gguf(path, hf, raw_tensors=raw)
    values = {}
    for name, (blocks, qtype) in raw.items():
        w = dequantize(blocks, qtype).reshape(blocks.shape[0], -1)
        heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(name.split(".")[-2])
        values[name] = (unpermute_qk(w, heads) if heads else w, qtype)
    return values


def bound(qtype, want: np.ndarray, served=None) -> np.ndarray:
    """The stated error of each weight (gguf_blocks.py) served as `served` (default: the type's own format): Q4_K ->
    int4 (Q4_K's own scales), Q6_K -> int6 and Q8_0 -> int8 are exact; requantized int8 is within half a step of
    max|w| / 127 per block of 32 plus the float16 rounding of that step."""
    served = served or SERVED[qtype]
    g = np.abs(want).reshape(want.shape[0], -1, 32).max(-1, keepdims=True)  # (N, K/32, 1)
    per = g * (1 / 254 + 2.0**-11) if served is Int8Linear and qtype is not Q.Q8_0 else g * 0
    return np.broadcast_to(per, (*per.shape[:2], 32)).reshape(want.shape) + 1e-7


def layer_of(model, name: str):
    """Our module serving GGUF tensor `name` and its rows' slice of it."""
    i, part = name.split(".")[1], name.split(".")[2]
    block = model.layers[int(i)]
    c = model.config
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return {"attn_q": (block.attention.wqkv, slice(0, q)), "attn_k": (block.attention.wqkv, slice(q, q + kv)),
            "attn_v": (block.attention.wqkv, slice(q + kv, q + 2 * kv)), "attn_output": (block.attention.wo, slice(None)),
            "ffn_gate": (block.feed_forward.w13, slice(0, c.hidden_dim)),
            "ffn_up": (block.feed_forward.w13, slice(c.hidden_dim, 2 * c.hidden_dim)),
            "ffn_down": (block.feed_forward.w2, slice(None))}[part]


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.IQ4_XS])
def test_each_type_loads_to_its_format_within_the_stated_error(tmp_path, qtype):
    hf = save_tiny_llama(tmp_path / "hf", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)
    values = write_typed(tmp_path / "m.gguf", hf, lambda name: qtype)
    model = load_gguf(tmp_path / "m.gguf", quantization="int4" if SERVED[qtype] is Int4Linear else "int8",
                      per_tensor=True)
    for name, (want, _) in values.items():
        if not name.startswith("blk."):
            continue
        layer, rows = layer_of(model, name)
        assert type(layer) is SERVED[qtype], name
        got = layer.dequantize()[rows].numpy()
        err = np.abs(got - want)
        assert (err <= bound(qtype, want)).all(), (name, float(err.max()))
    head = model.output
    assert type(head) is (Int6Linear if qtype is Q.Q6_K else Int8Linear)  # (a Q6_K head as the file holds it)
    emb = model.tok_embeddings
    assert isinstance(emb, QuantEmbedding)
    tokens = torch.arange(hf.config.vocab_size)
    table = values["token_embd.weight"][0]
    got = emb(tokens).numpy()
    assert (np.abs(got - table) <= bound(qtype, table)).all()
    key = [k for k in model.weight_mix if k.startswith(qtype.name)]
    assert key and sum(model.weight_mix[k] for k in key) == len(values)


@pytest.mark.parametrize("qtype,mode", [(Q.Q4_0, "int4"), (Q.Q4_1, "int4"), (Q.Q8_0, "int8"), (Q.Q4_0, "int8")])
def test_exact_mappings_serve_the_files_values_bit_for_bit(tmp_path, qtype, mode):
    """Q4_0 / Q4_1 -> int4, Q8_0 -> int8 and Q4_0 -> int8 (q - 8 with the same d) keep every weight as the file has
    it: block matrices (q/k rows un-permuted), the head and a table of 520 rows (int4: padded to whole groups of 16)."""
    hf = save_tiny_llama(tmp_path / "hf", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=520, tie_word_embeddings=False)
    values = write_typed(tmp_path / "m.gguf", hf, lambda name: qtype)
    model = load_gguf(tmp_path / "m.gguf", quantization=mode)
    for name, (want, _) in values.items():
        if name.startswith("blk."):
            layer, rows = layer_of(model, name)
            assert np.array_equal(layer.dequantize()[rows].numpy(), want), name
    assert np.array_equal(model.output.dequantize().numpy(), values["output.weight"][0]) or qtype is Q.Q4_1
    got = model.tok_embeddings(torch.arange(520)).numpy()
    assert np.array_equal(got, values["token_embd.weight"][0])
    assert model.weight_mix == {f"{qtype.name} -> {mode}": 7 * 2 + 1, f"{qtype.name} -> int8" + ("" if qtype is not Q.Q4_1 else " (requantized)"): 1} \
        if mode == "int4" else {f"{qtype.name} -> int8": 7 * 2 + 2}
    # written where they are served: every matrix's buffers in the loader's 2 MB-page arena, each fused module's parts
    # back to back in its own buffers (joined without a copy), so nothing is left for place_weights to copy
    buffers = [b for m in model.modules() if isinstance(m, QuantLinear) for b in m.buffers()]
    assert buffers and all(huge_pages.on_huge_pages(b) for b in buffers) == hasattr(mmap, "MADV_HUGEPAGE")
    assert len({b.untyped_storage().data_ptr() for b in buffers}) == 1
    fused = model.layers[0].attention.wqkv
    weights = fused.nibbles if mode == "int4" else fused.weight
    assert weights.shape[0] * 8 == fused.out_features == 256 + 2 * 128 and weights.is_contiguous()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert huge_pages.place_weights(model) < 4096  # the norms only


def test_q4_k_m_mix_per_tensor_with_fused_parts_in_their_own_formats(tmp_path):
    """Q4_K_M's pattern: Q4_K matrices, Q6_K attn_v and ffn_down in some layers, a Q6_K head. Under auto each keeps
    its own precision (Q6_K as int6, exact), fused parts too: q/k Q4_K beside a Q6_K v are a StackedLinear of int4
    and int6 rows, each the file's values bit for bit; the engine's native step (which takes the parts as one
    projection) gives the module path's tokens bit for bit, and batched rows the tokens they get alone."""
    from tiny import greedy_tokens
    from test_native_kernels import _decode_run

    hf = save_tiny_llama(tmp_path / "hf", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, num_hidden_layers=2, tie_word_embeddings=False)

    def q4_k_m(name: str):
        if name == "output.weight" or name in ("blk.0.attn_v.weight", "blk.0.ffn_down.weight", "blk.1.ffn_up.weight"):
            return Q.Q6_K  # (and a Q6_K up beside a Q4_K gate, which llama-quantize does not write: a stacked w13)
        return Q.Q4_K

    values = write_typed(tmp_path / "m.gguf", hf, q4_k_m)
    assert native_quantization(open_gguf(tmp_path / "m.gguf")) == "int4"  # what `auto` picks: the main type's
    m = load_gguf(tmp_path / "m.gguf", quantization="int4", per_tensor=True)
    stacked = m.layers[0].attention.wqkv
    assert isinstance(stacked, StackedLinear) and [type(p) for p in stacked.parts] == [Int4Linear, Int6Linear]
    assert [p.out_features for p in stacked.parts] == [256 + 128, 128] and stacked.out_features == 512
    assert stacked.decode_bytes == sum(p.decode_bytes for p in stacked.parts)
    assert isinstance(m.layers[1].attention.wqkv, Int4Linear)
    assert isinstance(m.layers[0].feed_forward.w2, Int6Linear) and isinstance(m.layers[1].feed_forward.w2, Int4Linear)
    assert isinstance(m.layers[0].feed_forward.w13, Int4Linear) and isinstance(m.output, Int6Linear)
    assert [type(p) for p in m.layers[1].feed_forward.w13.parts] == [Int4Linear, Int6Linear]
    assert m.weight_mix == {"Q6_K -> int6": 4,  # block 0's attn_v and ffn_down, block 1's ffn_up, the head
                            "Q4_K -> int4": 2 * 7 - 3 + 1}  # the other block matrices and the untied table
    assert m.layers[1].attention.wqkv.k_scales and m.tok_embeddings.table.k_scales  # Q4_K's own scales, exact
    assert stacked.parts[0].nibbles.is_contiguous()  # q and k written back to back: joined without a copy
    for name, (want, qtype) in values.items():
        if name.startswith("blk."):
            layer, rows = layer_of(m, name)
            assert np.array_equal(layer.dequantize()[rows].numpy(), want), name
    assert len(linear_weights(m)) == 2 * 4 + 1  # a stack counted once, not beside its parts
    assert np.array_equal(m.output.dequantize().numpy(), values["output.weight"][0])
    tokens = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.no_grad():
        ref = load_gguf(tmp_path / "m.gguf")(tokens)  # the file's values in float32
        got = m(tokens)
    # activations rounded to int8 by the kernels, per 256 for the Q4_K and Q6_K layers (ggml's q8_K): 0.084 of the
    # largest logit here (0.093 with every layer's per 32, 0.107 with the Q4_K layers' alone per 256)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 0.1
    fast, paths = _decode_run(m, native_step=True)
    slow, _ = _decode_run(m, native_step=False)
    assert paths["native"] >= 6 and paths["module"] == 0  # the stacked wqkv taken by the native step
    assert fast == slow
    prompts = [[5, 9, 2, 7, 1] * k for k in (1, 3, 7)]
    assert greedy_tokens(m, prompts) == [greedy_tokens(m, [p])[0] for p in prompts]


def test_tied_quantized_table_is_the_head(tmp_path):
    hf = save_tiny_llama(tmp_path / "hf", tie_word_embeddings=True)
    write_tiny_gguf(tmp_path / "m.gguf", hf, qtype_for=lambda n, w: Q.Q8_0)
    m = load_gguf(tmp_path / "m.gguf", quantization="int8", per_tensor=True)
    assert isinstance(m.tok_embeddings, QuantEmbedding) and m.tok_embeddings.table is m.output
    tokens = torch.arange(hf.config.vocab_size)
    assert torch.equal(m.tok_embeddings(tokens), m.output.dequantize())  # gathered rows: the head's, bit for bit
    ref = load_gguf(tmp_path / "m.gguf")
    assert torch.equal(m.tok_embeddings(tokens), ref.tok_embeddings(tokens))  # Q8_0: the file's exact values


NATIVE_CASES = [("int4", q) for q in (Q.Q4_0, Q.Q4_1, Q.Q4_K)] + [("int6", Q.Q6_K)] + \
    [("int8", q) for q in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)]


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q4_K])
def test_a_k_quant_file_is_served_as_it_holds_its_weights(tmp_path, qtype):
    """Every matrix Q6_K (int6) or Q4_K (int4 in Q4_K's own scales), a tied table: each weight the file's bit for bit
    (blocks, the table's gathered rows; a Q6_K head as int6, a Q4_K one requantized to int8), fused modules' parts
    written back to back in one buffer; the engine's native step gives the module path's tokens and logprobs bit for
    bit, and batched rows the tokens they get alone."""
    from tiny import greedy_tokens
    from test_native_kernels import _decode_run

    hf = save_tiny_llama(tmp_path / "hf", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)
    values = write_typed(tmp_path / "m.gguf", hf, lambda name: qtype)
    served, kind = (Int6Linear, "int6") if qtype is Q.Q6_K else (Int4Linear, "int4")
    mode = native_quantization(open_gguf(tmp_path / "m.gguf"))
    assert mode == ("int8" if qtype is Q.Q6_K else "int4")
    m = load_gguf(tmp_path / "m.gguf", quantization=mode, per_tensor=True)
    assert m.weight_mix == ({"Q6_K -> int6": 7 * 2 + 1} if qtype is Q.Q6_K
                            else {"Q4_K -> int4": 7 * 2, "Q4_K -> int8 (requantized)": 1})
    for name, (want, _) in values.items():
        if name.startswith("blk."):
            layer, rows = layer_of(m, name)
            assert type(layer) is served and np.array_equal(layer.dequantize()[rows].numpy(), want), name
    assert m.tok_embeddings.table is m.output
    table = values["token_embd.weight"][0]
    if qtype is Q.Q6_K:
        assert isinstance(m.output, Int6Linear) and np.array_equal(m.output.dequantize().numpy(), table)
        assert np.array_equal(m.tok_embeddings(torch.arange(512)).numpy(), table)  # gathered rows: the file's
    fused = m.layers[0].attention.wqkv
    assert fused.native_buffers()[0].shape[0] * 8 == fused.out_features == 256 + 2 * 128
    assert kind == "int6" or fused.k_scales
    buffers = [b for mod in m.modules() if isinstance(mod, QuantLinear) for b in mod.buffers()]
    assert len({b.untyped_storage().data_ptr() for b in buffers}) == 1
    fast, _ = _decode_run(m, native_step=True)
    slow, _ = _decode_run(m, native_step=False)
    assert fast == slow
    prompts = [[5, 9, 2, 7, 1] * k for k in (1, 3, 7)]
    assert greedy_tokens(m, prompts) == [greedy_tokens(m, [p])[0] for p in prompts]


@pytest.mark.parametrize("kind,qtype", NATIVE_CASES)
def test_native_conversion_writes_the_bytes_of_the_pytorch_one(kind, qtype):
    """kernels/csrc/gguf_convert.cpp against `matrix_layer`'s PyTorch path (the kernels off): the same int4 / int8
    buffers byte for byte, rows read in a permuted order (q/k un-permuting), a last group of 8 only partly filled,
    and an embedding table's int4 rows padded to 16."""
    from model import kernels
    from model.loaders.gguf_blocks import matrix_layer

    if kernels.native() is None:
        pytest.skip("no native kernels on this machine")
    N, K = 44, 512
    w = np.random.default_rng(1).standard_normal((N, K)).astype(np.float32) * 0.02
    raw = encode(qtype, w, seed=2)
    for n_head, pad in ((None, False), (2, False), (None, True)):  # (n_head 2: 44 rows as 2 heads of 22)
        native = matrix_layer(raw, qtype, kind, (N, K), n_head, pad_rows=pad)
        with kernels.disabled():
            ref = matrix_layer(raw, qtype, kind, (N, K), n_head, pad_rows=pad)
        for a, b in zip(native.buffers(), ref.buffers()):
            assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (qtype.name, kind, n_head, pad)
