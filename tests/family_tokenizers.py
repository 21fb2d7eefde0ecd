"""Tiny tokenizers in the style of the LLaMA-block families (tests/model/test_tokenizer_families.py compares them
with their references; the chat-template and service tests serve them): Qwen's byte-level BPE, Mistral's and
Phi-3's SentencePiece BPE with byte fallback, each as a tokenizer folder and as the GGUF llama.cpp's converter writes."""

from __future__ import annotations

import io
import json
from pathlib import Path

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from model.text.gguf_vocab import CONTROL, NORMAL, USER_DEFINED, generate_merges
from tokenizer_strings import FIXED

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
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


def qwen_backend() -> Backend:
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


def write_qwen_tokenizer(d: Path, template: str = "qwen3.jinja") -> Path:
    """A Qwen-style tokenizer folder in `d`: tokenizer.json, tokenizer_config.json (Qwen's keys and its real template),
    generation_config.json with both end ids."""
    tk = qwen_backend()
    tk.save(str(d / "tokenizer.json"))
    ids = {t: tk.token_to_id(t) for t in QWEN_SPECIAL + QWEN_PLAIN}
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_prefix_space": False, "errors": "replace", "split_special_tokens": False,
        "model_max_length": 131072, "chat_template": (TEMPLATES / template).read_text(),
        "added_tokens_decoder": {str(ids[t]): {"content": t, "special": t in QWEN_SPECIAL, "normalized": False,
                                               "lstrip": False, "rstrip": False, "single_word": False}
                                 for t in ids}}))
    (d / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}))
    return d


def write_qwen_gguf(hf_dir: Path, path: Path) -> Path:
    """The vocabulary as llama.cpp's convert_hf_to_gguf.py writes it for Qwen2 (TextModel.get_vocab_base: tokens in
    id order, CONTROL for special added tokens and USER_DEFINED for the others; SpecialVocab's merges and ids)."""
    import transformers

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


def train_spm(control: list[str]):
    import sentencepiece as spm

    model = io.BytesIO()
    # Llama-style settings (Mistral's and Phi-3's tokenizer.model): BPE, byte fallback, digits split, dummy prefix
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN_TEXT), model_writer=model, model_type="bpe", vocab_size=800,
        byte_fallback=True, split_digits=True, add_dummy_prefix=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", allow_whitespace_only_pieces=True, character_coverage=0.99,
        control_symbols=control, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def write_spm_family(d: Path, family: str):
    """tokenizer.json as Mistral-7B-Instruct-v0.3's and Phi-3.5-mini-instruct's are laid out (the vocabulary and
    merges transformers' LlamaConverter takes from the sentencepiece model), tokenizer_config.json, and the GGUF
    llama.cpp writes from the same tokenizer.model (_create_vocab_sentencepiece: pieces, scores, types; added
    tokens after them from added_tokens_decoder)."""
    sp = train_spm(MISTRAL_CONTROL if family == "mistral" else [])
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
