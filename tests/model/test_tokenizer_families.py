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

import io
import json
import random
import unicodedata
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from model.text.detokenizer import IncrementalDetokenizer
from model.text.gguf_vocab import CONTROL, NORMAL, USER_DEFINED, generate_merges
from model.text.tokenizer import Tokenizer
from tokenizer_strings import FIXED, parity_strings, random_mixes

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
QWEN_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")  # Qwen2.5's and Qwen3's tokenizer.json Split pattern
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_PLAIN = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # added tokens with special: false
MISTRAL_CONTROL = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                   "[/TOOL_RESULTS]"]
PHI3_ADDED = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|system|>", "<|end|>", "<|user|>"]

TRAIN_TEXT = FIXED + [
    "The quick brown fox jumps over the lazy dog. Tokenizers split text into pieces, and pieces into bytes.",
    "A language model reads tokens; the tokenizer decides where pieces begin and end. Numbers: 12345, 3.14159.",
    "def main():\n    print('hello world')\n    return 0\n",
    "Le renard brun rapide saute par-dessus le chien paresseux. Über den Wolken. ¿Qué tal? Привет, как дела?",
    "日本語のテキストも少し含めます。中文也有一点。한국어도.",
] * 3


def _strings(specials: list[str]) -> list[str]:
    return parity_strings() + random_mixes(200, seed=53, specials=specials)


# ---- Qwen: byte-level BPE -------------------------------------------------------------------------------------


def _qwen_backend() -> Backend:
    tk = Backend(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(TRAIN_TEXT, trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_PLAIN])
    return tk


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """A Qwen3-style tokenizer folder: tokenizer.json, tokenizer_config.json (Qwen's keys and its real template),
    generation_config.json with both end ids."""
    d = tmp_path_factory.mktemp("qwen")
    tk = _qwen_backend()
    tk.save(str(d / "tokenizer.json"))
    ids = {t: tk.token_to_id(t) for t in QWEN_SPECIAL + QWEN_PLAIN}
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_prefix_space": False, "errors": "replace", "split_special_tokens": False,
        "model_max_length": 131072, "chat_template": (TEMPLATES / "qwen3.jinja").read_text(),
        "added_tokens_decoder": {str(ids[t]): {"content": t, "special": t in QWEN_SPECIAL, "normalized": False,
                                               "lstrip": False, "rstrip": False, "single_word": False}
                                 for t in ids}}))
    (d / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}))
    return d


def _qwen_gguf(hf_dir: Path, path: Path) -> Path:
    """The vocabulary as llama.cpp's convert_hf_to_gguf.py writes it for Qwen2 (TextModel.get_vocab_base: tokens in
    id order, CONTROL for special added tokens and USER_DEFINED for the others; SpecialVocab's merges and ids)."""
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    reverse = {i: t for t, i in hf.get_vocab().items()}
    added = hf.added_tokens_decoder
    tokens, types = [], []
    for i in range(len(reverse)):
        tokens.append(reverse[i])
        types.append(NORMAL if i not in added else CONTROL if added[i].special else USER_DEFINED)
    merges = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(hf.convert_tokens_to_ids("<|endoftext|>"))
    w.add_eos_token_id(hf.convert_tokens_to_ids("<|im_end|>"))
    w.add_pad_token_id(hf.convert_tokens_to_ids("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(cfg["chat_template"])
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


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
    path = _qwen_gguf(qwen_dir, tmp_path / "qwen.gguf")
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


def _train_spm(control: list[str]):
    model = io.BytesIO()
    # Llama-style settings (Mistral's and Phi-3's tokenizer.model): BPE, byte fallback, digits split, dummy prefix
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN_TEXT), model_writer=model, model_type="bpe", vocab_size=800,
        byte_fallback=True, split_digits=True, add_dummy_prefix=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", allow_whitespace_only_pieces=True, character_coverage=0.99,
        control_symbols=control, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _spm_family(d: Path, family: str):
    """tokenizer.json as Mistral-7B-Instruct-v0.3's and Phi-3.5-mini-instruct's are laid out (the vocabulary and
    merges transformers' LlamaConverter takes from the sentencepiece model), tokenizer_config.json, and the GGUF
    llama.cpp writes from the same tokenizer.model (_create_vocab_sentencepiece: pieces, scores, types; added
    tokens after them from added_tokens_decoder)."""
    sp = _train_spm(MISTRAL_CONTROL if family == "mistral" else [])
    n = sp.get_piece_size()
    pieces, scores = [sp.id_to_piece(i) for i in range(n)], [sp.get_score(i) for i in range(n)]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = generate_merges(pieces, scores)  # transformers' SentencePieceExtractor: the same construction
    tk = Backend(BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + (MISTRAL_CONTROL if family == "mistral" else [])
    # Phi-3's </s> takes rstrip too (llama.cpp mirrors it: llama_vocab::impl::load)
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False, rstrip=family == "phi3" and t == "</s>")
                           for t in specials])
    added = {}
    if family == "phi3":  # appended after the sentencepiece vocabulary; all but <|endoftext|> take rstrip
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False, rstrip=t != "<|endoftext|>")
                               for t in PHI3_ADDED])
        added = {tk.token_to_id(t): t for t in PHI3_ADDED}
    tk.save(str(d / "tokenizer.json"))
    template = TEMPLATES / ("mistral-7b-instruct-v0.3.jinja" if family == "mistral" else "phi-3.5-mini-instruct.jinja")
    eos = "<|endoftext|>" if family == "phi3" else "</s>"
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": eos, "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False, "chat_template": template.read_text(),
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "normalized": False, "lstrip": False,
                                          "rstrip": t != "<|endoftext|>", "single_word": False}
                                 for i, t in added.items()}}))
    if family == "phi3":  # Phi-3.5-mini-instruct's generation_config: <|end|>, <|assistant|>, <|endoftext|>
        (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [
            tk.token_to_id("<|end|>"), tk.token_to_id("<|assistant|>"), tk.token_to_id("<|endoftext|>")]}))

    def token_type(i):
        for check, ty in ((sp.is_unknown, 2), (sp.is_control, 3), (sp.is_byte, 6), (sp.is_unused, 5)):
            if check(i):
                return ty
        return 1

    path = d / f"{family}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("Phi-3.5-mini-instruct" if family == "phi3" else "Mistral-7B-Instruct-v0.3")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces + list(added.values()))
    w.add_token_scores(scores + [-1000.0] * len(added))
    w.add_token_types([token_type(i) for i in range(n)] + [CONTROL] * len(added))
    w.add_bos_token_id(1)
    w.add_eos_token_id(tk.token_to_id(eos))
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(template.read_text())
    w.add_tensor("token_embd.weight", np.zeros((n + len(added), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sp, path


@pytest.fixture(scope="module", params=["mistral", "phi3"])
def spm_family(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    sp, gguf_path = _spm_family(d, request.param)
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
