"""The tokenizers of the LLaMA-block families beside LLaMA itself, each built tiny in its family's style with the
`tokenizers` library (or sentencepiece, where the family's tokenizer.model comes from it) and compared with references
on hundreds of strings:

- Qwen2 / 2.5 / 3: byte-level BPE, Qwen's split regex, NFC, specials <|endoftext|> <|im_start|> <|im_end|> and the
  non-special <think> </think> <tool_call> </tool_call>; against transformers' Qwen2Tokenizer and the file's own
  pipeline, from tokenizer.json and from the GGUF llama.cpp's converter writes of it (tokenizer.ggml.pre "qwen2").
- Mistral v0.3 and Phi-3 / 3.5: SentencePiece BPE with byte fallback (<0x0A> tokens), tokenizer.json in their
  published layout (Prepend("▁") + Replace(" ", "▁") normalizer, Replace / ByteFallback / Fuse / Strip decoder);
  Mistral's control tokens ([INST], [TOOL_CALLS], ...) inside the sentencepiece model, Phi-3's added after it with
  rstrip; against the file's own pipeline, sentencepiece, and the GGUF llama.cpp's converter writes.
"""

from __future__ import annotations

import random
import unicodedata
from pathlib import Path

import pytest

from family_tokenizers import (MISTRAL_CONTROL, PHI3_ADDED, QWEN_PLAIN, QWEN_SPECIAL, write_qwen_gguf,
                               write_qwen_tokenizer, write_spm_family)
from model.text.detokenizer import IncrementalDetokenizer
from model.text.tokenizer import Tokenizer
from tokenizer_strings import parity_strings, random_mixes

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")


def _strings(specials: list[str]) -> list[str]:
    return parity_strings() + random_mixes(200, seed=53, specials=specials)


# ---- Qwen: byte-level BPE -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return write_qwen_tokenizer(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def qwen_hf(qwen_dir):
    return transformers.AutoTokenizer.from_pretrained(qwen_dir)


def test_qwen_tokenizer_json_matches_transformers(qwen_dir, qwen_hf):
    ours = Tokenizer.from_hf_dir(qwen_dir)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(qwen_dir / "tokenizer.json"))
    assert type(qwen_hf).__name__ == "Qwen2Tokenizer"  # the class the checkpoint names, its own pipeline
    strings = _strings(QWEN_SPECIAL + QWEN_PLAIN)
    assert len(strings) >= 500
    expected = [qwen_hf.encode(s, add_special_tokens=False) for s in strings]
    assert [ours.encode(s) for s in strings] == expected
    assert [fast.encode(s, add_special_tokens=False) for s in strings] == expected
    for skip in (False, True):
        assert [ours.decode(e, skip_special_tokens=skip) for e in expected] == \
               [qwen_hf.decode(e, skip_special_tokens=skip) for e in expected]
    # <think> and <tool_call> stay in a decode that skips special tokens (a reasoning or tool parser reads them)
    ids = ours.encode("<think>hm</think><tool_call>{}</tool_call><|im_end|>")
    assert ours.decode(ids, skip_special_tokens=True) == "<think>hm</think><tool_call>{}</tool_call>"


def test_qwen_flags_and_stop_ids(qwen_dir):
    ours = Tokenizer.from_hf_dir(qwen_dir)
    im_end, eot = ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>")
    assert ours.eos_id == im_end and ours.stop_ids == {im_end, eot}
    assert ours.add_bos is False and ours.encode("hi") == ours.encode("hi", add_bos=False)
    assert ours.template.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}  # no bos_token


def test_qwen_gguf_matches_its_tokenizer_json(qwen_dir, qwen_hf, tmp_path):
    path = write_qwen_gguf(qwen_dir, tmp_path / "qwen.gguf")
    ours = Tokenizer.from_gguf(path)
    strings = _strings(QWEN_SPECIAL + QWEN_PLAIN)
    # llama.cpp's qwen2 pre-tokenizer does not NFC-normalize (tokenizer.json does): the same ids once the text is NFC
    assert [ours.encode(unicodedata.normalize("NFC", s)) for s in strings] == \
           [qwen_hf.encode(s, add_special_tokens=False) for s in strings]
    differ = [s for s in strings if ours.encode(s) != qwen_hf.encode(s, add_special_tokens=False)]
    assert differ and all(unicodedata.normalize("NFC", s) != s for s in differ)
    ids = [qwen_hf.encode(s, add_special_tokens=False) for s in strings]
    for skip in (False, True):
        assert [ours.decode(i, skip_special_tokens=skip) for i in ids] == \
               [qwen_hf.decode(i, skip_special_tokens=skip) for i in ids]
    hf_dir = Tokenizer.from_hf_dir(qwen_dir)
    assert (ours.eos_id, ours.stop_ids, ours.add_bos) == (hf_dir.eos_id, hf_dir.stop_ids, False)
    assert ours.chat_template == hf_dir.chat_template


# ---- Mistral and Phi-3: SentencePiece BPE with byte fallback ------------------------------------------------------


@pytest.fixture(scope="module", params=["mistral", "phi3"])
def spm_family(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    sp, gguf_path = write_spm_family(d, request.param)
    specials = ["<s>", "</s>"] + (MISTRAL_CONTROL if request.param == "mistral" else PHI3_ADDED)
    return request.param, d, sp, gguf_path, specials


def _sp_reference(sp, text: str, specials: dict[str, int], rstrip: set[str]) -> list[int]:
    """llama.cpp's SPM tokenization (llama_vocab::impl::tokenize): specials cut out of the text, each remaining
    fragment encoded alone with sentencepiece's dummy prefix; an rstrip special drops the whitespace after it (all
    Unicode whitespace, as `tokenizers`' AddedToken does: llama.cpp's isspace() stops at ASCII, so a no-break space
    right after Phi-3's <|user|> is the one place it differs from the checkpoint's tokenizer.json)."""
    out, rest = [], text
    while rest:
        hits = [(rest.find(t), -len(t), t) for t in specials if t in rest]
        if not hits:
            return out + sp.encode(rest)
        pos, _, tok = min(hits)
        out += (sp.encode(rest[:pos]) if pos else []) + [specials[tok]]
        rest = rest[pos + len(tok):]
        if tok in rstrip:
            rest = rest.lstrip()
    return out


def test_spm_tokenizer_json_matches_its_own_pipeline_and_sentencepiece(spm_family):
    family, d, sp, _, specials = spm_family
    ours = Tokenizer.from_hf_dir(d)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
    strings = [s for s in _strings(specials) if "▁" not in s]  # U+2581 is the space marker: never round-trips
    assert len(strings) >= 500
    expected = [fast.encode(s, add_special_tokens=False) for s in strings]
    assert [ours.encode(s, add_bos=False) for s in strings] == expected
    for skip in (False, True):
        assert [ours.decode(e, skip_special_tokens=skip) for e in expected] == \
               [fast.decode(e, skip_special_tokens=skip) for e in expected]
    # The published layout prefixes every text fragment, after special tokens too, as sentencepiece and llama.cpp do
    ids = {t: ours.token_to_id(t) for t in specials}
    rstrip = set(PHI3_ADDED) - {"<|endoftext|>"} | {"</s>"} if family == "phi3" else set()
    assert [_sp_reference(sp, s, ids, rstrip) for s in strings] == expected
    # transformers 5's LlamaTokenizer class rebuilds the pipeline as Metaspace(prepend_scheme="first") instead of
    # the file's: no prefix after a special token, none added to text that starts with a space
    auto = transformers.AutoTokenizer.from_pretrained(d)
    differ = [s for s in strings if auto.encode(s, add_special_tokens=False) != ours.encode(s, add_bos=False)]
    assert differ and all(s.startswith(" ") or any(t in s for t in specials) for s in differ)


def test_spm_gguf_matches_its_tokenizer_json(spm_family):
    family, d, _, gguf_path, specials = spm_family
    hf_dir, ours = Tokenizer.from_hf_dir(d), Tokenizer.from_gguf(gguf_path)
    strings = [s for s in _strings(specials) if "▁" not in s]
    mismatches = [(s, ours.encode(s), hf_dir.encode(s)) for s in strings if ours.encode(s) != hf_dir.encode(s)]
    assert mismatches == []
    ids = [hf_dir.encode(s) for s in strings]
    for skip in (False, True):
        assert [ours.decode(i, skip_special_tokens=skip) for i in ids] == \
               [hf_dir.decode(i, skip_special_tokens=skip) for i in ids]
    assert (ours.bos_id, ours.add_bos, hf_dir.add_bos) == (1, True, True)
    if family == "phi3":  # <|end|> ends a turn by name (llama.cpp's EOG list); generation_config lists it too
        end = ours.token_to_id("<|end|>")
        assert end in ours.stop_ids and end in hf_dir.stop_ids
        assert ours.encode("<|user|>\nhi<|end|>\n", add_bos=False) == hf_dir.encode("<|user|>\nhi<|end|>\n", add_bos=False)
    else:
        assert ours.stop_ids == hf_dir.stop_ids == {2}


def test_byte_fallback_streams_whole_characters(spm_family):
    """Characters outside the vocabulary arrive as <0xXX> byte tokens; streamed, each comes out whole, never as
    U+FFFD, whatever splits the stream."""
    _, d, _, _, specials = spm_family
    tok = Tokenizer.from_hf_dir(d)
    text = "Zürich 𝔘𝔫𝔦 🙂 ok\n  ☃ 中文 é\u0301 ✓"
    ids = tok.encode(text, add_bos=False)
    assert sum(tok.id_to_token(i).startswith("<0x") for i in ids) >= 8  # the test exercises byte fallback
    det = IncrementalDetokenizer(tok, skip_special_tokens=True)
    deltas = [det.feed(i) for i in ids]
    assert "".join(deltas) + det.flush() == tok.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in x for x in deltas)
    emoji = tok.encode("🙂", add_bos=False)
    assert [tok.id_to_token(i) for i in emoji][-4:] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    det = IncrementalDetokenizer(tok)
    assert [det.feed(i) for i in emoji][-4:] == ["", "", "", "🙂"]
    rng = random.Random(5)  # random mixes of whole characters, specials between them
    pool = [tok.encode(c, add_bos=False) for c in ["🙂", "中", "é", "☃", "\n", " a", "<0x41>"]] + \
           [[tok.token_to_id(t)] for t in specials]
    for _ in range(200):
        seq = [i for _ in range(rng.randint(1, 10)) for i in rng.choice(pool)]
        for skip in (False, True):
            det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            deltas = [det.feed(i) for i in seq]
            assert "".join(deltas) + det.flush() == tok.decode(seq, skip_special_tokens=skip)
            assert all("\ufffd" not in x for x in deltas)
