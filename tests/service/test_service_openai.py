"""The official `openai` client against a live server: every call parses, and greedy output over HTTP equals
the engine's greedy output on the same prompt."""

from __future__ import annotations

import pytest

from model.generate import generate

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _greedy_text(default_model, ids, n):
    tok = default_model.tokenizer
    out = list(generate(default_model.model, ids, n, tok.stop_ids))
    return tok.decode([t for t in out if t not in tok.stop_ids], skip_special_tokens=True), out


def test_completion_equals_engine_greedy(client, name, default_model):
    prompt = "The history of the Roman Empire begins"
    r = client.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0)
    text, ids = _greedy_text(default_model, default_model.tokenizer.encode(prompt), 24)
    assert r.choices[0].text == text
    assert r.object == "text_completion" and r.model == name
    assert r.usage.prompt_tokens == len(default_model.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == len(ids) and r.usage.total_tokens == r.usage.prompt_tokens + len(ids)


def test_streamed_completion_concatenates_to_the_same_text(client, name, default_model):
    prompt = "def fibonacci(n):\n    "
    text, _ = _greedy_text(default_model, default_model.tokenizer.encode(prompt), 20)
    chunks = list(client.completions.create(model=name, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_and_streamed_chat(client, name, default_model):
    messages = [{"role": "user", "content": "What is 2+2?"}]  # float32 greedy: no near-tie (test_default_model.py)
    r = client.chat.completions.create(model=name, messages=messages, max_tokens=20, temperature=0)
    tok = default_model.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages), add_bos=False)
    text, _ = _greedy_text(default_model, ids, 20)
    assert r.choices[0].message.content == text
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=20, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n2_logprobs_and_echo(client, name, default_model):
    r = client.completions.create(model=name, prompt="Once upon a time", max_tokens=8, n=2, temperature=0.9, seed=3)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text != r.choices[1].text
    assert r.usage.completion_tokens == 16
    r = client.completions.create(model=name, prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=3, echo=True)
    lp = r.choices[0].logprobs
    n_prompt = len(default_model.tokenizer.encode("Once upon a time"))
    assert r.choices[0].text.startswith("Once upon a time")
    assert len(lp.tokens) == n_prompt + 5 and lp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) == 3 for t in lp.top_logprobs[n_prompt:])
    c = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and all(len(x.top_logprobs) == 2 for x in content)
    assert all(x.logprob == max(t.logprob for t in x.top_logprobs) for x in content)  # greedy picks the top token


def test_prompt_forms_and_models_and_tokenize(client, name, server, default_model):
    import httpx

    ids = default_model.tokenizer.encode("Hello there")
    by_ids = client.completions.create(model=name, prompt=ids, max_tokens=4, temperature=0)
    r = client.completions.create(model=name, prompt=["Hello there", "Good morning"], max_tokens=4, temperature=0)
    assert len(r.choices) == 2 and r.choices[0].text == by_ids.choices[0].text != r.choices[1].text
    r = client.completions.create(model=name, prompt=[ids, ids], max_tokens=4, temperature=0)
    assert [c.text for c in r.choices] == [by_ids.choices[0].text] * 2
    assert [m.id for m in client.models.list().data] == [name]
    t = httpx.post(server.url + "/tokenize", json={"prompt": "Hello there"}).json()
    assert t["tokens"] == ids
    d = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()
    assert d["prompt"] == "Hello there"


def test_stream_events_survive_clients_that_split_lines_like_str_splitlines():
    """httpx's iter_lines (a common way to read SSE) also ends lines at U+0085, U+2028 and U+2029, which a token may
    decode to; the server escapes them, so every event still arrives whole and parses to the text sent."""
    import json

    import httpx

    from service.api.openai.format import DONE, sse

    text = "a\x85b\u2028c\u2029d\x1ce\r\nf"
    body = sse({"choices": [{"text": text}]}) + DONE
    lines = httpx._decoders.LineDecoder().decode(body)
    events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[0])["choices"][0]["text"] == text
