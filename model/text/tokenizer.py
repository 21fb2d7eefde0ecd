"""Text <-> token ids for a checkpoint (HF tokenizer directory or GGUF file), chat templates, streaming decode."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from model.text.chat_template import ChatTemplate, hf_chat_template
from model.text.gguf_vocab import EOG_TEXTS, gguf_backend, gguf_stop_ids


class Tokenizer:
    def __init__(self, backend: Backend, *, bos_id: int | None, eos_id: int | None, stop_ids=(),
                 add_bos: bool = False, chat_template: str | None = None, vocab_size: int | None = None,
                 unk_id: int | None = None, pad_id: int | None = None, template_tokens: Mapping[str, str] | None = None):
        self._tk = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.stop_ids = frozenset(stop_ids) | ({eos_id} if eos_id is not None else set())
        self.add_bos = add_bos
        self.vocab_size = vocab_size if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True)
        # Token strings a chat template may reference; transformers passes its special_tokens_map (an HF directory
        # names them itself: its bos_token may be null where generation_config.json still gives a BOS id).
        named = {"bos_token": bos_id, "eos_token": eos_id, "unk_token": unk_id, "pad_token": pad_id}
        self._named_tokens = dict(template_tokens) if template_tokens is not None else {
            k: backend.id_to_token(v) for k, v in named.items() if v is not None}
        self._source, self._template, self._template_error = chat_template or None, None, None
        if chat_template:
            try:
                self._template = ChatTemplate(chat_template, self._named_tokens)
            except ValueError as e:  # a checkpoint's template jinja2 cannot read: chat says so, the rest serves
                self._template_error = str(e)

    @property
    def chat_template(self) -> str | None:
        """The Jinja source of the chat template (None: the checkpoint has none); setting it (`--chat-template`)
        compiles it at once, so a broken template is refused there and not in a request (ValueError)."""
        return self._source

    @chat_template.setter
    def chat_template(self, source: str | None) -> None:
        self._template = ChatTemplate(source, self._named_tokens) if source else None
        self._source, self._template_error = source or None, None

    @property
    def template(self) -> ChatTemplate | None:
        return self._template

    @property
    def backend(self) -> Backend:
        """The `tokenizers` object (what `tokenizer.json` serializes)."""
        return self._tk

    # ---- loading -------------------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path) -> Tokenizer:
        from model.loaders.gguf_reader import GGUFFile

        return cls.from_gguf_metadata(GGUFFile(path).metadata)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        backend, add_bos_default = gguf_backend(meta)
        tokens = meta["tokenizer.ggml.tokens"]

        def tid(key):
            v = meta.get(f"tokenizer.ggml.{key}")
            return int(v) if v is not None and 0 <= int(v) < len(tokens) else None

        return cls(backend, bos_id=tid("bos_token_id"), eos_id=tid("eos_token_id"), stop_ids=gguf_stop_ids(meta),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                   chat_template=meta.get("tokenizer.chat_template"), vocab_size=len(tokens),
                   unk_id=tid("unknown_token_id"), pad_id=tid("padding_token_id"))

    @classmethod
    def from_hf_dir(cls, path) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            # Only the `tokenizers` serialization is supported (no tokenizer.model / vocab.json conversion).
            raise FileNotFoundError(f"{path / 'tokenizer.json'} not found")
        backend = Backend.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")
        gen = _read_json(path / "generation_config.json")

        def token_text(name):
            tok = cfg.get(name, special_map.get(name))
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return tok if isinstance(tok, str) else None

        def token_id(name):
            return backend.token_to_id(token_text(name)) if token_text(name) is not None else None

        bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
        if gen.get("bos_token_id") is not None and bos_id is None:
            bos_id = int(gen["bos_token_id"])
        if eos_id is None and gen.get("eos_token_id") is not None:
            eos = gen["eos_token_id"]
            eos_id = int(eos[0] if isinstance(eos, list) else eos)
        stop = set()
        gen_eos = gen.get("eos_token_id")
        stop.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        # Same end-of-generation token names as llama.cpp, but only among added tokens.
        stop.update(i for i, t in backend.get_added_tokens_decoder().items() if t.content in EOG_TEXTS)

        if "add_bos_token" in cfg:
            add_bos = bool(cfg["add_bos_token"])
        else:
            # No flag: the post-processor decides, as in transformers (e.g. Llama 3's TemplateProcessing).
            ids = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and bool(ids) and ids[0] == bos_id

        return cls(backend, bos_id=bos_id, eos_id=eos_id, stop_ids=stop, add_bos=add_bos,
                   chat_template=hf_chat_template(path, cfg), unk_id=token_id("unk_token"),
                   pad_id=token_id("pad_token"), template_tokens={
                       k: token_text(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                       if token_text(k) is not None})

    # ---- text <-> ids --------------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        # Special tokens written in the text are matched (tokenizers always splits on added tokens); BOS is
        # added here rather than by the post-processor so that `add_bos` alone controls it.
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, s: str) -> int | None:
        return self._tk.token_to_id(s)

    def id_to_token(self, i: int) -> str | None:
        return self._tk.id_to_token(i)

    # ---- chat ----------------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render like transformers' apply_chat_template(tokenize=False) (model/text/chat_template.py); `kwargs`:
        `tools` and further template variables."""
        if self._template_error is not None:
            raise ValueError(self._template_error)
        if self._template is None:
            raise ValueError("this checkpoint has no chat template (tokenizer.chat_template / "
                             "tokenizer_config.json chat_template / chat_template.jinja): give one with --chat-template")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
