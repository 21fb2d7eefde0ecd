"""Rebuild a GGUF file's tokenizer (llama.cpp metadata keys) as a `tokenizers.Tokenizer`.

llama.cpp (src/llama-vocab.cpp) is the reference for what a GGUF vocabulary means; transformers'
integrations/gguf/gguf_tokenizer_mapping.py does the same job and is used as a cross-check in the tests.
Where the two disagree we follow llama.cpp, which matches the original checkpoints' tokenizers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

# llama.cpp llama_token_type (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Tokens llama.cpp treats as end-of-generation by their text (llama-vocab.cpp, special_eog_ids), on top of
# the eos/eot/eom ids the file names.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
})

# Split regexes. llama.cpp rewrites `(?i:...)` into explicit character classes for its own regex engine and
# quotes the original tokenizer.json pattern in a comment; the originals are used here because the
# `tokenizers` (Oniguruma) engine supports them and they are what the HF tokenizers (and transformers) run.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"

# llama.cpp's "\p{N}" first pass for starcoder/smollm/...; those checkpoints' tokenizer.json files spell it
# Digits(individual_digits=True), which is used instead (Rust's is_numeric, i.e. \p{N}).
_DIGITS = object()

# (regexes applied in sequence, each isolating its matches, as llama.cpp's unicode_regex_split does;
#  ignore_merges; add_bos default), per llm_tokenizer_bpe's constructor and llama_vocab::impl::load.
_PRE = {
    "default": ([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], False, False),
    "gpt2": ([_GPT2], False, False),
    "digits": ([_DIGITS, _GPT2], False, False),
    "llama3": ([_LLAMA3], True, True),
    "dbrx": ([_LLAMA3], False, False),
    "qwen2": ([_QWEN2], False, False),
    "qwen35": ([_QWEN35], False, False),
    "falcon": ([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"], False, False),
    "tekken": ([_TEKKEN], True, True),
    "gpt4o": ([_GPT4O], False, False),
    "poro": ([_PORO], False, False),
    "viking": ([_PORO, r"\p{N}"], False, False),
}
_PRE_ALIASES = {
    "": "default", "default": "default",
    **dict.fromkeys(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "jina-v1-en",
                     "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "exaone4", "trillion", "granite-docling",
                     "a.x-4.0", "mellum", "modern-bert"], "gpt2"),
    **dict.fromkeys(["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"], "digits"),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"], "llama3"),
    **dict.fromkeys(["dbrx", "smaug-bpe", "chatglm-bpe", "glm4"], "dbrx"),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan"], "qwen2"),
    "qwen35": "qwen35", "falcon": "falcon", "tekken": "tekken",
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], "gpt4o"),
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], "poro"),
    "viking": "viking",
}


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte <-> printable-character table (openai/gpt-2 encoder.py), which byte-level vocabularies use.
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_CHARS = _bytes_to_unicode()
_BYTE_ALPHABET = frozenset(_BYTE_CHARS.values())


def _token_texts(meta: Mapping[str, Any]) -> tuple[list[str], list[int]]:
    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    # llama.cpp renames empty tokens so every id has a distinct, non-empty text (llama_vocab::impl::load).
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)]
    return tokens, types


def _split_merges(merges) -> list[tuple[str, str]]:
    # llama.cpp splits at the first space after position 0 (llama_vocab::impl::load).
    out = []
    for m in merges:
        pos = m.find(" ", 1)
        out.append((m[:pos], m[pos + 1:]))
    return out


def generate_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a piece into two pieces, best score first.

    Same construction and tie order as transformers' tokenization_utils_base.generate_merges, which reproduces
    llama.cpp's llm_tokenizer_spm (merge the adjacent pair whose concatenation is the highest-scoring piece).
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in dict(zip(tokens, scores)).items():
        splits = ((piece[:k], piece[k:]) for k in range(1, len(piece)))
        local = [(a, b, score) for a, b in splits if a in vocab and b in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _added_tokens(tokens: list[str], types: list[int], special_types: set[int],
                  rstrip: frozenset[str] = frozenset()) -> list[AddedToken]:
    # llama.cpp matches CONTROL/USER_DEFINED (and UNKNOWN) tokens whole in the raw text before the model runs
    # (tokenizer_st_partition); non-normalized added tokens are the `tokenizers` equivalent. `rstrip`: tokens that
    # swallow the whitespace after them (LLAMA_TOKEN_ATTR_RSTRIP; AddedToken's rstrip does the same).
    return [AddedToken(t, special=ty in special_types, normalized=False, rstrip=t in rstrip)
            for t, ty in zip(tokens, types) if ty in special_types or ty == USER_DEFINED]


def _rstrip_tokens(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> frozenset[str]:
    """Phi-3's special tokens take the whitespace after them (its tokenizer.json says rstrip: true). GGUF has no key
    for it: llama.cpp recognizes Phi-3 by `general.name` and sets the attribute on every CONTROL, USER_DEFINED and
    UNKNOWN token but <unk>, <s> and <|endoftext|>, and on </s> (llama_vocab::impl::load, "phi-3" / "phi3")."""
    name = str(meta.get("general.name", "")).lower()
    if "phi-3" not in name and "phi3" not in name:
        return frozenset()
    marked = {t for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED, UNKNOWN)}
    return frozenset((marked | {"</s>"}) - {"<unk>", "<s>", "<|endoftext|>"})


def _byte_level_backend(meta: Mapping[str, Any]) -> Backend:
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre not in _PRE_ALIASES:
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r} for a gpt2 (BPE) vocabulary; "
                         f"supported: {sorted(k for k in _PRE_ALIASES if k)}")
    regexes, ignore_merges, _ = _PRE[_PRE_ALIASES[pre]]
    tokens, types = _token_texts(meta)
    # Normal tokens are stored in the byte-level alphabet; control/user-defined ones as raw text
    # (convert_hf_to_gguf.py pre-normalizes them), so only respell normal tokens that are not.
    vocab = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == NORMAL and not set(t) <= _BYTE_ALPHABET:
            t = "".join(_BYTE_CHARS[b] for b in t.encode("utf-8"))
        vocab[t] = i
    merges = _split_merges(meta.get("tokenizer.ggml.merges") or [])
    tk = Backend(BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges, fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True) if r is _DIGITS else
         pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tk.decoder = decoders.ByteLevel()
    tk.add_tokens(_added_tokens(tokens, types, {CONTROL}))
    return tk


def _sentencepiece_backend(meta: Mapping[str, Any]) -> Backend:
    tokens, types = _token_texts(meta)
    vocab = {t: i for i, t in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges"):
        merges = _split_merges(meta["tokenizer.ggml.merges"])
    else:
        scores = [float(s) for s in meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
        merges = generate_merges(tokens, scores)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", types.index(UNKNOWN) if UNKNOWN in types else None)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tk = Backend(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # llama.cpp (llm_tokenizer_spm / llama_vocab::impl::tokenize) prefixes ' ' to every raw-text fragment,
    # i.e. at the start and after each special token, then escapes ' ' as U+2581; a per-fragment normalizer
    # does exactly that. transformers' LlamaTokenizer uses Metaspace(prepend_scheme="first"), which skips the
    # prefix after special tokens and when the text already starts with a space, unlike sentencepiece.
    replace = normalizers.Replace(" ", "\u2581")
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if prefix else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tk.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    tk.add_tokens(_added_tokens(tokens, types, {CONTROL, UNKNOWN}, _rstrip_tokens(meta, tokens, types)))
    return tk


_BUILDERS = {"gpt2": _byte_level_backend, "llama": _sentencepiece_backend}


def gguf_backend(meta: Mapping[str, Any]) -> tuple[Backend, bool]:
    """(`tokenizers.Tokenizer`, llama.cpp's default for add_bos when the file has no add_bos_token key)."""
    model = meta.get("tokenizer.ggml.model")
    if model not in _BUILDERS:
        raise ValueError(f"unsupported tokenizer.ggml.model {model!r}; supported: {sorted(_BUILDERS)}")
    if model == "llama":
        return _sentencepiece_backend(meta), True
    pre = _PRE_ALIASES.get(str(meta.get("tokenizer.ggml.pre", "default")))
    return _byte_level_backend(meta), bool(pre and _PRE[pre][2])


def gguf_stop_ids(meta: Mapping[str, Any]) -> set[int]:
    tokens = meta["tokenizer.ggml.tokens"]
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = {int(meta[f"tokenizer.ggml.{k}"]) for k in keys if meta.get(f"tokenizer.ggml.{k}") is not None}
    return ids | {i for i, t in enumerate(tokens) if t in EOG_TEXTS}
