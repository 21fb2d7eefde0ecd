"""A tiny model that writes a fixed reply, and a Qwen-like tokenizer whose vocabulary has the reply's pieces: for
service tests that must know the exact text a live server streams (reasoning tags, tool-call markup) without
trusting a random model's near-ties.

The model is a bigram table: every block's output projections are zero, so the residual stream at a position is
that token's embedding alone; the script's tokens get orthonormal embeddings and the unembedding maps each to the
next one, a lead of 32 nats over every other token (no near-tie anywhere on the way)."""

from __future__ import annotations

import torch
from tokenizers import AddedToken, decoders, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from model.config import ModelConfig
from model.text.gguf_vocab import _BYTE_CHARS
from model.text.tokenizer import Tokenizer
from model.transformer import Transformer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[TOOL_CALLS]"]  # Qwen's, and Mistral's control token
PLAIN = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # Qwen3's non-special added tokens


def scripted_tokenizer(pieces: list[str], chat_template: str | None = None) -> Tokenizer:
    """Bytes (GPT-2's alphabet) plus `pieces` as whole tokens of the BPE vocabulary (the script may cut text
    anywhere, a tag across two tokens included), Qwen's specials and its non-special <think> / <tool_call> tags."""
    vocab = {_BYTE_CHARS[b]: b for b in range(256)}
    for p in pieces:
        vocab.setdefault("".join(_BYTE_CHARS[b] for b in p.encode("utf-8")), len(vocab))
    backend = Backend(BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN])
    end, eot = backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")
    return Tokenizer(backend, bos_id=None, eos_id=end, stop_ids={end, eot}, chat_template=chat_template)


def token_id(tok: Tokenizer, piece: str) -> int:
    """The id of a piece that is one token: an added token, or a vocabulary entry (spelled in the byte alphabet)."""
    i = tok.token_to_id(piece)
    i = i if i is not None else tok.token_to_id("".join(_BYTE_CHARS[b] for b in piece.encode("utf-8")))
    assert i is not None, piece
    return i


def scripted_model(tok: Tokenizer, start: str, script: list[str], dim: int = 64) -> Transformer:
    """After the token `start` (the last of every prompt its chat template renders), the model writes the tokens of
    `script` in order, then the tokenizer's EOS. Script tokens must differ from each other and from `start`."""
    chain = [token_id(tok, p) for p in [start, *script]] + [tok.eos_id]
    assert len(set(chain)) == len(chain) and len(chain) <= dim
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, dim=dim, n_layers=1, n_heads=4, n_kv_heads=2,
                                    hidden_dim=2 * dim, max_seq_len=2048))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.zeros_like(p))
        emb = torch.randn(tok.vocab_size, dim)
        basis = torch.linalg.qr(torch.randn(dim, dim))[0].T * dim ** 0.5  # orthogonal rows, RMS 1
        emb[chain] = basis[:len(chain)]
        model.tok_embeddings.weight.copy_(emb)
        for cur, nxt in zip(chain, chain[1:]):
            model.output.weight[nxt] = basis[chain.index(cur)] * (32.0 / dim)
    return model.eval().requires_grad_(False)
