"""The real chat templates of Qwen2.5, Qwen3, Mistral-7B-Instruct-v0.3 and Phi-3.5-mini (tests/data/chat_templates)
rendered by ours and by transformers' apply_chat_template on the same tokenizer: plain turns, system prompts, tools,
tool calls and their results, Qwen3's thinking switch and its reasoning in the history; the templates' own errors."""

from __future__ import annotations

import pytest

from family_tokenizers import TEMPLATES, write_qwen_tokenizer, write_spm_family
from model.text.chat_template import ChatTemplate, read_template_option
from model.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. \"Oslo\""},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "What time it is.",
                                          "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "abcDEF123", "type": "function",  # 9 letters and digits: the only ids Mistral's template takes
        "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}}

PLAIN = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 日本語 and emoji 😀.\nTwo lines."}],
    [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "  spaced  "}],
]
TOOL_TURNS = [
    [{"role": "user", "content": "Weather in Oslo?"}],
    [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Oslo?"}],
    [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": CALL["id"], "name": "get_weather", "content": '{"temperature": 7}'}],
    [{"role": "user", "content": "Weather in Oslo and the time?"},
     {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, {**CALL, "id": "xyz987XYZ", "function": {
         "name": "get_time", "arguments": {}}}]},
     {"role": "tool", "tool_call_id": CALL["id"], "content": '{"temperature": 7}'},
     {"role": "tool", "tool_call_id": "xyz987XYZ", "content": "12:00"},
     {"role": "assistant", "content": "7 degrees at noon."}, {"role": "user", "content": "Thanks"}],
]
THINKING = [
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
     {"role": "user", "content": "3+3?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4"},
     {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6", "reasoning_content": "Three."}],
]


def _dir(tmp_path_factory, template: str):
    d = tmp_path_factory.mktemp(template.split(".jinja")[0])
    if template.startswith("qwen"):
        write_qwen_tokenizer(d, template)
    else:
        write_spm_family(d, "mistral" if template.startswith("mistral") else "phi3")
    return d


def _pair(tmp_path_factory, template: str):
    d = _dir(tmp_path_factory, template)
    ours, hf = Tokenizer.from_hf_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    assert ours.chat_template == hf.chat_template == (TEMPLATES / template).read_text()
    return template, ours, hf


@pytest.fixture(scope="module", params=sorted(p.name for p in TEMPLATES.glob("*.jinja")))
def pair(request, tmp_path_factory):
    return _pair(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _pair(tmp_path_factory, "qwen3.jinja")


def _both(ours, hf, conv, add_generation_prompt, **kw):
    expected = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)
    assert ours.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, **kw) == expected
    return expected


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_plain_turns(pair, add_generation_prompt):
    _, ours, hf = pair
    for conv in PLAIN:
        _both(ours, hf, conv, add_generation_prompt)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tools_and_tool_calls(pair, add_generation_prompt):
    name, ours, hf = pair
    if name.startswith("phi"):  # Phi-3.5's template has no tool format: tools are not shown, tool turns not written
        assert _both(ours, hf, TOOL_TURNS[0], add_generation_prompt, tools=[WEATHER]) == \
               _both(ours, hf, TOOL_TURNS[0], add_generation_prompt)
        return
    for conv in TOOL_TURNS:
        for tools in ([WEATHER], [WEATHER, CLOCK]):
            text = _both(ours, hf, conv, add_generation_prompt, tools=tools)
            if not (name.startswith("mistral") and conv[-1]["role"] != "user"):  # Mistral lists them at the last user turn
                assert "get_weather" in text and "The weather in a city" in text
    rendered = _both(ours, hf, TOOL_TURNS[2], add_generation_prompt, tools=[WEATHER])
    marker = "[TOOL_CALLS]" if name.startswith("mistral") else "<tool_call>"
    assert marker in rendered and '"city": "Oslo"' in rendered


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_qwen3_thinking_switch(qwen3, enable_thinking):
    _, ours, hf = qwen3
    kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    for conv in PLAIN + THINKING:
        text = _both(ours, hf, conv, True, **kw)
        assert text.endswith("<think>\n\n</think>\n\n") == (enable_thinking is False)
    history = _both(ours, hf, THINKING[1], False, **kw)
    assert "Two and two." not in history  # reasoning before the last user turn is dropped ...
    assert "<think>\nThree.\n</think>\n\n6" in history  # ... the reasoning after it is kept
    assert ChatTemplate(ours.chat_template).accepted_kwargs({"enable_thinking": False, "other": 1}) == \
        {"enable_thinking": False}


def test_mistral_template_errors(tmp_path_factory):
    """Mistral's template refuses roles out of turn and tool call ids of other than 9 characters, in both."""
    _, ours, hf = _pair(tmp_path_factory, "mistral-7b-instruct-v0.3.jinja")
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    long_id = [TOOL_TURNS[2][0], {**TOOL_TURNS[2][1], "tool_calls": [{**CALL, "id": "call_1234567890"}]},
               {**TOOL_TURNS[2][2], "tool_call_id": "call_1234567890"}]
    for conv, words in ((bad, "must alternate"), (long_id, "length 9")):
        with pytest.raises(Exception, match=words):
            hf.apply_chat_template(conv, tokenize=False, tools=[WEATHER])
        with pytest.raises(Exception, match=words):
            ours.apply_chat_template(conv, tools=[WEATHER])


def test_chat_template_option(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert read_template_option(str(f)) == f.read_text()
    assert read_template_option("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="no such file"):
        read_template_option(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not valid Jinja"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ValueError, match="may not set messages, tools"):
        ChatTemplate("{{ x }}").accepted_kwargs({"messages": [], "tools": [], "x": 1})


def test_a_template_jinja_cannot_read_fails_the_chat_not_the_load():
    from benchmarks.tiny_checkpoint import byte_backend

    tok = Tokenizer(byte_backend(), bos_id=None, eos_id=None, chat_template="{% for m in messages %}")
    assert tok.chat_template == "{% for m in messages %}" and tok.encode("hi") == [104, 105]
    with pytest.raises(ValueError, match="not valid Jinja"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    tok.chat_template = "{{ messages[0].content }}"  # --chat-template replaces it
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
