"""POST /v1/responses on the default model through the official `openai` client: a plain response equal to the chat
route's on the same conversation; streamed, its typed events in order with contiguous sequence numbers and its text
equal to the plain one's; a JSON schema; a function tool whose call goes back with its output; a continuation by
`previous_response_id` equal, token for token, to sending the whole conversation; GET and DELETE; the metrics; and
every refusal an envelope naming the field, the server healthy after it."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from prometheus_client.parser import text_string_to_metric_families

openai = pytest.importorskip("openai")

# "What is the capital of Japan?" has a clear margin at every precision (the README's first example)
QUESTION = "What is the capital of Japan?"
FOLLOW_UP = "And what is it famous for?"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"]}}


def scrape_metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def moved(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def test_plain_response_equals_the_chat_reply(client, name):
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": QUESTION}],
                                          temperature=0, max_tokens=24)
    r = client.responses.create(model=name, input=QUESTION, temperature=0, max_output_tokens=24)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == name
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens > 0  # the chat request just ran the same prompt


def test_streamed_events_in_order_and_text_equal_to_the_plain_one(client, name):
    kw = dict(model=name, input=QUESTION, instructions="Answer in one sentence.", temperature=0, max_output_tokens=24)
    plain = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    last = "response.completed" if plain.status == "completed" else "response.incomplete"
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", last]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-4].text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))
    final = events[-1].response
    assert final.output_text == plain.output_text and final.status == plain.status
    assert final.usage.output_tokens == plain.usage.output_tokens and final.instructions == kw["instructions"]


def test_the_clients_stream_helper_builds_the_same_response(client, name):
    """openai's `responses.stream` checks the events against each other as it accumulates them (item identities,
    indices, parts) and builds the final response from the deltas."""
    kw = dict(model=name, input=QUESTION, temperature=0, max_output_tokens=24)
    plain = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == text == plain.output_text
    named = {"type": "function", "name": "get_weather"}
    with client.responses.stream(model=name, input="Weather in Lima?", tools=[WEATHER], tool_choice=named,
                                 temperature=0, max_output_tokens=48) as stream:
        arguments = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        [call] = stream.get_final_response().output
    assert call.type == "function_call" and call.arguments == arguments


def test_json_schema_output_parses_and_validates(client, name):
    r = client.responses.create(
        model=name, input="Describe a person as a JSON object with a name and an age.", temperature=0,
        max_output_tokens=64, text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"


def test_a_function_call_and_its_output_sent_back(client, name):
    first = client.responses.create(model=name, input="What is the weather like in Oslo?", tools=[WEATHER],
                                    tool_choice="required", temperature=0, max_output_tokens=64)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and first.status == "completed", first.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    second = client.responses.create(
        model=name, previous_response_id=first.id, tools=[WEATHER], tool_choice="none", temperature=0,
        max_output_tokens=16, input=[{"type": "function_call_output", "call_id": call.call_id, "output": "4 C, snow"}])
    assert [o.type for o in second.output] == ["message"] and second.output_text
    assert second.previous_response_id == first.id
    # the same turn with the call sent back by the client instead: the same prompt, the same reply
    again = client.responses.create(
        model=name, tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=16, store=False,
        input=[{"role": "user", "content": "What is the weather like in Oslo?"}, call,
               {"type": "function_call_output", "call_id": call.call_id, "output": "4 C, snow"}])
    assert again.output_text == second.output_text and again.usage.input_tokens == second.usage.input_tokens


def test_a_named_call_streams_its_arguments(client, name):
    events = list(client.responses.create(
        model=name, input="Weather in Lima?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        temperature=0, max_output_tokens=48, stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert len(added) == 1 and added[0].item.type == "function_call" and added[0].item.name == "get_weather"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == deltas and len([e for e in events if e.type.endswith(".delta")]) > 1
    jsonschema.validate(json.loads(deltas), WEATHER["parameters"])
    [call] = events[-1].response.output
    assert call.arguments == deltas and call.call_id == added[0].item.call_id


def test_a_continuation_equals_the_whole_conversation(client, name):
    kw = dict(model=name, temperature=0, max_output_tokens=20, include=["message.output_text.logprobs"])
    first = client.responses.create(input=QUESTION, **kw)
    continued = client.responses.create(previous_response_id=first.id, input=FOLLOW_UP, **kw)
    whole = client.responses.create(input=[{"role": "user", "content": QUESTION}, *first.output,
                                           {"role": "user", "content": FOLLOW_UP}], store=False, **kw)
    assert continued.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    a, b = continued.output[0].content[0].logprobs, whole.output[0].content[0].logprobs
    assert [t.token for t in a] == [t.token for t in b] and len(a) == continued.usage.output_tokens
    assert [t.logprob for t in a] == pytest.approx([t.logprob for t in b], abs=1e-4)
    assert continued.output_text == whole.output_text
    # the continuation's prompt is the first turn's prompt and reply, then more: its prefix is cached
    assert continued.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16 - 16


def test_retrieve_and_delete(client, name, server):
    r = client.responses.create(model=name, input=QUESTION, temperature=0, max_output_tokens=4,
                                metadata={"run": "test"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"run": "test"}
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model=name, input=QUESTION, max_output_tokens=2, store=False)
    for body in ({"previous_response_id": r.id}, {"previous_response_id": unstored.id}):
        resp = httpx.post(server.url + "/v1/responses", json={"input": "hi", **body}, timeout=60)
        assert resp.status_code == 404 and resp.json()["error"]["param"] == "previous_response_id", resp.text
    assert httpx.delete(server.url + f"/v1/responses/{r.id}").status_code == 404


def test_counted_in_the_metrics(client, name, server):
    before = scrape_metrics(server.url)
    r = client.responses.create(model=name, input=QUESTION, temperature=0, max_output_tokens=6)
    list(client.responses.create(model=name, input=QUESTION, temperature=0, max_output_tokens=6, stream=True))
    httpx.post(server.url + "/v1/responses", json={"input": "hi", "temperature": 5})
    after = scrape_metrics(server.url)
    assert moved(before, after, "llamascope_requests_total", endpoint="responses", status="200") == 2
    assert moved(before, after, "llamascope_requests_total", endpoint="responses", status="400") == 1
    assert moved(before, after, "llamascope_generation_tokens_total") == 2 * r.usage.output_tokens
    assert moved(before, after, "llamascope_prompt_tokens_total") == 2 * r.usage.input_tokens


@pytest.mark.parametrize("body,status,param,words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input.0.content.0",
     "'input_image' is not supported"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input.0", "'reasoning' is not supported"),
    ({"input": [{"type": "function_call", "call_id": "c"}]}, 400, "input.0", "needs arguments, name"),
    ({"input": [{"role": "user", "content": "hi", "call_id": "c"}]}, 400, "input.0", "takes no call_id"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools.0", "'web_search' is not supported"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}}}, 400, "text.format.schema",
     "Invalid type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, 400, "text.format", "name and schema are required"),
    ({"text": {"format": {"type": "json_object", "name": "x"}}}, 400, "text.format", "only taken"),
    ({"top_logprobs": 2}, 400, "top_logprobs", "include"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice.name", "not among"),
    ({"tools": [WEATHER, WEATHER]}, 400, "tools[1].name", "two tools"),
    ({"tools": [WEATHER], "text": {"format": {"type": "json_object"}}}, 400, "text.format", "text.format cannot"),
    ({"max_output_tokens": 1 << 20}, 400, None, "max_output_tokens"),
    ({"truncation": "auto"}, 400, "truncation", "disabled"),
    ({"model": "nope"}, 404, "model", "does not exist"),
    ({"previous_response_id": "resp_nope"}, 404, "previous_response_id", "no stored response"),
])
def test_refusals_are_envelopes_naming_the_field(server, name, body, status, param, words):
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={"input": "hi", "max_output_tokens": 4, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert httpx.get(server.url + "/health").status_code == 200
