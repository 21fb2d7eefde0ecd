"""The pieces of /v1/responses without a model: the store's bound and LRU rule, conversation items as chat messages,
chat's field names renamed in refusals, and the output items and events a reply makes in each tool mode."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from model.engine import RequestOutput
from service.common.errors import APIError
from service.api.openai.responses.input import chat_messages, chat_request, in_responses_terms, input_items, output_items
from service.api.openai.responses.output import ResponseOutput
from service.api.openai.responses.schemas import ResponsesRequest
from service.api.openai.responses.store import ResponseStore, StoredResponse
from service.api.openai.schemas import ChatCompletionRequest
from service.api.openai.tool_calls import plan_tools

WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def entry(rid: str) -> StoredResponse:
    return StoredResponse({"id": rid}, [])


def test_the_store_drops_the_least_recently_used():
    store = ResponseStore(2)
    store.put(entry("a"))
    store.put(entry("b"))
    assert store.get("a") is not None  # a use: "b" is now the oldest
    store.put(entry("c"))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None and len(store) == 2
    assert store.delete("a") and not store.delete("a") and len(store) == 1
    none = ResponseStore(0)
    none.put(entry("a"))
    assert none.get("a") is None and len(none) == 0


def test_conversation_items_as_chat_messages():
    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Lima"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "4 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "20 C"}]}]})
    messages = chat_messages("Be brief.", input_items(req))
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == "Weather ?"
    assert messages[2]["content"] == "Let me look."
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["call_1", "call_2"]
    assert messages[4] == {"role": "tool", "tool_call_id": "call_2", "content": "20 C"}
    # a string input is one user message; no instructions, no system message
    assert chat_messages(None, input_items(ResponsesRequest(input="hi"))) == [{"role": "user", "content": "hi"}]


def test_the_chat_request_it_runs_as():
    req = ResponsesRequest.model_validate({
        "input": "hi", "max_output_tokens": 7, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                                                  "name": "get_weather"},
        "include": ["message.output_text.logprobs"], "top_logprobs": 2, "seed": 3, "stop": ["\n\n"],
        "interventions": [{"layer": 1, "op": "scale", "dims": [5], "factor": 0.0}]})
    chat = chat_request(req, input_items(req))
    assert isinstance(chat, ChatCompletionRequest)
    assert chat.max_tokens == 7 and chat.logprobs and chat.top_logprobs == 2 and chat.seed == 3
    assert chat.stop == ["\n\n"] and chat.interventions == req.interventions
    assert chat.tools[0].function.name == "get_weather" and chat.tool_choice.function.name == "get_weather"
    fmt = ResponsesRequest.model_validate({"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "p", "schema": {"type": "object"}}}})
    assert chat_request(fmt, input_items(fmt)).response_format.json_schema.schema_ == {"type": "object"}
    with pytest.raises(APIError) as e:
        chat_request(ResponsesRequest(input="hi", top_logprobs=1), [])
    assert e.value.param == "top_logprobs"


@pytest.mark.parametrize("item,words", [
    ({"type": "item_reference", "id": "x"}, "'item_reference' is not supported"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "'input_file' is not supported"),
    ({"type": "function_call_output", "call_id": "c"}, "needs output"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "role": "user"}, "takes no role"),
    ({"role": "user"}, "needs content"),
])
def test_items_this_server_does_not_take(item, words):
    with pytest.raises(ValidationError, match=words):
        ResponsesRequest.model_validate({"input": [item]})


def test_refusals_in_this_requests_terms():
    for param, message, want_param, want_message in [
        ("response_format.json_schema.schema", "response_format.json_schema.schema: bad", "text.format.schema",
         "text.format.schema: bad"),
        ("tools[3].function.parameters", "x", "tools[3].parameters", "x"),
        ("tool_choice.function.name", "x", "tool_choice.name", "x"),
        (None, "prompt (9 tokens) + max_tokens (5) = 14 exceeds", None, "prompt (9 tokens) + max_output_tokens (5)"),
        ("messages", "cannot render the chat template: roles must alternate", "input", "cannot render the chat"),
        ("logprobs", "logprobs must be at most 20, got 30", "top_logprobs", "logprobs must be at most 20"),
    ]:
        e = in_responses_terms(APIError(400, message, param, "invalid_value"))
        assert e.param == want_param and e.message.startswith(want_message) and e.code == "invalid_value"


def outputs(*texts: str, reason: str = "stop") -> list[RequestOutput]:
    return [RequestOutput("r", 0, token_ids=[1], text=t, finish_reason=reason if i == len(texts) - 1 else None)
            for i, t in enumerate(texts)]


def run(req: dict, texts: list[str], reason: str = "stop", native: bool = False) -> tuple[ResponseOutput, list[dict]]:
    r = ResponsesRequest.model_validate({"input": "hi", **req})
    plan = plan_tools(chat_request(r, input_items(r)), native=native)
    out = ResponseOutput(None, plan, r, "abc", "tiny")
    events = out.head()
    for o in outputs(*texts, reason=reason):
        events += out.add(o)
    return out, events + [out.tail(reason, {"input_tokens": 1})]


def test_a_text_reply_streams_its_text():
    out, events = run({}, ["Hel", "lo", ""])
    types = [e["type"] for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[2]["item"]["content"] == [] and events[2]["item"]["status"] == "in_progress"
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Hello"
    assert final["output"][0]["status"] == "completed" and events[-2]["item"] == final["output"][0]
    assert output_items(final["output"]) == [{"type": "message", "role": "assistant", "content": "Hello"}]


def test_max_output_tokens_makes_it_incomplete():
    out, events = run({}, ["Hel"], reason="length")
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"


def test_a_named_call_streams_its_arguments():
    out, events = run({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}},
                      ['{"city": ', '"Oslo"}'])
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert deltas == ['{"city": ', '"Oslo"}']
    [call] = events[-1]["response"]["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["arguments"] == '{"city": "Oslo"}'
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_") and call["status"] == "completed"


def test_required_and_auto_send_their_items_at_the_end():
    calls = json.dumps({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}},
                                       {"name": "get_weather", "arguments": {"city": "Lima"}}]})
    out, events = run({"tools": [WEATHER], "tool_choice": "required"}, [calls[:10], calls[10:]])
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [a["type"] for a in added] == ["function_call", "function_call"]
    assert [json.loads(o["arguments"])["city"] for o in events[-1]["response"]["output"]] == ["Oslo", "Lima"]
    out, events = run({"tools": [WEATHER]}, ['{"response": ', '"Hi there"}'])  # auto, generic format: a reply
    [message] = events[-1]["response"]["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Hi there"
