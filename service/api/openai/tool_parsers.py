"""The model's own tool-call formats, read back into OpenAI `tool_calls` (vLLM's `--tool-call-parser`:
vllm/tool_parsers/hermes_tool_parser.py, mistral_tool_parser.py, llama_tool_parser.py):

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, anywhere in the reply; the text around
  them is the content (Qwen2.5 and Qwen3 templates ask for this format, as Hermes 2 Pro's does).
- mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, the content before it (Mistral-7B-Instruct-v0.3's
  template, the "v3" one). `[TOOL_CALLS]` is a control token, so such replies are decoded with special tokens kept,
  and their call ids are 9 letters and digits, the only ids that template accepts back.
- llama3_json: the whole reply is one `{"name": ..., "parameters": {...}}` object (Llama 3.x's JSON tool calling).
- auto: each of these in that order; the first that finds a call of a requested tool wins.
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from typing import Any

TOOL_CALL_PARSERS = ("auto", "hermes", "mistral", "llama3_json")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
MISTRAL_BOT = "[TOOL_CALLS]"
MISTRAL_ID_LENGTH = 9  # the v3 template's raise_exception("Tool call IDs should be alphanumeric strings with length 9!")


def template_tool_format(source: str | None) -> str | None:
    """The tool-call format a chat template writes back for an assistant's earlier calls: "mistral", "hermes", or
    None (no format of its own, or one these parsers do not read)."""
    if not source:
        return None
    if MISTRAL_BOT in source:
        return "mistral"
    return "hermes" if "<tool_call>" in source else None


def call_id(mistral: bool = False) -> str:
    if mistral:  # vLLM's MistralToolCall.generate_random_id
        return "".join(random.choices(string.ascii_letters + string.digits, k=MISTRAL_ID_LENGTH))
    return f"call_{uuid.uuid4().hex[:24]}"


def template_call_id(id_: str, template_format: str | None) -> str:
    """A client's call id as the template gets it back: the Mistral template takes exactly 9 characters, so longer
    ids keep their last 9, as vLLM's truncate_tool_call_ids does for Mistral models."""
    return id_[-MISTRAL_ID_LENGTH:] if template_format == "mistral" else id_


def _call(name: str, arguments: Any, mistral: bool = False) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(mistral), "type": "function", "function": {"name": name, "arguments": text}}


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _named_call(obj: Any, known: set[str], mistral: bool = False) -> dict | None:
    """{"name": N, "arguments" (or Llama's "parameters"): {...}} -> an OpenAI call, when N is a requested tool."""
    if not isinstance(obj, dict) or obj.get("name") not in known:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return _call(obj["name"], arguments if arguments is not None else {}, mistral)


def parse_hermes(text: str, known: set[str]) -> tuple[str | None, list[dict]] | None:
    calls = [c for c in (_named_call(_json(b), known) for b in _HERMES_CALL.findall(text)) if c is not None]
    if not calls:
        return None
    return _HERMES_CALL.sub("", text).strip() or None, calls


def parse_mistral(text: str, known: set[str]) -> tuple[str | None, list[dict]] | None:
    at = text.find(MISTRAL_BOT)
    if at < 0:
        return None
    rest = text[at + len(MISTRAL_BOT):].lstrip()
    try:  # the array, and whatever the model wrote after it (a second [TOOL_CALLS], say) is left out
        obj, _ = json.JSONDecoder().raw_decode(rest)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [c for c in (_named_call(item, known, mistral=True) for item in items) if c is not None]
    return (text[:at].strip() or None, calls) if calls else None


def parse_llama3_json(text: str, known: set[str]) -> tuple[str | None, list[dict]] | None:
    obj = _json(text.strip().removeprefix("<|python_tag|>"))
    args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
    call = _named_call(obj, known) if isinstance(args, dict) else None
    return (None, [call]) if call is not None else None


_PARSERS = {"hermes": parse_hermes, "mistral": parse_mistral, "llama3_json": parse_llama3_json}


def parse_tool_calls(parser: str, text: str, known: set[str]) -> tuple[str | None, list[dict]]:
    """A reply in the model's own format -> (content, calls); text with no call of a requested tool is all
    content."""
    for name in _PARSERS if parser == "auto" else (parser,):
        found = _PARSERS[name](text, known)
        if found is not None:
            return found
    return text, []
