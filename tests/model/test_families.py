"""The LLaMA-family architectures (model/loaders/families.py) against transformers' own classes on the same random
weights: Qwen2, Qwen3, Mistral (a sliding window shorter than the prompts), Phi-3 (fused tensors, longrope), Granite
(multipliers) and OLMo-2 (post-norms, q/k norm over the projection). float32 logits to 1e-4 on the module path, the
contiguous cache, the paged engine (native fused step and module path, bitwise each other), and what is refused."""

from __future__ import annotations

import json

import pytest
import torch

from hf_checkpoints import FAMILIES, WINDOW, family_config, save_tiny_family
from model import kernels
from model.kv_cache import KVCache
from model.loaders.config_keys import config_from_gguf, config_from_hf
from model.loaders.errors import CheckpointError
from model.loaders.hf import load_hf
from model.quantize import quantize_model
from test_parity_hf import _prompts
from tiny import FAMILY_SWITCHES, greedy_tokens, tiny_family

TOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def family_checkpoint(request, tmp_path_factory):
    """(family, the HF model, its directory): saved once per family for the tests below."""
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, save_tiny_family(directory, request.param), directory


def test_each_family_sets_its_switches(family_checkpoint):
    family, hf, directory = family_checkpoint
    c = config_from_hf(json.loads((directory / "config.json").read_text()))
    assert c.architecture == family
    assert c.qkv_bias == (family == "qwen2")
    assert c.qk_norm == {"qwen3": "head", "olmo2": "projection"}.get(family, "none")
    assert c.sliding_window == (WINDOW if family == "mistral" else 0)
    assert c.norm_placement == ("post" if family == "olmo2" else "pre")
    assert c.rope_scaling.rope_type == ("longrope" if family == "phi3" else "default")
    if family == "granite":
        assert (c.embedding_multiplier, c.residual_multiplier, c.attention_multiplier, c.logits_scaling) == (6.0, 0.3, 0.08, 4.0)
    if family == "qwen3":
        assert c.head_dim == 32 != c.dim // c.n_heads


def test_logits_match_transformers(family_checkpoint):
    family, hf, directory = family_checkpoint
    ours = load_hf(directory)
    tokens = _prompts(hf.config.vocab_size, length=40)  # longer than Mistral's window, past Phi-3's original context
    with torch.no_grad():
        ref, got = hf(tokens).logits, ours(tokens)
    assert ref.abs().max() > 1.0
    assert (got - ref).abs().max().item() <= TOL
    if family != "mistral":  # (transformers' window counts tokens, not positions: spread positions mean nothing there)
        pos = (torch.arange(tokens.shape[1]) * 97).expand_as(tokens)
        with torch.no_grad():
            assert (ours(tokens, pos) - hf(tokens, position_ids=pos).logits).abs().max().item() <= TOL


def test_every_switch_matters(family_checkpoint):
    """The comparison above can fail: with the family's switches off, the same weights give other logits."""
    family, hf, directory = family_checkpoint
    ours = load_hf(directory)
    tokens = _prompts(hf.config.vocab_size, length=40)
    c = ours.config
    off = {"qwen2": dict(qkv_bias=False), "qwen3": dict(qk_norm="none"), "mistral": dict(sliding_window=0),
           "phi3": dict(max_seq_len=16), "granite": dict(logits_scaling=1.0, embedding_multiplier=1.0),
           "olmo2": dict(norm_placement="pre")}[family]
    plain = type(ours)(c.replace(**off))
    plain.load_state_dict(ours.state_dict(), strict=False)
    plain.rope.reset("cpu")
    with torch.no_grad():
        assert (plain(tokens) - hf(tokens).logits).abs().max().item() > 1e-2


def test_contiguous_cache_matches_full_forward(family_checkpoint):
    """Prefill in two chunks then one token at a time (the reference decode loop's cache, windowed for Mistral)."""
    family, hf, directory = family_checkpoint
    ours = load_hf(directory)
    tokens = _prompts(hf.config.vocab_size, batch=2, length=24)
    pos = torch.arange(24).expand(2, 24)
    with torch.no_grad():
        full = ours(tokens)
        cache = KVCache.for_model(ours, batch_size=2, max_seq_len=32)
        parts = [ours(tokens[:, :5], pos[:, :5], cache), ours(tokens[:, 5:15], pos[:, 5:15], cache)]
        parts += [ours(tokens[:, t : t + 1], pos[:, t : t + 1], cache) for t in range(15, 24)]
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= TOL


@pytest.mark.parametrize("family", list(FAMILY_SWITCHES))
def test_engine_greedy_equals_the_uncached_forward(family):
    """The paged engine (chunked prefill over blocks of 4, several sequences) computes each prompt's greedy tokens
    as an uncached forward over prompt + tokens scores them: every step's pick is that forward's argmax."""
    model = tiny_family(family)
    prompts = [[5, 9, 2, 7, 1] * k + [3] * k for k in (1, 4, 7)]  # 6, 24 and 42 tokens: past an 8-token window
    got = greedy_tokens(model, prompts, n=12, max_num_batched_tokens=16)
    for p, toks in zip(prompts, got):
        with torch.no_grad():
            full = model(torch.tensor([p + toks]))[0]  # (T, V)
        assert full[len(p) - 1 : -1].argmax(-1).tolist() == toks


@pytest.mark.parametrize("mode,dtype", [("none", torch.float32), ("none", torch.bfloat16), ("int8", torch.float32),
                                        ("int4", torch.float32)])
@pytest.mark.parametrize("family", list(FAMILY_SWITCHES))
def test_native_step_equals_the_module_path(family, mode, dtype):
    """step_layers honours every switch in its layer loop: bitwise the module path's logprobs and tokens, prefill
    and decode, at every precision (a bias added after the quantized product)."""
    from test_native_kernels import _decode_run

    model = quantize_model(tiny_family(family, dtype=dtype), mode)
    fast, fast_paths = _decode_run(model, native_step=True)
    slow, slow_paths = _decode_run(model, native_step=False)
    assert fast_paths["native"] >= 6 and fast_paths["module"] == 0
    assert slow_paths["native"] == 0
    assert fast == slow


@pytest.mark.parametrize("cache", [torch.float16, torch.int8])
@pytest.mark.parametrize("family", ["qwen2", "mistral", "granite", "olmo2"])
def test_native_step_over_a_16_bit_or_int8_cache(family, cache):
    """A float16 or int8 KV cache (--kv-cache-dtype float16 / int8) under each family's switches: the native step
    bitwise the module path over the same cache."""
    from model.engine import Engine, EngineConfig
    from model.engine.sampling_params import SamplingParams
    from tiny import byte_tokenizer

    model = quantize_model(tiny_family(family), "int4")
    runs = []
    for native in (True, False):
        engine = Engine(model, byte_tokenizer(), EngineConfig(num_blocks=64, block_size=4, native_step=native,
                                                              kv_cache_dtype=str(cache).removeprefix("torch.")))
        assert engine.cache.k.dtype == cache
        for i, p in enumerate([[5, 9, 2, 7, 1] * k for k in (1, 3, 7)]):
            engine.add_request(str(i), p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3))
        got = []
        while engine.has_unfinished():
            got += [(o.request_id, t, lp.logprob, lp.top) for o in engine.step() for t, lp in zip(o.token_ids, o.logprobs)]
        runs.append(got)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("family", ["mistral", "olmo2", "qwen3"])
def test_native_step_few_and_many_rows_on_two_threads(family):
    """1 and 5 rows a step: the few-row path (or, for post-norms and a projection-wide q/k norm, the shared one)."""
    from test_native_kernels import _decode_run

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = tiny_family(family)
        for ks in ((2,), (1, 2, 3, 4, 5)):
            assert _decode_run(model, True, ks)[0] == _decode_run(model, False, ks)[0]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "granite"])
def test_pytorch_reference_ops_agree(family):
    """The PyTorch reference ops (kernels off: gathered decode attention with the window's mask, SDPA prefill
    chunks) give the native path's greedy tokens."""
    model = tiny_family(family)
    prompts = [[5, 9, 2, 7, 1] * k for k in (1, 3, 7)]
    fast = greedy_tokens(model, prompts, n=12)
    with kernels.disabled():
        assert greedy_tokens(model, prompts, n=12) == fast


def test_unsupported_architectures_are_refused_in_one_line():
    cfg = family_config("qwen2").to_dict() | {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}
    with pytest.raises(CheckpointError) as e:
        config_from_hf(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "gemma2" in msg
    assert all(f in msg for f in ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "olmo2"))
    with pytest.raises(CheckpointError) as e:
        config_from_gguf({"general.architecture": "gemma2"})
    assert "\n" not in str(e.value) and "'gemma2'" in str(e.value) and "qwen3" in str(e.value)


@pytest.mark.parametrize("change,refusal", [
    (dict(model_type="qwen2", use_sliding_window=True, max_window_layers=1, sliding_window=8), "sliding-window"),
    (dict(model_type="phi3", partial_rotary_factor=0.75), "partial_rotary_factor"),
    (dict(model_type="granite", attention_bias=True), "attention_bias"),
    (dict(model_type="qwen3", hidden_act="gelu"), "hidden_act"),
])
def test_what_the_switches_do_not_cover_is_refused(change, refusal):
    cfg = family_config(change["model_type"]).to_dict() | change
    cfg.pop("layer_types", None)  # (as a transformers 4 config.json has it: the window from use_sliding_window)
    with pytest.raises(CheckpointError, match=refusal):
        config_from_hf(cfg)


def test_phi3_window_as_transformers_applies_it(tmp_path):
    """Phi-3-mini's `sliding_window` (2047 in its config; 8 here), which transformers applies and llama.cpp ignores:
    ours applies it too, from the folder and from the GGUF's `phi3.attention.sliding_window`."""
    from gguf_writer import write_tiny_gguf
    from model.loaders.gguf_file import load_gguf

    hf = save_tiny_family(tmp_path / "hf", "phi3", sliding_window=WINDOW)
    write_tiny_gguf(tmp_path / "m.gguf", hf)
    tokens = _prompts(hf.config.vocab_size, length=40)
    with torch.no_grad():
        ref = hf(tokens).logits
        for ours in (load_hf(tmp_path / "hf"), load_gguf(tmp_path / "m.gguf")):
            assert ours.config.sliding_window == WINDOW
            assert (ours(tokens) - ref).abs().max().item() <= TOL
        hf.config.sliding_window = None
        assert (hf(tokens).logits - ref).abs().max().item() > 1e-2  # the window matters at 40 tokens


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_on_load_from_the_folder(family_checkpoint, mode):
    """`--quantization int8 / int4` of a folder: each matrix rounded as it is read (Phi-3's fused ones as their
    parts), biases and norms kept in float; the logits' RMS error within bounds that catch a broken scheme on random
    weights (about 1), not a quality change: these checkpoints give int8 0.03-0.11 (Qwen2's biased projections the
    most) and int4 about five times that, as the LLaMA test's (tests/model/test_quantize.py)."""
    from test_quantize import _rms_rel

    family, hf, directory = family_checkpoint
    tokens = _prompts(hf.config.vocab_size)
    ours = load_hf(directory, quantization=mode)
    assert ours.quantization == mode
    with torch.no_grad():
        ref, got = hf(tokens).logits, ours(tokens)
    assert _rms_rel(got, ref) < {"int8": 0.2, "int4": 0.8}[mode]
