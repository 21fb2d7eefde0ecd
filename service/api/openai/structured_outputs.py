"""Request fields -> the engine's StructuredOutputSpec, and its compilation before the request is submitted.

One constraint per request, from whichever field the client speaks: OpenAI's `response_format`, vLLM's
`structured_outputs` or its older `guided_*` fields (vLLM's `protocol.py` maps them the same way), or a forced tool
call (service/api/openai/tool_calls.py). Two of them at once is a 400 naming the second. The spec is compiled here, on a worker
thread, so that an invalid schema, an unsupported keyword or a regex that does not compile is a 400 naming the
field before anything is queued, and so that the engine thread, whose own compile is then a cache hit, never waits
on one.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from model.features import StructuredOutputSpec
from service.common.errors import APIError
from service.api.openai.schemas import SamplingFields


# Keywords whose values are schemas, or maps / lists of schemas (JSON Schema 2020-12, "Core" sec. 10)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "items", "prefixItems",
            "allOf", "anyOf", "oneOf", "not", "if", "then", "else")


def close_objects(schema: Any) -> Any:
    """A copy of `schema` where every object schema that lists properties but does not say additionalProperties
    allows no others. Narrower, so every output still validates against the original, but the model cannot append
    keys of its own (a small model does, writing JSON Schema keywords into tool arguments). vLLM's
    `disable_additional_properties` (backend_guidance.py), made the default; say `"additionalProperties": true`
    to keep an object open."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                for sub in node[key].values():
                    walk(sub)
        for key in _SCHEMAS:
            walk(node.get(key))
        if "additionalProperties" not in node and isinstance(node.get("properties"), dict) \
                and "patternProperties" not in node and "unevaluatedProperties" not in node:
            node["additionalProperties"] = False

    walk(schema)
    return schema


def json_schema_spec(schema: Any, source: str) -> StructuredOutputSpec:
    """A JSON-schema spec from a dict or JSON text, objects closed (close_objects). ValueError naming source."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"{source}: not valid JSON: {e}") from None
    return StructuredOutputSpec.json_schema(close_objects(schema), source)


def _refuse(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def requested_spec(req: SamplingFields) -> StructuredOutputSpec | None:
    """The constraint a request asks for, or None. 400 (naming the field) for two at once or a malformed one."""
    found: list[StructuredOutputSpec] = []
    try:
        rf = req.response_format
        if rf is not None and rf.type == "json_object":
            found.append(StructuredOutputSpec("json_object", source="response_format"))
        elif rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.schema_
            found.append(json_schema_spec(schema, "response_format.json_schema.schema")
                         if schema is not None else StructuredOutputSpec("json_object", source="response_format"))
        so = req.structured_outputs
        if so is not None:
            given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(so, k) is not None]
            given += ["json_object"] if so.json_object else []
            if len(given) != 1:
                names = ", ".join(g.rstrip("_") for g in given) or "none"
                raise _refuse(f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object "
                              f"(got {names})", "structured_outputs")
            found.append(_spec(given[0].rstrip("_"), getattr(so, given[0]), f"structured_outputs.{given[0].rstrip('_')}"))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(req, f"guided_{name}")
            if value is not None:
                found.append(_spec(name, value, f"guided_{name}"))
    except ValueError as e:  # a schema given as text that is not JSON; its message starts with the field
        raise _refuse(str(e), str(e).split(":", 1)[0]) from None
    if len(found) > 1:
        raise _refuse(f"{found[1].source} cannot be combined with {found[0].source}: give one output constraint",
                      found[1].source)
    return found[0] if found else None


def _spec(kind: str, value, source: str) -> StructuredOutputSpec:
    if kind == "json":
        return json_schema_spec(value, source)
    if kind == "choice":
        return StructuredOutputSpec.choice(value, source)
    if kind == "json_object":
        return StructuredOutputSpec("json_object", source=source)
    return StructuredOutputSpec(kind, value, source)
