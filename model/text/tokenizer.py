"""Text <-> token ids for a checkpoint (HF tokenizer directory or GGUF file), chat templates, streaming decode."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from model.text.gguf_vocab import EOG_TEXTS, gguf_backend, gguf_stop_ids


class Tokenizer:
    def __init__(self, backend: Backend, *, bos_id: int | None, eos_id: int | None, stop_ids=(),
                 add_bos: bool = False, chat_template: str | None = None, vocab_size: int | None = None,
                 unk_id: int | None = None, pad_id: int | None = None):
        self._tk = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.stop_ids = frozenset(stop_ids) | ({eos_id} if eos_id is not None else set())
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.vocab_size = vocab_size if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True)
        self._template = None
        # Token strings a chat template may reference; transformers passes its special_tokens_map.
        named = {"bos_token": bos_id, "eos_token": eos_id, "unk_token": unk_id, "pad_token": pad_id}
        self._named_tokens = {k: backend.id_to_token(v) for k, v in named.items() if v is not None}

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

        def token_id(name):
            tok = cfg.get(name, special_map.get(name))
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return backend.token_to_id(tok) if isinstance(tok, str) else None

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
                   chat_template=_hf_chat_template(path, cfg), unk_id=token_id("unk_token"),
                   pad_id=token_id("pad_token"))

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
        """Render like transformers' apply_chat_template(tokenize=False) (utils/chat_template_utils.py)."""
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template (tokenizer.chat_template / "
                             "tokenizer_config.json chat_template / chat_template.jinja)")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        variables = {**self._named_tokens, "tools": None, "documents": None}
        variables.update(kwargs)
        # transformers drops None-valued keys (e.g. OpenAI's content=None next to tool_calls) before rendering.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _hf_chat_template(path: Path, cfg: dict) -> str | None:
    # transformers >= 4.43 saves the template to chat_template.jinja (or chat_template.json); older
    # tokenizer_config.json holds a string or a list of {"name", "template"} with "default" first choice.
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    tpl = _read_json(path / "chat_template.json").get("chat_template", cfg.get("chat_template"))
    if isinstance(tpl, list):
        named = {t["name"]: t["template"] for t in tpl}
        tpl = named.get("default", next(iter(named.values()), None))
    return tpl


def _compile_template(source: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        # transformers' AssistantTracker tag `{% generation %}...{% endgeneration %}`; renders its body as-is.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson HTML-escapes; transformers overrides it with plain json.dumps.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
