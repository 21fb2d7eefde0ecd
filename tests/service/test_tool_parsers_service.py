"""Tool calls in each template's own format over HTTP through the official `openai` client: the real Qwen2.5 and
Mistral-7B-Instruct-v0.3 templates show the request's tools to the model, and what a scripted model writes back
(Hermes `<tool_call>` blocks; Mistral's `[TOOL_CALLS]`, a control token) comes back as OpenAI `tool_calls`, whose
ids the template then takes back in the next turn."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import httpx
import pytest

from family_tokenizers import TEMPLATES
from live_server import LiveServer
from scripted import scripted_model, scripted_tokenizer

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HERMES = ["<tool_call>", '\n{"name": "get_weather", "arguments": ', '{"city": "Oslo"}}\n', "</tool_call>"]
MISTRAL = ["[TOOL_CALLS]", ' [{"name": "get_weather", "arguments": {"city": "Oslo"}}]']


@contextlib.contextmanager
def scripted_server(template: str, start: str, script: list[str], **settings):
    from model.loaders.checkpoint import LoadedModel
    from service.config import Settings
    from service.main import create_app

    tok = scripted_tokenizer(HERMES[1:3] + MISTRAL[1:], (TEMPLATES / template).read_text())
    loaded = LoadedModel(scripted_model(tok, start, script), tok, Path("scripted"), "scripted", 0.0)
    with LiveServer(create_app(Settings(**settings), loaded=loaded, wait_ready=True)) as live:
        live.client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        yield live


def _call(live, messages, stream=False):
    r = live.client.chat.completions.create(model="scripted", messages=messages, tools=[WEATHER], max_tokens=48,
                                            temperature=0, stream=stream)
    if not stream:
        return r.choices[0].message, r.choices[0].finish_reason
    chunks = [c for c in r if c.choices]
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    return calls, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("template,start,script,parser,id_length", [
    ("qwen2.5-instruct.jinja", "\n", HERMES, "auto", 29),  # "<|im_start|>assistant\n"
    ("qwen2.5-instruct.jinja", "\n", HERMES, "hermes", 29),
    ("mistral-7b-instruct-v0.3.jinja", "]", MISTRAL, "auto", 9),  # "...[/INST]"
    ("mistral-7b-instruct-v0.3.jinja", "]", MISTRAL, "mistral", 9),
])
def test_the_models_own_format_comes_back_as_tool_calls(template, start, script, parser, id_length):
    with scripted_server(template, start, script, tool_call_parser=parser) as live:
        tok = httpx.post(live.url + "/tokenize", json={"messages": [{"role": "user", "content": "Oslo?"}]}).json()
        rendered = httpx.post(live.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
        assert "get_weather" not in rendered  # no tools asked: none shown
        messages = [{"role": "user", "content": "Weather in Oslo?"}]
        msg, finish = _call(live, messages)
        assert finish == "tool_calls" and msg.content is None and len(msg.tool_calls) == 1
        call = msg.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
        assert len(call.id) == id_length  # Mistral's template takes back only 9 letters and digits
        calls, finish = _call(live, messages, stream=True)
        assert finish == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
        # the next turn: the call and its result go back through the template, which accepts the id
        follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                             {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 7}'}]
        msg, _ = _call(live, follow)
        assert msg.tool_calls is not None  # the scripted model calls again, whatever it is told
        assert httpx.get(live.url + "/health").status_code == 200


def test_a_parser_for_another_format_leaves_the_reply_as_content():
    with scripted_server("qwen2.5-instruct.jinja", "\n", HERMES, tool_call_parser="mistral") as live:
        msg, finish = _call(live, [{"role": "user", "content": "Weather in Oslo?"}])
        assert finish == "stop" and not msg.tool_calls and msg.content == "".join(HERMES)
