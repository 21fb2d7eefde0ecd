"""Tool calls without a model: which constraint each tool_choice makes, how a template with a tool format is told
apart from one without, what is parsed back (Hermes blocks, Llama-style JSON, the generic JSON), how a named call
streams, and how objects are closed."""

from __future__ import annotations

import json

import jsonschema
import pytest

from benchmarks.tiny_checkpoint import byte_backend
from model.text.tokenizer import Tokenizer
from service.common.errors import APIError
from service.api.openai.schemas import ChatCompletionRequest
from service.api.openai.structured_outputs import close_objects
from service.api.openai.tool_calls import ChoiceMessage, parse_output, plan_tools, template_messages, template_renders_tools
from service.api.openai.tool_parsers import parse_tool_calls, template_tool_format

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "clock"}}
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}</{{ m.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")
PLAIN_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"


def tokenizer(template: str) -> Tokenizer:
    return Tokenizer(byte_backend(), bos_id=None, eos_id=None, chat_template=template)


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


def test_a_template_with_a_tool_format_is_told_apart():
    assert template_renders_tools(tokenizer(HERMES_TEMPLATE))
    assert not template_renders_tools(tokenizer(PLAIN_TEMPLATE))


def test_each_tool_choice_makes_its_constraint():
    tools = [WEATHER, TIME]
    assert plan_tools(request(), native=False).mode == "none"
    assert plan_tools(request(tools=tools, tool_choice="none"), native=False).spec is None
    named = plan_tools(request(tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                       native=False)
    schema = json.loads(named.spec.value)
    assert named.mode == "named" and schema["properties"] == WEATHER["function"]["parameters"]["properties"]
    assert schema["additionalProperties"] is False  # closed: the model cannot add keys
    required = json.loads(plan_tools(request(tools=tools, tool_choice="required", parallel_tool_calls=False),
                                     native=True).spec.value)
    calls = required["properties"]["tool_calls"]
    assert calls["minItems"] == 1 and calls["maxItems"] == 1 and len(calls["items"]["anyOf"]) == 2
    jsonschema.validate({"tool_calls": [{"name": "get_time", "arguments": {}}]}, required)
    with pytest.raises(jsonschema.ValidationError):  # a tool without parameters takes no arguments
        jsonschema.validate({"tool_calls": [{"name": "get_time", "arguments": {"x": 1}}]}, required)
    generic = plan_tools(request(tools=tools), native=False)
    assert generic.mode == "auto_generic"
    jsonschema.validate({"response": "hello"}, json.loads(generic.spec.value))
    native = plan_tools(request(tools=tools), native=True)
    assert native.mode == "auto_template" and native.spec is None and len(native.tool_specs) == 2


@pytest.mark.parametrize("kw,param", [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "tools[0].function.parameters"),
])
def test_refusals_name_the_field(kw, param):
    with pytest.raises(APIError) as e:
        plan_tools(request(**kw), native=False)
    assert e.value.status == 400 and e.value.param == param


def test_what_is_parsed_back():
    native = plan_tools(request(tools=[WEATHER, TIME]), native=True)
    content, calls = parse_output(native, 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": '
                                          '"Oslo"}}</tool_call>')
    assert content == "Let me look." and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    _, calls = parse_output(native, '{"name": "get_time", "parameters": {}}')  # Llama 3.x
    assert calls[0]["function"]["name"] == "get_time"
    assert parse_output(native, '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')[1] == []
    assert parse_output(native, "It is sunny.") == ("It is sunny.", [])
    generic = plan_tools(request(tools=[WEATHER, TIME]), native=False)
    assert parse_output(generic, '{"response": "Hello"}') == ("Hello", [])
    _, calls = parse_output(generic, '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Lima"}}, '
                                     '{"name": "get_time", "arguments": {}}]}')
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert len({c["id"] for c in calls}) == 2
    assert parse_output(generic, '{"tool_calls": [{"na') == ('{"tool_calls": [{"na', [])  # cut short: content


def test_a_named_call_streams_as_argument_deltas():
    plan = plan_tools(request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                      native=False)
    msg = ChoiceMessage(plan)
    first = msg.delta('{"city": ', False)["tool_calls"][0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["function"]["name"] == "get_weather"
    assert msg.delta("", False) is None
    assert msg.delta('"Rome"}', True) == {"tool_calls": [{"index": 0, "function": {"arguments": '"Rome"}'}}]}
    whole = msg.message()
    assert whole["content"] is None and whole["tool_calls"][0]["id"] == first["id"]
    assert json.loads(whole["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    assert msg.finish_reason("stop") == "stop"
    required = ChoiceMessage(plan_tools(request(tools=[WEATHER], tool_choice="required"), native=False))
    assert required.delta('{"tool_calls": [{"name": "get_weather", ', False) is None  # known only at the end
    out = required.delta('"arguments": {"city": "Rome"}}]}', True)
    assert out["tool_calls"][0]["function"]["name"] == "get_weather" and required.finish_reason("stop") == "tool_calls"


def test_tool_turns_are_rendered_for_either_kind_of_template():
    body = {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "snow"}]}
    req = ChatCompletionRequest.model_validate(body)
    generic = template_messages(req.messages, plan_tools(req, native=False))
    assert generic[0]["role"] == "system" and "get_weather" in generic[0]["content"]  # the tools described
    assert json.loads(generic[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}
    native = template_messages(req.messages, plan_tools(req, native=True))
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # HF's convention: an object
    assert native[2] == {"role": "tool", "content": "snow", "tool_call_id": "c1"}
    text = tokenizer(HERMES_TEMPLATE).apply_chat_template(native, tools=[WEATHER])
    assert "<tools>get_weather </tools>" in text and '<tool_call>{"name": "get_weather"' in text


def test_objects_are_closed_only_where_the_schema_is_silent():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "object", "properties": {}, "additionalProperties": True},
        "c": {"type": "array", "items": {"type": "object", "properties": {"y": {}}}},
        "d": {"anyOf": [{"type": "object", "properties": {"z": {}}}, {"type": "null"}]},
        "e": {"type": "object"}}, "$defs": {"f": {"type": "object", "properties": {"w": {}}}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    p = closed["properties"]
    assert p["a"]["additionalProperties"] is False and p["b"]["additionalProperties"] is True
    assert p["c"]["items"]["additionalProperties"] is False and p["d"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in p["e"]  # no properties listed: any object, as the schema says
    assert closed["$defs"]["f"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's own schema is left alone


# ---- the model's own formats (--tool-call-parser) -------------------------------------------------------------


MISTRAL_REPLY = ('Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                 '{"name": "get_time", "arguments": {}}]')
HERMES_REPLY = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("parser", ["auto", "hermes", "mistral", "llama3_json"])
def test_each_parser_reads_its_format_and_only_it(parser):
    known = {"get_weather", "get_time"}
    replies = {"hermes": HERMES_REPLY, "mistral": MISTRAL_REPLY,
               "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'}
    for fmt, reply in replies.items():
        content, calls = parse_tool_calls(parser, reply, known)
        if parser not in ("auto", fmt):
            assert (content, calls) == (reply, [])  # another format: all content
            continue
        assert calls and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
        assert content == ("Sure." if fmt == "mistral" else None)
        # Mistral's template takes back only ids of 9 letters and digits
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls) == (fmt == "mistral")
    assert parse_tool_calls(parser, '[TOOL_CALLS] [{"name": "nope", "arguments": {}}]', known)[1] == []
    assert parse_tool_calls(parser, '[TOOL_CALLS] [{"name": "get_w', known)[1] == []  # cut short: content


def test_mistral_calls_round_trip_through_the_template():
    """A Mistral-template plan reads [TOOL_CALLS] back with the parser, keeps control tokens in the text, and gives
    the template back ids it accepts (a client's longer ids keep their last 9 characters, as vLLM's)."""
    from family_tokenizers import TEMPLATES

    mistral = Tokenizer(byte_backend(), bos_id=257, eos_id=256,
                        chat_template=(TEMPLATES / "mistral-7b-instruct-v0.3.jinja").read_text())
    assert template_tool_format(mistral.chat_template) == "mistral" and template_renders_tools(mistral)
    req = request(tools=[WEATHER, TIME])
    plan = plan_tools(req, native=True, parser="auto", template_format="mistral")
    content, calls = parse_output(plan, MISTRAL_REPLY)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    body = {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0123456789abcdef", "type": "function", "function": {"name": "get_weather",
                                                                           "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "snow"}]}
    req = ChatCompletionRequest.model_validate(body)
    messages = template_messages(req.messages, plan_tools(req, native=True, template_format="mistral"))
    assert messages[1]["tool_calls"][0]["id"] == messages[2]["tool_call_id"] == "789abcdef"
    text = mistral.apply_chat_template(messages, tools=[WEATHER])
    assert '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "789abcdef"}]' in text
    assert template_tool_format(HERMES_TEMPLATE) == "hermes" and template_tool_format(PLAIN_TEMPLATE) is None
