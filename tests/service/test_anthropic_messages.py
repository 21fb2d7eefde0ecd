"""POST /v1/messages and /v1/messages/count_tokens through the official `anthropic` package, against live servers on
a tiny random checkpoint with a chat template (benchmarks/tiny_checkpoint.py) and on a scripted reasoning model
(tests/scripted.py): a message equal, token for token, to what /v1/chat/completions answers for the same
conversation (system blocks, several turns, tool calls and results); its stream's events in Anthropic's order, each
named by its type, and the client's accumulated message equal to the whole one; tools forced by tool_choice, their
input valid for their schema and equal to the chat route's call; stop_sequences; count_tokens equal to the prompt
/v1/chat/completions runs; thinking blocks from --reasoning-parser, whole and streamed, and thinking disabled;
x-api-key beside the bearer token; and every hostile request answered in Anthropic's error envelope with its
status, the server still serving after it."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from benchmarks.tiny_checkpoint import write_tiny_checkpoint
from family_tokenizers import TEMPLATES
from live_server import LiveServer, engine_core, idle_stats, is_idle
from scripted import scripted_model, scripted_tokenizer

anthropic = pytest.importorskip("anthropic")

CONTEXT = 1024
MAX_BODY = 64 << 10
GREEDY = {"extra_body": {"temperature": 0}}  # the package's create() has no temperature argument of its own
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"]}}
TIME = {"name": "get_time", "description": "Local time in a city",
        "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                         "required": ["zone"]}}
SYSTEM = [{"type": "text", "text": "You are terse. "}, {"type": "text", "text": "Answer in one line."}]
CONVERSATION = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": [{"type": "text", "text": "Name a color."}]}]
# the same conversation as chat messages (the system blocks' text joined)
CHAT_CONVERSATION = [{"role": "system", "content": "You are terse. Answer in one line."},
                     {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
                     {"role": "user", "content": "Name a color."}]


@contextlib.contextmanager
def tiny_server(tmp: Path, **settings):
    from model.loaders.checkpoint import load_model
    from service.config import Settings
    from service.main import create_app

    loaded = load_model(write_tiny_checkpoint(tmp / "tiny-llama", max_seq_len=CONTEXT))
    app = create_app(Settings(max_model_len=CONTEXT, **settings), loaded=loaded, wait_ready=True)
    with LiveServer(app) as live:
        live.name = app.state.server.model_name
        yield live


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with tiny_server(tmp_path_factory.mktemp("anthropic"), max_body_bytes=MAX_BODY) as live:
        live.client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=120)
        yield live


def chat(live, messages: list[dict], **fields) -> dict:
    body = {"model": live.name, "messages": messages, "temperature": 0, **fields}
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def events(live, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """A streamed /v1/messages as (event name, data) pairs, read as raw SSE."""
    found, name = [], None
    with httpx.stream("POST", live.url + "/v1/messages", json={**body, "stream": True}, headers=headers,
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                found.append((name, json.loads(line.removeprefix("data: "))))
                name = None
    return found


def plain(content) -> list[dict]:
    """Content blocks as dicts (the stream helper's ParsedTextBlock has a parsed_output field of its own)."""
    return [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "parsed_output"} for b in content]


def total_input(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "tool_calls": "tool_use"}


def test_a_message_equals_the_chat_reply(live):
    m = live.client.messages.create(model=live.name, max_tokens=16, system=SYSTEM, messages=CONVERSATION, **GREEDY)
    reference = chat(live, CHAT_CONVERSATION, max_tokens=16)
    [block] = m.content
    assert block.type == "text" and block.text == reference["choices"][0]["message"]["content"] and block.text
    assert (m.type, m.role, m.model) == ("message", "assistant", live.name) and m.id.startswith("msg_")
    assert m.stop_reason == STOP_REASONS[reference["choices"][0]["finish_reason"]] and m.stop_sequence is None
    assert total_input(m.usage) == reference["usage"]["prompt_tokens"]
    assert m.usage.output_tokens == reference["usage"]["completion_tokens"]
    again = live.client.messages.create(model=live.name, max_tokens=16, system=SYSTEM, messages=CONVERSATION,
                                        **GREEDY)
    assert again.usage.cache_read_input_tokens > 0  # the prefix cache held the prompt: reported as Anthropic does
    assert again.content == m.content and total_input(again.usage) == total_input(m.usage)


def test_the_stream_in_anthropics_order_and_the_accumulated_message(live):
    body = {"model": live.name, "max_tokens": 16, "system": SYSTEM, "messages": CONVERSATION, "temperature": 0}
    whole = live.client.messages.create(**{k: v for k, v in body.items() if k != "temperature"}, **GREEDY)
    stream = events(live, body)
    assert all(name == data["type"] for name, data in stream)  # the package skips events without their name
    types = [data["type"] for _, data in stream]
    assert types[:3] == ["message_start", "ping", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[3:-3]) == {"content_block_delta"}
    start = stream[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert stream[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [data for _, data in stream[3:-3]]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == whole.content[0].text
    delta = stream[-2][1]
    assert delta["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    with live.client.messages.stream(model=live.name, max_tokens=16, system=SYSTEM, messages=CONVERSATION,
                                     **GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text
    assert plain(final.content) == plain(whole.content) and final.stop_reason == whole.stop_reason
    assert total_input(final.usage) == total_input(whole.usage) and final.usage.output_tokens == whole.usage.output_tokens


def test_a_forced_tool_and_its_result_sent_back(live):
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    m = live.client.messages.create(model=live.name, max_tokens=48, messages=question, tools=[WEATHER, TIME],
                                    tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY)
    [call] = m.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    assert m.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in (WEATHER, TIME)]
    reference = chat(live, question, max_tokens=48, tools=tools,
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [chat_call] = reference["choices"][0]["message"]["tool_calls"]
    assert json.loads(chat_call["function"]["arguments"]) == call.input
    # streamed: the arguments as input_json_delta events, accumulated by the package into the same input
    with live.client.messages.stream(model=live.name, max_tokens=48, messages=question, tools=[WEATHER, TIME],
                                     tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY) as s:
        parts = [e.delta.partial_json for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    [streamed] = final.content
    assert streamed.type == "tool_use" and streamed.input == call.input and json.loads("".join(parts)) == call.input
    assert final.stop_reason == "tool_use"
    # the call and its result given back: the reply equals the chat route's on the same conversation
    turn = [{"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                               "input": call.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "4 C, snow"},
                                         {"type": "text", "text": "Thanks."}]}]
    m2 = live.client.messages.create(model=live.name, max_tokens=12, messages=question + turn, tools=[WEATHER, TIME],
                                     tool_choice={"type": "none"}, **GREEDY)
    chat_turn = [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call.id, "type": "function",
                      "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "4 C, snow"},
                 {"role": "user", "content": "Thanks."}]
    reference = chat(live, question + chat_turn, max_tokens=12, tools=tools, tool_choice="none")
    assert [b.type for b in m2.content] == ["text"]
    assert m2.content[0].text == reference["choices"][0]["message"]["content"]
    assert total_input(m2.usage) == reference["usage"]["prompt_tokens"]


def test_tool_choice_any_equals_chats_required(live):
    question = [{"role": "user", "content": "Weather in Lima, and the time there?"}]
    m = live.client.messages.create(model=live.name, max_tokens=96, messages=question, tools=[WEATHER, TIME],
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True}, **GREEDY)
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in (WEATHER, TIME)]
    reference = chat(live, question, max_tokens=96, tools=tools, tool_choice="required", parallel_tool_calls=False)
    calls = reference["choices"][0]["message"].get("tool_calls") or []
    assert [(b.type, b.name, b.input) for b in m.content] == \
           [("tool_use", c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert m.stop_reason == STOP_REASONS[reference["choices"][0]["finish_reason"]]


def test_stop_sequences(live):
    kw = dict(model=live.name, max_tokens=16, system=SYSTEM, messages=CONVERSATION, **GREEDY)
    text = live.client.messages.create(**kw).content[0].text
    stop = next(c for c in text[2:] if c.isascii() and c.isprintable())  # a stop string the reply writes
    m = live.client.messages.create(**kw, stop_sequences=[stop])
    reference = chat(live, CHAT_CONVERSATION, max_tokens=16, stop=[stop])
    assert reference["choices"][0]["finish_reason"] == "stop"
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert m.content[0].text == reference["choices"][0]["message"]["content"] == text[:text.index(stop)]


def test_count_tokens_is_the_prompt_the_message_runs(live):
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    for kw, reference in (
            (dict(system=SYSTEM, messages=CONVERSATION), dict(messages=CHAT_CONVERSATION)),
            (dict(messages=CONVERSATION, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}),
             dict(messages=CHAT_CONVERSATION[1:], tools=tools,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}))):
        count = live.client.messages.count_tokens(model=live.name, **kw)
        assert count.input_tokens == chat(live, max_tokens=1, **reference)["usage"]["prompt_tokens"]
        m = live.client.messages.create(model=live.name, max_tokens=1, **kw, **GREEDY)
        assert total_input(m.usage) == count.input_tokens


# ---- errors ------------------------------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
TOOL_TURN = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Oslo"}}]}]


def body(**fields) -> dict:
    return {"model": "MODEL", "max_tokens": 8, "messages": MSG, **fields}


# (id, path, json body or raw bytes, status, Anthropic's error type, a substring of the message)
HOSTILE = [
    ("bad-json", "/v1/messages", b'{"model": ', 400, "invalid_request_error", "not valid JSON"),
    ("not-an-object", "/v1/messages", b"[1, 2]", 400, "invalid_request_error", "dictionary"),
    ("no-max-tokens", "/v1/messages", {"model": "MODEL", "messages": MSG}, 400, "invalid_request_error", "max_tokens"),
    ("max-tokens-zero", "/v1/messages", body(max_tokens=0), 400, "invalid_request_error", "max_tokens"),
    ("max-tokens-text", "/v1/messages", body(max_tokens="8"), 400, "invalid_request_error", "max_tokens"),
    ("max-tokens-past-context", "/v1/messages", body(max_tokens=CONTEXT * 4), 400, "invalid_request_error",
     "context"),
    ("no-messages", "/v1/messages", body(messages=[]), 400, "invalid_request_error", "messages"),
    ("unknown-role", "/v1/messages", body(messages=[{"role": "bot", "content": "hi"}]), 400,
     "invalid_request_error", "messages.0: role must be 'user', 'assistant' or 'system'"),
    ("content-a-number", "/v1/messages", body(messages=[{"role": "user", "content": 5}]), 400,
     "invalid_request_error", "messages.0"),
    ("empty-content", "/v1/messages", body(messages=[{"role": "user", "content": ""}]), 400,
     "invalid_request_error", "non-empty"),
    ("empty-text-block", "/v1/messages", body(messages=[{"role": "user", "content": [{"type": "text", "text": ""}]}]),
     400, "invalid_request_error", "messages.0.content.0.text.text"),
    ("image-block", "/v1/messages", body(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]), 400,
     "invalid_request_error", "'image'"),
    ("prefill", "/v1/messages", body(messages=MSG + [{"role": "assistant", "content": "The"}]), 400,
     "invalid_request_error", "prefill"),
    ("unknown-field", "/v1/messages", body(frequency_penalty=1.0), 400, "invalid_request_error", "frequency_penalty"),
    ("temperature-above-1", "/v1/messages", body(temperature=1.5), 400, "invalid_request_error", "temperature"),
    ("top-k-negative", "/v1/messages", body(top_k=-1), 400, "invalid_request_error", "top_k"),
    ("too-many-stops", "/v1/messages", body(stop_sequences=[str(i) for i in range(17)]), 400,
     "invalid_request_error", "16"),
    ("oversize-prompt", "/v1/messages", body(messages=[{"role": "user", "content": "x" * (2 * CONTEXT)}]), 400,
     "invalid_request_error", "context"),
    ("oversize-body", "/v1/messages", body(messages=[{"role": "user", "content": "x" * MAX_BODY}]), 413,
     "request_too_large", "exceeds"),
    ("tool-schema-not-object", "/v1/messages", body(tools=[{**WEATHER, "input_schema": {"type": "array"}}]), 400,
     "invalid_request_error", "input_schema"),
    ("tool-schema-not-a-schema", "/v1/messages", body(tools=[{**WEATHER, "input_schema": {
        "type": "object", "properties": {"city": {"type": "nonsense"}}}}], tool_choice={"type": "any"}), 400,
     "invalid_request_error", "tools.0.input_schema"),
    ("tool-name", "/v1/messages", body(tools=[{**WEATHER, "name": "get weather!"}]), 400, "invalid_request_error",
     "name"),
    ("server-tool", "/v1/messages", body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400,
     "invalid_request_error", "server tools"),
    ("tool-choice-without-name", "/v1/messages", body(tools=[WEATHER], tool_choice={"type": "tool"}), 400,
     "invalid_request_error", "name"),
    ("tool-choice-unknown-tool", "/v1/messages", body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}),
     400, "invalid_request_error", "tool_choice.name"),
    ("tool-result-unknown-id", "/v1/messages", body(messages=TOOL_TURN + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "4 C"}]}]), 400, "invalid_request_error",
     "toolu_2"),
    ("tool-use-unanswered", "/v1/messages", body(messages=TOOL_TURN + [{"role": "user", "content": "and?"}]), 400,
     "invalid_request_error", "toolu_1"),
    ("tool-use-in-a-user-turn", "/v1/messages", body(messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}]), 400,
     "invalid_request_error", "'tool_use'"),
    ("thinking-without-budget", "/v1/messages", body(thinking={"type": "enabled"}), 400, "invalid_request_error",
     "budget_tokens"),
    ("unknown-model", "/v1/messages", {**body(), "model": "claude-sonnet-4-5"}, 404, "not_found_error",
     "claude-sonnet-4-5"),
    ("count-tokens-no-messages", "/v1/messages/count_tokens", {"model": "MODEL"}, 400, "invalid_request_error",
     "messages"),
    ("count-tokens-tool-result-unknown-id", "/v1/messages/count_tokens", {"model": "MODEL", "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]}, 400,
     "invalid_request_error", "toolu_9"),
    ("unknown-route-below", "/v1/messages/batches", {}, 404, "not_found_error", "no route"),
]


def assert_anthropic_envelope(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error", error
    assert set(error["error"]) == {"type", "message"} and error["error"]["type"] == kind, error
    for leak in ("Traceback", "/work/", ".py", "site-packages"):
        assert leak not in r.text, r.text
    return error["error"]["message"]


@pytest.mark.parametrize("path,payload,status,kind,says", [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_requests_get_anthropics_envelope(live, path, payload, status, kind, says):
    if isinstance(payload, dict) and payload.get("model") == "MODEL":
        payload = {**payload, "model": live.name}
    kw = {"content": payload, "headers": {"content-type": "application/json"}} if isinstance(payload, bytes) \
        else {"json": payload}
    message = assert_anthropic_envelope(httpx.post(live.url + path, timeout=60, **kw), status, kind)
    assert says in message, message
    assert httpx.get(live.url + "/health").status_code == 200
    ok = live.client.messages.create(model=live.name, max_tokens=2, messages=MSG, **GREEDY)
    assert ok.usage.output_tokens == 2


def test_the_package_raises_its_own_errors(live):
    with pytest.raises(anthropic.BadRequestError) as e:
        live.client.messages.create(model=live.name, max_tokens=8, messages=[{"role": "user", "content": ""}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        live.client.messages.count_tokens(model="claude-haiku-4-5", messages=MSG)
    r = httpx.get(live.url + "/v1/messages")
    assert assert_anthropic_envelope(r, 405, "invalid_request_error") and r.headers["allow"] == "POST"


def test_x_api_key_beside_the_bearer_token(tmp_path):
    with tiny_server(tmp_path, api_key="sesame") as live:
        client = anthropic.Anthropic(base_url=live.url, api_key="sesame", max_retries=0, timeout=120)
        assert client.messages.count_tokens(model=live.name, messages=MSG).input_tokens > 0
        ok = {"model": live.name, "max_tokens": 2, "messages": MSG}
        for headers in ({"x-api-key": "sesame"}, {"authorization": "Bearer sesame"}):
            assert httpx.post(live.url + "/v1/messages", json=ok, headers=headers, timeout=60).status_code == 200
        for headers in ({}, {"x-api-key": "sesame2"}, {"authorization": "Bearer nope"}, {"x-api-key": ""}):
            r = httpx.post(live.url + "/v1/messages", json=ok, headers=headers, timeout=60)
            assert "x-api-key" in assert_anthropic_envelope(r, 401, "authentication_error")
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0).messages.create(**ok)
        # the OpenAI routes take the header too, and keep their own envelope
        chat_body = {"model": live.name, "max_tokens": 2, "messages": MSG}
        assert httpx.post(live.url + "/v1/chat/completions", json=chat_body, headers={"x-api-key": "sesame"},
                          timeout=60).status_code == 200
        r = httpx.post(live.url + "/v1/chat/completions", json=chat_body, headers={"x-api-key": "nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def fail_steps(monkeypatch, live, after: int) -> None:
    """The engine's step after `after` good ones fails, as a failing forward would (the engine's fault hook)."""
    steps = {"n": 0}

    def flaky(scheduled):
        steps["n"] += 1
        if steps["n"] == after + 1:
            raise RuntimeError("injected fault at /secret/internal/path.py")

    monkeypatch.setattr(engine_core(live.app), "step_fault_hook", flaky)


def test_a_failed_generation_whole_and_streamed(live, monkeypatch):
    body = {"model": live.name, "max_tokens": 16, "system": SYSTEM, "messages": CONVERSATION, "temperature": 0}
    fail_steps(monkeypatch, live, after=0)
    r = httpx.post(live.url + "/v1/messages", json=body, timeout=60)
    assert "secret" not in assert_anthropic_envelope(r, 500, "api_error")
    fail_steps(monkeypatch, live, after=1)  # the prefill and its first token, then a failing step
    stream = events(live, body)
    assert [d["type"] for _, d in stream][:2] == ["message_start", "ping"]  # the stream had begun
    name, last = stream[-1]
    assert name == "error" and last["type"] == "error" and last["error"]["type"] == "api_error"
    assert "secret" not in json.dumps(last) and "message_stop" not in [d["type"] for _, d in stream]
    monkeypatch.setattr(engine_core(live.app), "step_fault_hook", None)
    with pytest.raises(anthropic.APIStatusError):  # the package raises on the error event
        fail_steps(monkeypatch, live, after=1)
        with live.client.messages.stream(model=live.name, max_tokens=16, system=SYSTEM, messages=CONVERSATION,
                                         **GREEDY) as s:
            s.get_final_message()
    monkeypatch.setattr(engine_core(live.app), "step_fault_hook", None)
    assert live.client.messages.create(model=live.name, max_tokens=2, messages=MSG, **GREEDY).usage.output_tokens == 2
    assert is_idle(idle_stats(live.app))


# ---- thinking ----------------------------------------------------------------------------------------------------

QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
SCRIPT = ["<think>", "w", "h", "y", "</think>", "O", "K"]  # Qwen3's vocabulary: the tags are whole tokens


@pytest.fixture(scope="module")
def reasoning():
    from model.loaders.checkpoint import LoadedModel
    from service.config import Settings
    from service.main import create_app

    tok = scripted_tokenizer(SCRIPT, QWEN3)
    loaded = LoadedModel(scripted_model(tok, "\n", SCRIPT), tok, Path("scripted"), "scripted", 0.0)
    with LiveServer(create_app(Settings(reasoning_parser="qwen3"), loaded=loaded, wait_ready=True)) as live:
        live.name = "scripted"
        live.client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=120)
        yield live


def test_thinking_blocks_whole_and_streamed(reasoning):
    kw = dict(model="scripted", max_tokens=32, messages=[{"role": "user", "content": "Why?"}],
              thinking={"type": "enabled", "budget_tokens": 1024}, **GREEDY)
    m = reasoning.client.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"] and m.stop_reason == "end_turn"
    assert (m.content[0].thinking, m.content[1].text) == ("why", "OK") and m.content[0].signature
    body = {**{k: v for k, v in kw.items() if k != "extra_body"}, "temperature": 0}
    stream = [data for _, data in events(reasoning, body)]
    blocks = [(d["index"], d["content_block"]["type"]) for d in stream if d["type"] == "content_block_start"]
    assert blocks == [(0, "thinking"), (1, "text")]
    deltas = [(d["index"], d["delta"]["type"]) for d in stream if d["type"] == "content_block_delta"]
    kinds = [k for _, k in deltas]
    assert kinds[-1] == "text_delta" and kinds.index("signature_delta") == kinds.index("text_delta") - 1
    assert {i for i, k in deltas if k in ("thinking_delta", "signature_delta")} == {0}
    with reasoning.client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert plain(final.content) == plain(m.content)  # the same signature too
    omitted = reasoning.client.messages.create(**{**kw, "thinking": {**kw["thinking"], "display": "omitted"}})
    assert omitted.content[0].thinking == "" and omitted.content[0].signature == m.content[0].signature


def test_thinking_disabled_reaches_the_template(reasoning):
    messages = [{"role": "user", "content": "Why?"}]
    off = reasoning.client.messages.create(model="scripted", max_tokens=32, messages=messages,
                                           thinking={"type": "disabled"}, **GREEDY)
    # Qwen3's template closes an empty reasoning block in the prompt: the reply is all text, tags and all
    assert [(b.type, b.text) for b in off.content] == [("text", "<think>why</think>OK")]
    reference = chat(reasoning, messages, max_tokens=32, chat_template_kwargs={"enable_thinking": False})
    assert total_input(off.usage) == reference["usage"]["prompt_tokens"] == reasoning.client.messages.count_tokens(
        model="scripted", messages=messages, thinking={"type": "disabled"}).input_tokens
    on = reasoning.client.messages.count_tokens(model="scripted", messages=messages).input_tokens
    assert on < total_input(off.usage)


def test_the_conversation_as_chat_messages():
    """The conversion, field by field, against the chat messages the peers build for it (vLLM's
    entrypoints/anthropic/serving.py, llama.cpp's server_chat_convert_anthropic_to_oai)."""
    from service.api.anthropic.conversion import chat_messages
    from service.api.anthropic.schemas import MessagesRequest

    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "system": [
        {"type": "text", "text": "A. ", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "B."}],
        "messages": [
            {"role": "user", "content": "one"}, {"role": "user", "content": [{"type": "text", "text": "two"}]},
            {"role": "system", "content": " C."},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"}, {"type": "redacted_thinking", "data": "x"},
                {"type": "text", "text": "Calling."},
                {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {"x": 1}},
                {"type": "tool_use", "id": "toolu_b", "name": "g", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_b", "content": [{"type": "text", "text": "B!"}]},
                {"type": "tool_result", "tool_use_id": "toolu_a", "content": "A!", "is_error": True},
                {"type": "text", "text": "So?"}]}]})
    assert chat_messages(req) == [
        {"role": "system", "content": "A. B. C."},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Calling."}], "reasoning_content": "hmm",
         "tool_calls": [{"id": "toolu_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                        {"id": "toolu_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_b", "content": "B!"},
        {"role": "tool", "tool_call_id": "toolu_a", "content": "A!"},
        {"role": "user", "content": [{"type": "text", "text": "So?"}]}]
