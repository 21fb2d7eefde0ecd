"""`StructuredOutputSpec`: what one request's output must match, in the engine's terms (torch- and grammar-free).

The service turns OpenAI's `response_format`, vLLM's `structured_outputs` / `guided_*` and a forced tool call into
one of these; `SamplingParams.structured` carries it; `GrammarCompiler` (compiler.py) turns it into a grammar. Two
specs are equal (and share one compiled grammar in the cache) when their kind and text are equal: the request field
it came from is carried only to name it in errors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
# Caps on what a request may make the engine compile (the grammar engine has its own limits on the result).
MAX_SPEC_CHARS = 1 << 20
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutputSpec:
    """kind:
    - "json_schema": `value` is a JSON Schema (draft 2020-12 subset: llguidance's, docs/api.md) as JSON text;
    - "json_object": any JSON object (`value` empty);
    - "regex": the whole output matches `value` (Rust `regex` syntax, as vLLM's llguidance backend);
    - "choice": `value` is a JSON list of strings; the output is exactly one of them;
    - "grammar": `value` is a context-free grammar, Lark (llguidance's dialect) or llama.cpp's GBNF.
    """

    kind: str
    value: str = ""
    # the request field it came from ("response_format.json_schema.schema", "tools[0].function.parameters", ...):
    # named in every error about it, and not part of the cache key
    source: str = field(default="structured", compare=False)

    @classmethod
    def json_schema(cls, schema: Any, source: str = "structured") -> StructuredOutputSpec:
        """A schema given as a dict or as JSON text; key order is kept (it is the order properties are written in)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"{source}: not valid JSON: {e}") from None
        try:
            text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: the schema is not JSON-serializable: {e}") from None
        return cls("json_schema", text, source)

    @classmethod
    def choice(cls, options: Any, source: str = "structured") -> StructuredOutputSpec:
        if not isinstance(options, (list, tuple)):
            raise ValueError(f"{source}: must be a list of strings, got {type(options).__name__}")
        return cls("choice", json.dumps(list(options), ensure_ascii=False), source)

    def validate(self) -> None:
        """ValueError naming `source` for a spec no grammar can be built from, before any grammar engine runs."""
        where = self.source
        if self.kind not in KINDS:
            raise ValueError(f"{where}: unknown kind {self.kind!r}; one of {', '.join(KINDS)}")
        if not isinstance(self.value, str):
            raise ValueError(f"{where}: the spec's value must be text, got {type(self.value).__name__}")
        if len(self.value) > MAX_SPEC_CHARS:
            raise ValueError(f"{where}: at most {MAX_SPEC_CHARS} characters, got {len(self.value)}")
        if self.kind == "json_object":
            if self.value:
                raise ValueError(f"{where}: json_object takes no value")
            return
        if not self.value:
            raise ValueError(f"{where}: must not be empty")
        if self.kind == "json_schema":
            schema = json.loads(self.value)
            if not isinstance(schema, dict):
                raise ValueError(f"{where}: a JSON schema must be an object, got {type(schema).__name__}")
        elif self.kind == "choice":
            options = json.loads(self.value)
            if not options or len(options) > MAX_CHOICES:
                raise ValueError(f"{where}: must list 1 to {MAX_CHOICES} choices, got {len(options)}")
            if not all(isinstance(o, str) and o for o in options):
                raise ValueError(f"{where}: every choice must be a non-empty string")
