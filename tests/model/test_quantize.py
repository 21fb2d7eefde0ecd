"""Weight-only int8 / int4: each layer against float math on its own dequantized weights, whole models against
float32 within a tolerance, and GGUF Q4_0/Q4_1 blocks mapped straight to int4 against dequantize-then-float."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from hf_checkpoints import save_tiny_llama
from gguf_writer import write_tiny_gguf
from model.loaders.gguf_file import load_gguf
from model.loaders.hf import load_hf
from model import kernels
from model.loaders.gguf_blocks import matrix_layer, q4_groups
from model.quantize import Int4Linear, Int6Linear, Int8Linear, QuantEmbedding, QuantLinear, linear_weights, quantize_model, round_activations
from test_parity_hf import _prompts
from tiny import greedy_tokens, tiny_model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(params=["native", "torch"])
def backend(request):
    """Both kernel back ends: model/kernels' C++ and PyTorch's packed kernels (where the native ones are off)."""
    if request.param == "native":
        if kernels.native() is None:
            pytest.skip(f"native kernels: {kernels.status()}")
        yield "native"
    else:
        with kernels.disabled():
            yield "torch"


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear, Int6Linear])
@pytest.mark.parametrize("rows", [1, 3, 80])  # x (2, rows): 2 and 6 rows, the few-row kernel; 160, dequantize + GEMM
def test_layer_matches_float_math_on_its_own_weights(cls, rows, backend):
    torch.manual_seed(0)
    w = torch.randn(96, 256)
    layer = cls.from_float(w)
    x = torch.randn(2, rows, 256)
    y = layer(x)
    assert y.shape == (2, rows, 96) and y.dtype == torch.float32
    if backend == "native":
        # Either path computes exactly: activations rounded to int8 per block of 32 (int6: of 256, ggml's q8_K),
        # times the dequantized weight.
        block = 256 if cls is Int6Linear else 32
        want = F.linear(round_activations(x.reshape(-1, 256), block), layer.dequantize()).view(2, rows, 96)
        assert _rel(y, want) < 1e-5
    else:  # the packed kernel's bfloat16 activations / accumulation; the prefill path is float math
        assert _rel(y, F.linear(x, layer.dequantize())) < (1e-2 if rows * 2 <= layer.kernel_row_limit(False) else 1e-6)
    # Against the float weight it came from: the quantization error itself.
    assert _rel(y, F.linear(x, w)) < {Int8Linear: 0.02, Int6Linear: 0.05, Int4Linear: 0.12}[cls]


def test_int8_rounding_is_within_half_a_step_per_block():
    w = torch.randn(32, 64)
    layer = Int8Linear.from_float(w)
    step = layer.unpacked()[1].repeat_interleave(32, dim=1)  # (32, 64): each weight's block scale
    assert ((layer.dequantize() - w).abs() <= step / 2 + 1e-3 * w.abs()).all()  # (d is kept in float16)


@pytest.mark.parametrize("n_head", [None, 2])
def test_q8_0_gguf_blocks_map_to_int8_exactly(n_head):
    from model.loaders.gguf_file import unpermute_qk

    rng = np.random.default_rng(1)
    w = rng.standard_normal((32, 96)).astype(np.float32)
    raw = quantize(w, Q.Q8_0)
    want = dequantize(raw, Q.Q8_0).reshape(w.shape)
    if n_head is not None:
        want = unpermute_qk(want, n_head)
    layer = matrix_layer(raw, Q.Q8_0, "int8", w.shape, n_head)
    assert torch.equal(layer.dequantize(), torch.from_numpy(np.ascontiguousarray(want)))


def test_fused_layers_equal_their_parts():
    torch.manual_seed(1)
    for cls in (Int8Linear, Int4Linear):
        for rows in ((64, 32, 32), (20, 12, 32)):  # int8 parts of whole groups of 8 rows or not
            if cls is Int4Linear and any(n % 16 for n in rows):
                continue
            parts = [cls.from_float(torch.randn(n, 64)) for n in rows]
            fused = cls.cat(parts)
            assert fused.out_features == sum(rows)
            torch.testing.assert_close(fused.dequantize(), torch.cat([p.dequantize() for p in parts]), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_gguf_q4_blocks_map_to_int4_groups(qtype):
    """The blocks' own nibbles, scales and offsets: the int4 matmul equals dequantize-then-float-matmul up to the
    kernel's bfloat16 (scales, activations), with no requantization of the weights."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    raw = quantize(w, qtype)
    want = dequantize(raw, qtype).reshape(w.shape)
    qs, d, m = q4_groups(torch.from_numpy(raw.reshape(48, -1)), qtype.name)  # (48, 3, 16): weights i and i + 16
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()  # (48, 3, 32)
    exact = (q * d[..., None] + m[..., None]).reshape(w.shape)
    np.testing.assert_allclose(exact.numpy(), want, rtol=1e-6, atol=1e-6)  # the mapping is exact
    layer = matrix_layer(raw, qtype, "int4", w.shape, None)
    assert layer.symmetric == (qtype == Q.Q4_0)  # Q4_0: d alone, as the file (m = -8 d in the kernels)
    np.testing.assert_allclose(layer.dequantize().numpy(), want, rtol=1e-6, atol=1e-6)  # and so is the layer
    x = torch.randn(1, 96)
    assert _rel(layer(x), F.linear(x, torch.from_numpy(want))) < 1e-2


def test_quantized_model_keeps_its_module_interface():
    model = quantize_model(tiny_model(), "int8")
    att, ffn = model.layers[0].attention, model.layers[0].feed_forward
    x = torch.randn(1, 5, 64)
    for layer, out in ((att.wqkv, 64 + 2 * 32), (att.wo, 64), (ffn.w13, 2 * 128), (ffn.w2, 64), (model.output, 258)):
        assert isinstance(layer, QuantLinear) and layer(x if layer.in_features == 64 else torch.randn(1, 5, 128)).shape[-1] == out
    assert not any(type(m) is torch.nn.Linear for m in model.modules()) and model.quantization == "int8"
    assert isinstance(model.tok_embeddings, QuantEmbedding) and len(linear_weights(model)) == 2 * 4 + 1
    tokens = torch.arange(258)
    assert torch.equal(model.tok_embeddings(tokens), model.tok_embeddings.table.dequantize())  # rows as gathered


def _with_weights_of(ref, quantized):
    """`ref` (float) carrying `quantized`'s dequantized weights: the float math the quantized model must compute."""
    for a, b in zip(ref.layers, quantized.layers):
        for name in ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2"):
            a.get_submodule(name).weight.copy_(b.get_submodule(name).dequantize())
    ref.output.weight.copy_(quantized.output.dequantize())
    ref.tok_embeddings.weight.copy_(quantized.tok_embeddings.table.dequantize())  # the table is kept quantized too
    return ref


def _rms_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# RMS error of the logits vs float32 on the random model. Random N(0, 0.3) weights are the hardest case for
# min/max rounding and every layer compounds it (int4 measured 0.37-0.50 over seeds 0-2, int8 0.03-0.05), so
# these bounds catch a broken scheme, not a quality regression: `python -m benchmarks.perplexity` measures that
# on the real model.
@pytest.mark.parametrize("mode,tol", [("int8", 0.1), ("int4", 0.7)])
def test_quantized_logits_close_to_float32(tmp_path, mode, tol, backend):
    hf = save_tiny_llama(tmp_path)
    model = quantize_model(load_hf(tmp_path), mode)
    tokens = _prompts(hf.config.vocab_size)  # (3, 19): 57 rows
    with torch.no_grad():
        ref = load_hf(tmp_path)(tokens)
        same_math = _with_weights_of(load_hf(tmp_path), model)(tokens)
        got = model(tokens)
        # Float math on the dequantized weights (native: over int8-rounded activations, which move random-weight
        # logits by about 3.5% RMS; the real model's perplexity: benchmarks/perplexity.py).
        assert (_rms_rel(got, same_math) < 0.06) if backend == "native" else (_rel(got, same_math) < 1e-5)
        assert _rms_rel(got, ref) < tol
        if backend == "native":  # one kernel for any number of rows: each sequence alone gives its rows bitwise
            assert all(torch.equal(model(tokens[i : i + 1])[0], got[i]) for i in range(tokens.shape[0]))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_q4_gguf_loads_as_int4_without_requantizing(tmp_path, qtype, backend):
    hf = save_tiny_llama(tmp_path / "hf", num_key_value_heads=2)
    write_tiny_gguf(tmp_path / "m.gguf", hf, qtype_for=lambda n, w: qtype)
    ref, model = load_gguf(tmp_path / "m.gguf"), load_gguf(tmp_path / "m.gguf", quantization="int4")
    att, fref = model.layers[1].attention, ref.layers[1].attention
    # Weights (Q/K un-permuted) equal the file's dequantized values exactly: the blocks' own float16 d and m.
    assert _rel(att.wqkv.dequantize(), fref.wqkv.weight) < 1e-6
    assert _rel(model.layers[0].feed_forward.w2.dequantize(), ref.layers[0].feed_forward.w2.weight) < 1e-6
    tokens = _prompts(hf.config.vocab_size)
    with torch.no_grad():
        # What differs: the head's int8 rounding, and the activations' rounding (bfloat16 in PyTorch's kernels;
        # int8 per block of 32 in the native ones, llama.cpp's scheme, which moves random-weight logits more)
        assert _rel(model(tokens), ref(tokens)) < (0.1 if backend == "native" else 0.03)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_engine_decodes_a_quantized_model_like_one_at_a_time(mode, backend):
    """Paged-cache batched decode over quantized layers gives each prompt the tokens it gets alone."""
    model = quantize_model(tiny_model(), mode)
    prompts = [[5, 9, 2, 7, 1] * k for k in (1, 3, 7)]
    together = greedy_tokens(model, prompts, 12, block_size=16)
    assert together == [greedy_tokens(model, [p], 12, block_size=16)[0] for p in prompts]


def test_quantization_refuses_a_non_cpu_model_and_unknown_modes():
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_model(tiny_model(), "int3")
    model = tiny_model()
    model.norm.to("meta")  # (the model's device is its final norm's)
    with pytest.raises(ValueError, match="CPU kernels"):
        quantize_model(model, "int8")


def test_perplexity_of_a_model():
    from benchmarks.perplexity import perplexity

    ids = list(range(40, 90))
    nll, ppl = perplexity(tiny_model(), ids)
    assert abs(ppl - np.exp(nll)) < 1e-6 * ppl
    # (int8 rounds the embedding table too: on this random model, whose N(0, 0.3) weights make every rounding count,
    # perplexity moves about 10%; the real model's figures: benchmarks/perplexity.py)
    assert perplexity(quantize_model(tiny_model(), "int8"), ids)[1] == pytest.approx(ppl, rel=0.15)


# The fixed prompts of the quantized-vs-float32 comparison: every position of each is one next-token distribution
# (178 in all), the chat prompt included, whose float32 first token is the near-tie "The" 0.152 / "L" 0.140.
REFERENCE_PROMPTS = [
    "The history of the Roman Empire begins with the founding of Rome, and",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived",
    "Summer is warm. Winter is cold. Spring is",
    "Water boils at 100 degrees Celsius and freezes at",
]
REFERENCE_CHATS = ["What is the capital of France?", "What is 2+2?", "Name three primary colors."]
# Top-1 must agree where float32's top-1 leads its runner-up by more than this many nats (a 1.65x / 1.82x
# probability ratio). Measured on the default model: int4's one disagreement of 178 sits at 0.066 nats; int8's
# seven (its Q8_0 blocks round the file's Q4_1 weights a second time) at 0.066-0.082 and one at 0.567 nats, where
# KL(float32 || int8) is only 0.026.
CLEAR_MARGIN = {"int8": 0.6, "int4": 0.5}


def _reference_sequences(tok) -> list[list[int]]:
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}]), add_bos=False) for c in REFERENCE_CHATS]
    return [tok.encode(p) for p in REFERENCE_PROMPTS] + chats


@pytest.mark.parametrize("mode,mean_kl,max_kl", [("int8", 0.03, 0.25), ("int4", 0.03, 0.25)])
def test_default_model_quantized_next_token_distributions_match_float32(mode, mean_kl, max_kl, default_model, default_gguf):
    """Quantized vs float32 on the default model, position by position over fixed prompts: KL(float32 || quantized)
    bounded, and the same top-1 wherever float32's choice is clear. A near-tie (the chat prompt's first token) can
    go either way without failing anything; that int8 and int4 answer it "L'Étoile, ..." as llama.cpp does on the
    same file is the format's answer, not a bug (`python -m benchmarks.llamacpp_parity` measures that).
    Measured (2 threads): KL mean 0.010 / max 0.122 for int8, 0.005 / 0.028 for int4, whose blocks are the file's
    own (int8 rounds the file's dequantized weights again, in Q8_0 blocks)."""
    from model.loaders.checkpoint import load_model

    quantized = load_model(default_gguf, torch.float32, "cpu", quantization=mode)
    kls, margins, agree = [], [], []
    with torch.no_grad():
        for ids in _reference_sequences(default_model.tokenizer):
            ref = default_model.model(torch.tensor([ids]))[0].float().log_softmax(-1)  # (T, V)
            got = quantized.model(torch.tensor([ids]))[0].float().log_softmax(-1)  # (T, V)
            kls.append((ref.exp() * (ref - got)).sum(-1))  # (T,)
            top2 = ref.topk(2, dim=-1).values  # (T, 2)
            margins.append(top2[:, 0] - top2[:, 1])
            agree.append(ref.argmax(-1) == got.argmax(-1))
    kl, margin, same = torch.cat(kls), torch.cat(margins), torch.cat(agree)
    assert kl.numel() == 178 and float(kl.mean()) < mean_kl and float(kl.max()) < max_kl, (kl.mean(), kl.max())
    clear = margin > CLEAR_MARGIN[mode]
    assert int(clear.sum()) > 100 and bool(same[clear].all()), margin[clear & ~same]
