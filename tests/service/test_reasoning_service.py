"""Reasoning output over HTTP through the official `openai` client: `--reasoning-parser qwen3` returns the <think>
text apart as `message.reasoning_content`, streams it as `delta.reasoning_content`, splits it where the tags
straddle tokens, and `chat_template_kwargs: {"enable_thinking": false}` reaches Qwen3's real template. The model
is scripted (tests/scripted.py): it writes one known reply, every token ahead by 32 nats."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import pytest

from family_tokenizers import TEMPLATES
from live_server import LiveServer
from scripted import scripted_model, scripted_tokenizer

openai = pytest.importorskip("openai")

# Qwen3's vocabulary: the tags are whole tokens. The straddling script cuts both tags and the end of reasoning and
# the answer's start inside one token.
WHOLE_TAGS = ["<think>", "w", "h", "y", "</think>", "O", "K"]
STRADDLING = ["<th", "ink>\nwh", "y</th", "ink>\n\nO", "K"]
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
MESSAGES = [{"role": "user", "content": "Why?"}]


@contextlib.contextmanager
def scripted_server(script: list[str], **settings):
    from model.loaders.checkpoint import LoadedModel
    from service.config import Settings
    from service.main import create_app

    tok = scripted_tokenizer(STRADDLING, QWEN3)
    model = scripted_model(tok, "\n", script)  # Qwen3's generation prompt ends "<|im_start|>assistant\n"
    loaded = LoadedModel(model, tok, Path("scripted"), "scripted", 0.0)
    with LiveServer(create_app(Settings(**settings), loaded=loaded, wait_ready=True)) as live:
        live.client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        yield live


@pytest.fixture(scope="module")
def whole_tags():
    with scripted_server(WHOLE_TAGS, reasoning_parser="qwen3") as live:
        yield live


@pytest.fixture(scope="module")
def straddling():
    with scripted_server(STRADDLING, reasoning_parser="qwen3") as live:
        yield live


def _stream(client, **kw):
    chunks = list(client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=32, temperature=0,
                                                 stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [getattr(d, "reasoning_content", None) for d in deltas]
    return "".join(r or "" for r in reasoning), "".join(d.content or "" for d in deltas), deltas, chunks


@pytest.mark.parametrize("which,reasoning,content", [("whole_tags", "why", "OK"),
                                                      ("straddling", "\nwhy", "\n\nOK")])
def test_reasoning_apart_whole_and_streamed(request, which, reasoning, content):
    client = request.getfixturevalue(which).client
    r = client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=32, temperature=0,
                                       logprobs=True, top_logprobs=2)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content, r.choices[0].finish_reason) == (reasoning, content, "stop")
    # every token of the reply was far ahead of the next best: no near-tie decided these words
    assert all(x.top_logprobs[0].logprob - x.top_logprobs[1].logprob > 20 for x in r.choices[0].logprobs.content)
    streamed_reasoning, streamed_content, deltas, chunks = _stream(client)
    assert (streamed_reasoning, streamed_content) == (reasoning, content)
    # the reasoning comes first and no delta carries a piece of a tag
    kinds = [("r" if getattr(d, "reasoning_content", None) else "") + ("c" if d.content else "") for d in deltas]
    assert "".join(k for k in kinds if k) == "r" * sum(k == "r" for k in kinds) + "c" * sum(k == "c" for k in kinds)
    assert not any("<" in (getattr(d, "reasoning_content", None) or "") + (d.content or "") for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_include_reasoning_false_and_n2(whole_tags):
    client = whole_tags.client
    r = client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=32, temperature=0,
                                       extra_body={"include_reasoning": False})
    assert r.choices[0].message.content == "OK" and getattr(r.choices[0].message, "reasoning_content", None) is None
    r = client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=32, temperature=0, n=2)
    assert [(c.message.reasoning_content, c.message.content) for c in r.choices] == [("why", "OK")] * 2
    reasoning, content, _, _ = _stream(client, n=1, extra_body={"include_reasoning": False})
    assert (reasoning, content) == ("", "OK")


def test_enable_thinking_false_reaches_the_template(whole_tags):
    """Qwen3's template closes an empty reasoning block in the prompt; the reply is then all content, whatever it
    writes (the scripted model writes its tags regardless)."""
    client = whole_tags.client
    off = {"chat_template_kwargs": {"enable_thinking": False, "a_variable_the_template_does_not_read": 1}}
    on = httpx.post(whole_tags.url + "/tokenize", json={"messages": MESSAGES}).json()
    tokens = httpx.post(whole_tags.url + "/tokenize", json={"messages": MESSAGES, **off}).json()
    text = httpx.post(whole_tags.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and tokens["tokens"][:on["count"]] == on["tokens"]
    r = client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=32, temperature=0, extra_body=off)
    assert r.usage.prompt_tokens == tokens["count"]
    assert (getattr(r.choices[0].message, "reasoning_content", None), r.choices[0].message.content) == \
           (None, "<think>why</think>OK")
    assert _stream(client, extra_body=off)[:2] == ("", "<think>why</think>OK")
    for bad in ({"messages": []}, {"tools": None}, {"not an identifier": 1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=4,
                                           extra_body={"chat_template_kwargs": bad})
        assert e.value.body["param"] is not None and "chat_template_kwargs" in e.value.body["param"]
    assert httpx.get(whole_tags.url + "/health").status_code == 200


def test_without_a_parser_the_reasoning_stays_content():
    with scripted_server(WHOLE_TAGS) as live:
        r = live.client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=32, temperature=0)
        assert r.choices[0].message.content == "<think>why</think>OK"
        assert "reasoning_content" not in r.choices[0].message.model_dump(exclude_none=True)
