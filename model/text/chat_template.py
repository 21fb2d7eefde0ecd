"""A checkpoint's Jinja chat template, rendered as transformers' `apply_chat_template(tokenize=False)` renders it
(utils/chat_template_utils.py: an ImmutableSandboxedEnvironment with trim_blocks / lstrip_blocks, loopcontrols,
the `{% generation %}` tag, `raise_exception`, `strftime_now` and a `tojson` that does not HTML-escape).

Where a template comes from: tokenizer_config.json's `chat_template` (a string, or a list of named templates),
chat_template.jinja / chat_template.json beside it (transformers >= 4.43 saves there), a GGUF's
`tokenizer.chat_template`, or a file given with `--chat-template` (vLLM's flag).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

# Variables a request may not set through `chat_template_kwargs`: the request says them with its own fields
# (vLLM refuses `chat_template` and `tokenize` there too: entrypoints/chat_utils.py resolve_chat_template_kwargs).
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "chat_template", "tokenize"})


class ChatTemplate:
    """One compiled template and the names it reads. `special_tokens`: bos_token, eos_token, ... as text (what
    transformers passes from its special_tokens_map)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        import jinja2
        from jinja2 import meta

        self.source = source
        env = _environment()
        try:
            self.variables = frozenset(meta.find_undeclared_variables(env.parse(source)))
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template is not valid Jinja: {e.message} (line {e.lineno})") from None
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               documents: list[dict] | None = None, **kwargs: Any) -> str:
        """`kwargs`: further template variables (e.g. Qwen3's `enable_thinking`), as transformers passes its
        **kwargs; they override the special tokens' names, never the messages or tools."""
        variables = {**self.special_tokens, **kwargs, "tools": tools, "documents": documents}
        # transformers drops None-valued keys (e.g. OpenAI's content=None next to tool_calls) before rendering.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)

    def accepted_kwargs(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """A request's `chat_template_kwargs` reduced to the variables this template reads (vLLM drops the rest the
        same way); ValueError naming a reserved one."""
        reserved = sorted(RESERVED_VARIABLES & kwargs.keys())
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the request has its own "
                             "field for it")
        return {k: v for k, v in kwargs.items() if k in self.variables}


def read_template_option(value: str) -> str:
    """`--chat-template`: a file's path, or the template itself written in one line (as vLLM's flag accepts)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"no such file {value!r} (give a Jinja template file, or the template itself)")


def hf_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    """The template of an HF tokenizer directory. transformers >= 4.43 saves it to chat_template.jinja (or
    chat_template.json); older tokenizer_config.json holds a string or a list of {"name", "template"} with
    "default" first choice."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    saved = path / "chat_template.json"
    tpl = json.loads(saved.read_text(encoding="utf-8")).get("chat_template") if saved.is_file() else None
    tpl = tpl if tpl is not None else config.get("chat_template")
    if isinstance(tpl, list):
        named = {t["name"]: t["template"] for t in tpl}
        tpl = named.get("default", next(iter(named.values()), None))
    return tpl


def _environment():
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
    return env
