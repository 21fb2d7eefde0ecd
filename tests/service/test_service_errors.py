"""Bad requests against a live server on the tiny model: every one gets the OpenAI error envelope with the right
status (never FastAPI's `detail`, a traceback or an internal path), and the server keeps answering afterwards.
Also the API key guard, CORS, the command line's bad values and the 429 of a full waiting queue."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import httpx
import pytest

from live_server import free_port, tiny_live_server
from service.config import Settings

MAX_BODY = 4096
CONTEXT = 512  # the tiny model's max_seq_len


def tiny_server(**settings):
    return tiny_live_server(Settings(**settings), timeout=60)


@pytest.fixture(scope="module")
def limits_server(request):
    with tiny_server(max_body_bytes=MAX_BODY, max_n=4, max_logprobs=5, max_prompts=4) as live:
        with httpx.Client(base_url=live.url, timeout=30) as client:
            live.client = client
            yield live


def assert_envelope(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    text = r.text
    for leak in ("Traceback", "/work/", ".py", "site-packages"):
        assert leak not in text, text
    body = r.json()
    assert set(body) == {"error"}, body  # no FastAPI `detail`, nothing else
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    return err


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

# (id, method, path, json body or raw bytes, expected status, substrings the message must contain, expected param)
CASES = [
    # the body itself
    ("malformed_json", "POST", CMPL, b'{"prompt": "a",', 400, ["JSON"], None),
    ("json_list_not_object", "POST", CMPL, b'[{"prompt": "a"}]', 400, [], None),
    ("json_string_not_object", "POST", CMPL, b'"prompt"', 400, [], None),
    ("empty_body", "POST", CMPL, b"", 400, [], None),
    ("not_utf8", "POST", CMPL, b'{"prompt": "\xff\xfe"}', 400, [], None),
    ("nan_literal", "POST", CMPL, b'{"prompt": "a", "temperature": NaN}', 400, ["temperature"], "temperature"),
    ("infinity_literal", "POST", CMPL, b'{"prompt": "a", "top_p": Infinity}', 400, ["top_p"], "top_p"),
    ("deeply_nested_prompt", "POST", CMPL, ('{"prompt": ' + nested(1500) + "}").encode(), 400, [], None),
    ("deeply_nested_body", "POST", CMPL, nested(2000).encode(), 400, [], None),
    ("nested_over_body_limit", "POST", CMPL, nested(10000).encode(), 413, [str(MAX_BODY)], None),
    ("body_too_large", "POST", CMPL, {"prompt": "a" * (MAX_BODY + 100)}, 413, [str(MAX_BODY)], None),
    ("unknown_field", "POST", CMPL, {"prompt": "a", "foo": 1}, 400, ["foo"], "foo"),
    # prompt
    ("missing_prompt", "POST", CMPL, {"max_tokens": 3}, 400, ["prompt"], "prompt"),
    ("empty_prompt", "POST", CMPL, {"prompt": ""}, 400, ["empty"], "prompt"),
    ("empty_list_prompt", "POST", CMPL, {"prompt": []}, 400, ["empty"], "prompt"),
    ("empty_inner_list_prompt", "POST", CMPL, {"prompt": [[]]}, 400, ["empty"], "prompt"),
    ("number_prompt", "POST", CMPL, {"prompt": 42}, 400, ["prompt"], "prompt"),
    ("null_prompt", "POST", CMPL, {"prompt": None}, 400, ["prompt"], "prompt"),
    ("nested_junk_prompt", "POST", CMPL, {"prompt": [[1, "a"], {"x": 1}]}, 400, ["prompt"], "prompt"),
    ("bool_token_prompt", "POST", CMPL, {"prompt": [True, False]}, 400, ["prompt"], "prompt"),
    ("token_out_of_vocab", "POST", CMPL, {"prompt": [1, 2, 10**6]}, 400, ["258"], "prompt"),
    ("token_over_int32", "POST", CMPL, {"prompt": [1, 2**40]}, 400, ["prompt"], "prompt"),
    ("negative_token", "POST", CMPL, {"prompt": [1, -1]}, 400, ["prompt"], "prompt"),
    ("too_many_prompts", "POST", CMPL, {"prompt": ["a", "b", "c", "d", "e"]}, 400, ["4", "5"], "prompt"),
    # max_tokens / min_tokens
    ("max_tokens_zero", "POST", CMPL, {"prompt": "a", "max_tokens": 0}, 400, ["max_tokens"], "max_tokens"),
    ("max_tokens_negative", "POST", CMPL, {"prompt": "a", "max_tokens": -5}, 400, ["max_tokens"], "max_tokens"),
    ("max_tokens_over_context", "POST", CMPL, {"prompt": "hello", "max_tokens": 600}, 400, ["5", "600", str(CONTEXT)], None),
    ("max_tokens_2_31", "POST", CMPL, {"prompt": "hello", "max_tokens": 2**31}, 400, [str(2**31), str(CONTEXT)], None),
    ("max_tokens_huge_int", "POST", CMPL, {"prompt": "a", "max_tokens": 10**40}, 400, ["max_tokens"], "max_tokens"),
    ("max_tokens_fraction", "POST", CMPL, {"prompt": "a", "max_tokens": 2.5}, 400, ["max_tokens"], "max_tokens"),
    ("max_tokens_string", "POST", CMPL, {"prompt": "a", "max_tokens": "many"}, 400, ["max_tokens"], "max_tokens"),
    ("min_tokens_over_max", "POST", CMPL, {"prompt": "a", "max_tokens": 3, "min_tokens": 5}, 400, ["min_tokens"], None),
    # sampling fields
    ("temperature_negative", "POST", CMPL, {"prompt": "a", "temperature": -1}, 400, ["temperature"], "temperature"),
    ("temperature_too_high", "POST", CMPL, {"prompt": "a", "temperature": 3}, 400, ["temperature"], "temperature"),
    ("top_p_zero", "POST", CMPL, {"prompt": "a", "top_p": 0}, 400, ["top_p"], "top_p"),
    ("top_p_over_one", "POST", CMPL, {"prompt": "a", "top_p": 1.5}, 400, ["top_p"], "top_p"),
    ("top_k_below_minus_one", "POST", CMPL, {"prompt": "a", "top_k": -2}, 400, ["top_k"], "top_k"),
    ("min_p_over_one", "POST", CMPL, {"prompt": "a", "min_p": 2}, 400, ["min_p"], "min_p"),
    ("repetition_penalty_zero", "POST", CMPL, {"prompt": "a", "repetition_penalty": 0}, 400, ["repetition_penalty"],
     "repetition_penalty"),
    ("n_zero", "POST", CMPL, {"prompt": "a", "n": 0}, 400, ["n"], "n"),
    ("n_over_max", "POST", CMPL, {"prompt": "a", "n": 5}, 400, ["4", "5"], "n"),
    ("logprobs_over_max", "POST", CMPL, {"prompt": "a", "logprobs": 6}, 400, ["5", "6"], "logprobs"),
    ("logprobs_negative", "POST", CMPL, {"prompt": "a", "logprobs": -1}, 400, ["logprobs"], "logprobs"),
    ("best_of_2", "POST", CMPL, {"prompt": "a", "best_of": 2}, 400, ["best_of"], "best_of"),
    ("suffix", "POST", CMPL, {"prompt": "a", "suffix": "x"}, 400, ["suffix"], "suffix"),
    ("logit_bias_non_numeric_key", "POST", CMPL, {"prompt": "a", "logit_bias": {"abc": 1}}, 400, ["abc"], "logit_bias"),
    ("logit_bias_superscript_key", "POST", CMPL, {"prompt": "a", "logit_bias": {"\u00b2": 1}}, 400, ["token ids"],
     "logit_bias"),
    ("logit_bias_non_ascii_digit_key", "POST", CMPL, {"prompt": "a", "logit_bias": {"\u0665": 1}}, 400, ["token ids"],
     "logit_bias"),
    ("logit_bias_negative_key", "POST", CMPL, {"prompt": "a", "logit_bias": {"-1": 1}}, 400, ["logit_bias"], "logit_bias"),
    ("logit_bias_value_1000", "POST", CMPL, {"prompt": "a", "logit_bias": {"5": 1000}}, 400, ["1000"], "logit_bias"),
    ("logit_bias_key_out_of_vocab", "POST", CMPL, {"prompt": "a", "logit_bias": {"300": 1}}, 400, ["300"], None),
    ("stop_20_strings", "POST", CMPL, {"prompt": "a", "stop": [f"s{i}" for i in range(20)]}, 400, ["16"], "stop"),
    ("stop_empty_string", "POST", CMPL, {"prompt": "a", "stop": ""}, 400, ["stop"], "stop"),
    ("stop_wrong_type", "POST", CMPL, {"prompt": "a", "stop": 5}, 400, ["stop"], "stop"),
    ("stop_list_wrong_type", "POST", CMPL, {"prompt": "a", "stop": ["a", 5]}, 400, ["stop"], "stop"),
    ("stop_token_ids_out_of_vocab", "POST", CMPL, {"prompt": "a", "stop_token_ids": [999]}, 400, ["stop_token_ids"], None),
    ("presence_penalty_5", "POST", CMPL, {"prompt": "a", "presence_penalty": 5}, 400, ["presence_penalty"], "presence_penalty"),
    ("frequency_penalty_minus_3", "POST", CMPL, {"prompt": "a", "frequency_penalty": -3}, 400, ["frequency_penalty"],
     "frequency_penalty"),
    ("seed_string", "POST", CMPL, {"prompt": "a", "seed": "abc"}, 400, ["seed"], "seed"),
    ("seed_too_large", "POST", CMPL, {"prompt": "a", "seed": 2**64}, 400, ["seed"], "seed"),
    ("stream_options_unknown_field", "POST", CMPL, {"prompt": "a", "stream": True, "stream_options": {"x": 1}}, 400,
     ["stream_options"], None),
    # OpenAI and vLLM refuse stream_options on a request that does not stream
    ("stream_options_without_stream", "POST", CMPL, {"prompt": "a", "stream_options": {"include_usage": True}}, 400,
     ["stream_options", "stream"], "stream_options"),
    ("stream_options_with_stream_false", "POST", CMPL, {"prompt": "a", "stream": False, "stream_options": {}}, 400,
     ["stream_options", "stream"], "stream_options"),
    ("user_too_long", "POST", CMPL, {"prompt": "a", "user": "u" * 300}, 400, ["user"], "user"),
    ("unknown_model", "POST", CMPL, {"prompt": "a", "model": "gpt-17"}, 404, ["gpt-17"], "model"),
    # strict types: what the OpenAPI document says, no coercion from strings or booleans
    ("max_tokens_numeric_string", "POST", CMPL, {"prompt": "a", "max_tokens": "5"}, 400, ["max_tokens"], "max_tokens"),
    ("n_true", "POST", CMPL, {"prompt": "a", "n": True}, 400, ["n"], "n"),
    ("temperature_string", "POST", CMPL, {"prompt": "a", "temperature": "0.5"}, 400, ["temperature"], "temperature"),
    ("stream_string", "POST", CMPL, {"prompt": "a", "stream": "true"}, 400, ["stream"], "stream"),
    ("ignore_eos_one", "POST", CMPL, {"prompt": "a", "ignore_eos": 1}, 400, ["ignore_eos"], "ignore_eos"),
    ("token_id_fraction", "POST", CMPL, {"prompt": [1, 2.5]}, 400, ["prompt"], "prompt"),
    ("stop_string_too_long", "POST", CMPL, {"prompt": "a", "stop": "x" * 300}, 400, ["256"], "stop"),
    ("empty_string_in_prompt_list", "POST", CMPL, {"prompt": ["a", ""]}, 400, ["empty"], "prompt"),
    # routes and methods
    ("unknown_route", "POST", "/v1/nope", {"prompt": "a"}, 404, ["/v1/nope"], None),
    ("unknown_route_get", "GET", "/v2/models", None, 404, ["/v2/models"], None),
    ("wrong_method", "GET", CMPL, None, 405, ["GET"], None),
    ("wrong_method_delete", "DELETE", CHAT, None, 405, ["DELETE"], None),
    # chat
    ("chat_empty_messages", "POST", CHAT, {"messages": []}, 400, ["messages"], "messages"),
    ("chat_missing_messages", "POST", CHAT, {"max_tokens": 3}, 400, ["messages"], "messages"),
    ("chat_bad_role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, ["role"], None),
    ("chat_content_wrong_type", "POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, ["content"],
     "messages.0.content"),
    ("chat_part_unknown_type", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     ["content"], None),
    ("chat_message_not_object", "POST", CHAT, {"messages": ["hi"]}, 400, ["messages"], None),
    ("chat_without_template", "POST", CHAT, {"messages": MSG, "max_tokens": 3}, 400, ["chat template"], "messages"),
    ("chat_unknown_model", "POST", CHAT, {"messages": MSG, "model": "other"}, 404, ["other"], "model"),
    ("chat_completions_field", "POST", CHAT, {"messages": MSG, "prompt": "a"}, 400, ["prompt"], "prompt"),
    # tokenize / detokenize
    ("detokenize_out_of_vocab", "POST", "/detokenize", {"tokens": [1, 999]}, 400, ["258"], "tokens"),
    ("detokenize_negative", "POST", "/detokenize", {"tokens": [-1]}, 400, ["tokens"], None),
    ("detokenize_missing_tokens", "POST", "/detokenize", {}, 400, ["tokens"], "tokens"),
    ("tokenize_neither", "POST", "/tokenize", {}, 400, ["prompt", "messages"], "prompt"),
    ("tokenize_both", "POST", "/tokenize", {"prompt": "a", "messages": MSG}, 400, ["prompt", "messages"], "prompt"),
    ("tokenize_messages_without_template", "POST", "/tokenize", {"messages": MSG}, 400, ["chat template"], "messages"),
    ("tokenize_unknown_model", "POST", "/tokenize", {"prompt": "a", "model": "x"}, 404, [], "model"),
]


@pytest.mark.parametrize("method,path,body,status,needles,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(limits_server, method, path, body, status, needles, param):
    kw = {}
    if isinstance(body, bytes):
        kw = {"content": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kw = {"json": body}
    r = limits_server.client.request(method, path, **kw)
    err = assert_envelope(r, status)
    for needle in needles:
        assert needle in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    if status == 400:
        assert err["type"] == "invalid_request_error"
    if status == 405:
        assert "POST" in r.headers.get("allow", ""), r.headers
    h = limits_server.client.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"


def test_405_allow_lists_every_route_of_the_path(limits_server):
    """/v1/vectors has a POST route and a GET route: a 405 there names both (RFC 9110 15.5.6), not the first only."""
    r = limits_server.client.request("PUT", "/v1/vectors")
    assert_envelope(r, 405)
    assert {"GET", "POST"} <= {m.strip() for m in r.headers["allow"].split(",")}, r.headers
    r = limits_server.client.request("PUT", "/v1/vectors/joy")
    assert_envelope(r, 405)
    assert {"GET", "DELETE"} <= {m.strip() for m in r.headers["allow"].split(",")}, r.headers


def test_at_least_25_cases():
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


def test_chunked_body_over_the_limit_is_413(limits_server):
    """No Content-Length (chunked upload): the guard counts the bytes as they arrive."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"}'

    r = limits_server.client.post(CMPL, content=chunks(), headers={"content-type": "application/json"})
    assert_envelope(r, 413)
    assert limits_server.client.get("/health").status_code == 200


def test_a_good_request_still_works_after_the_bad_ones(limits_server):
    r = limits_server.client.post(CMPL, json={"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("path,body", [
    (CMPL, {"prompt": "\ud800"}),
    (CMPL, {"prompt": ["ok", "\udfff"]}),
    ("/tokenize", {"prompt": "\ud800"}),
])
def test_lone_surrogate_is_a_client_error(limits_server, path, body):
    # JSON allows the escape "\ud800"; Python's json decodes it to a lone surrogate no tokenizer can take.
    with httpx.Client(base_url=limits_server.url, timeout=30) as c:  # own connection: uvicorn closes it after a 500
        r = c.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        status = r.status_code
        assert_envelope(r, status)  # an envelope either way (500 included)
    assert limits_server.client.get("/health").status_code == 200
    assert status == 400


def test_streamed_request_errors_before_streaming_are_envelopes(limits_server):
    """A stream that cannot start answers a plain JSON envelope with the status, not an event stream."""
    r = limits_server.client.post(CMPL, json={"prompt": "hello", "max_tokens": 600, "stream": True})
    err = assert_envelope(r, 400)
    assert "600" in err["message"]


# ---- API key ------------------------------------------------------------------------------------------------

KEY = "sekret"


@pytest.fixture(scope="module")
def keyed():
    with tiny_server(api_key=KEY) as live:
        yield live


def _no_key_leak(r: httpx.Response) -> None:
    assert KEY not in r.text and KEY not in str(r.headers)


def test_api_key(keyed):
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        body = {"prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": "Bearer"}, {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"}):
            r = c.post(CMPL, json=body, headers=headers)
            err = assert_envelope(r, 401)
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
            _no_key_leak(r)
        for path in ("/v1/models", "/tokenize", "/nope"):  # every route, even unknown ones, wants the key
            r = c.request("GET" if path != "/tokenize" else "POST", path, json={"prompt": "a"} if path == "/tokenize" else None)
            assert_envelope(r, 401)
            _no_key_leak(r)
        good = {"Authorization": f"Bearer {KEY}"}
        r = c.post(CMPL, json=body, headers=good)
        assert r.status_code == 200, r.text
        _no_key_leak(r)
        r = c.post(CMPL, json=body, headers={"authorization": f"bearer {KEY}"})  # scheme is case-insensitive
        assert r.status_code == 200, r.text
        assert c.get("/v1/models", headers=good).status_code == 200
        # an authenticated bad request is still a 400 envelope (the key check comes first, then validation)
        r = c.post(CMPL, json={"prompt": ""}, headers=good)
        assert_envelope(r, 400)
        _no_key_leak(r)
        # /health and /metrics stay open
        r = c.get("/health")
        assert r.status_code == 200
        _no_key_leak(r)
        r = c.get("/metrics")
        assert r.status_code == 200 and "llamascope_requests_total" in r.text
        _no_key_leak(r)
        # and so does the viewer's page with every script it loads (they hold no data; the page sends the key)
        page = c.get("/inspect/ui")
        assert page.status_code == 200
        for src in re.findall(r'<script src="([^"]+)"', page.text):
            assert c.get(src).status_code == 200, src


@pytest.mark.parametrize("depth", [10_000, 100_000])
def test_deep_nesting_under_the_default_body_limit(keyed, depth):
    """The keyed server keeps the default 1 MiB body limit, so the JSON parser itself meets the nesting."""
    auth = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        for body in (nested(depth), '{"prompt": ' + nested(depth) + "}"):
            r = c.post(CMPL, content=body.encode(), headers=auth)
            assert_envelope(r, 400)
        assert c.get("/health").status_code == 200


def test_metrics_require_key():
    with tiny_server(api_key=KEY, metrics_require_key=True) as live, httpx.Client(base_url=live.url, timeout=30) as c:
        r = c.get("/metrics")
        assert_envelope(r, 401)
        _no_key_leak(r)
        r = c.get("/metrics", headers={"Authorization": "Bearer nope"})
        assert_envelope(r, 401)
        r = c.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and "llamascope_requests_total" in r.text
        assert c.get("/health").status_code == 200


# ---- CORS (--allowed-origins) and the command line -----------------------------------------------------------

APP_ORIGIN = "https://app.example"


def _preflight(c: httpx.Client, origin: str) -> httpx.Response:
    return c.options(CMPL, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                    "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_is_off_by_default(limits_server):
    r = _preflight(limits_server.client, APP_ORIGIN)
    assert_envelope(r, 405)
    assert "access-control-allow-origin" not in r.headers
    r = limits_server.client.get("/v1/models", headers={"Origin": APP_ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_allowed_origins_let_a_browser_app_call_the_api(monkeypatch):
    """A page on another origin: its preflight (no API key: browsers never send one) is answered before the key
    check, and the real request and its refusals carry the header the page needs to read them."""
    monkeypatch.setenv("LLAMASCOPE_ALLOWED_ORIGINS", f"{APP_ORIGIN}, https://other.example")
    with tiny_server(api_key=KEY) as live, httpx.Client(base_url=live.url, timeout=30) as c:
        r = _preflight(c, APP_ORIGIN)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        body = {"prompt": "hi", "max_tokens": 2}
        r = c.post(CMPL, json=body, headers={"Origin": APP_ORIGIN, "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
        r = c.post(CMPL, json=body, headers={"Origin": APP_ORIGIN})
        assert_envelope(r, 401)
        assert r.headers["access-control-allow-origin"] == APP_ORIGIN
        # an origin not on the list gets no grant, so its page cannot read the answer
        assert _preflight(c, "https://evil.example").status_code == 400
        r = c.get("/health", headers={"Origin": "https://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("argv,env,needle", [
    (["--port", "abc"], {}, "--port 'abc': Input should be a valid integer"),
    (["--max-num-seqs", "1.5"], {}, "--max-num-seqs '1.5'"),
    (["--quantization", "int3"], {}, "--quantization: invalid choice: 'int3'"),
    ([], {"LLAMASCOPE_PORT": "eighty"}, "LLAMASCOPE_PORT 'eighty'"),
    (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
    (["--chat-template", "/no/such.jinja"], {}, "--chat-template '/no/such.jinja': Value error, no such file"),
    (["--chat-template", "{% for m in %}"], {}, "the chat template is not valid Jinja"),
    (["--reasoning-parser", "granite"], {}, "--reasoning-parser: invalid choice: 'granite'"),
    (["--tool-call-parser", "pythonic"], {}, "--tool-call-parser: invalid choice: 'pythonic'"),
])
def test_a_bad_command_line_value_is_one_line_and_exit_2(argv, env, needle):
    """Before anything loads: `python -m service --port abc` says what is wrong in one line, no traceback."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LLAMASCOPE_")}, **env}
    r = subprocess.run([sys.executable, "-m", "service", *argv], capture_output=True, text=True, env=env, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr
    assert lines[0].startswith("python -m service: error: ") and "Traceback" not in r.stderr


# ---- queue full ---------------------------------------------------------------------------------------------

def test_queue_full_is_429_with_retry_after():
    with tiny_server(max_waiting=1, max_num_seqs=1) as live:
        body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "temperature": 0}

        async def fire():
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as c:
                return await asyncio.gather(*(c.post(CMPL, json=body) for _ in range(6)))

        responses = asyncio.run(fire())
        statuses = sorted(r.status_code for r in responses)
        busy = [r for r in responses if r.status_code == 429]
        assert busy, statuses
        for r in busy:
            err = assert_envelope(r, 429)
            assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
            assert r.headers.get("retry-after", "").isdigit(), r.headers
        ok = [r for r in responses if r.status_code != 429]
        assert ok and all(r.status_code == 200 for r in ok), statuses
        assert all(r.json()["usage"]["completion_tokens"] == 200 for r in ok)
        with httpx.Client(base_url=live.url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            assert c.post(CMPL, json={**body, "max_tokens": 2}).status_code == 200  # the queue drained
            text = c.get("/metrics").text
        assert f'llamascope_requests_total{{endpoint="completions",status="429"}} {float(len(busy))}' in text


def test_integer_valued_numbers_are_integers(limits_server):
    """JSON Schema (and so the OpenAPI document) counts 3.0 as an integer: accepted, and the same as 3."""
    a = limits_server.client.post(CMPL, json={"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    b = limits_server.client.post(CMPL, json={"prompt": [1.0, 2.0, 3.0], "max_tokens": 3.0, "temperature": 0, "ignore_eos": True})
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]


def test_top_p_below_float32_keeps_the_top_token(limits_server):
    """top_p = 1e-300 is > 0, so valid, but rounds to 0 in float32: it must act like any tiny p (greedy), not crash
    the step (schemathesis found this one)."""
    body = {"prompt": "hello", "max_tokens": 6, "ignore_eos": True, "seed": 3}
    greedy = limits_server.client.post(CMPL, json={**body, "temperature": 0})
    tiny_p = limits_server.client.post(CMPL, json={**body, "top_p": 1e-300})
    assert greedy.status_code == tiny_p.status_code == 200, tiny_p.text
    assert tiny_p.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_openapi_declares_errors_as_the_envelope(limits_server):
    doc = limits_server.client.get("/openapi.json").json()
    assert doc["components"]["schemas"]["ErrorResponse"]["properties"]["error"]["required"] == ["message", "type", "param", "code"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (path, method)
            assert "500" in op["responses"], (path, method)
    post = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "404", "413", "429", "500", "503"} <= set(post)
    assert "text/event-stream" in post["200"]["content"]
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["n"]["maximum"] == 4  # the deployment's --max-n
    ids = [b for b in props["prompt"]["anyOf"] if b.get("items", {}).get("type") == "integer"][0]
    assert ids["items"]["maximum"] == 257  # the tiny model's vocabulary, 258 tokens


def test_the_key_never_reaches_logs_errors_or_settings(caplog):
    """Every record any logger writes while keyed requests (right, wrong, near-miss, in odd places) go through,
    every response, and the settings' own text: none holds the key."""
    secret = "s3cr3t-key-0123456789"
    with caplog.at_level("DEBUG"):
        with tiny_server(api_key=secret) as live, httpx.Client(base_url=live.url, timeout=30) as c:
            responses = [
                c.post(CMPL, json={"prompt": "hi", "max_tokens": 2}, headers={"Authorization": f"Bearer {secret}"}),
                c.post(CMPL, json={"prompt": "hi"}, headers={"Authorization": f"Bearer {secret}x"}),
                c.post(CMPL, json={"prompt": "hi"}, headers={"Authorization": f"Basic {secret}"}),
                c.post(CMPL, json={"prompt": secret, "max_tokens": 0}, headers={"Authorization": f"Bearer {secret}"}),
                c.get("/v1/models", headers={"Authorization": secret}),
                c.get("/nope", headers={"Authorization": f"Bearer {secret}"}),
                c.get("/openapi.json"),
            ]
    assert [r.status_code for r in responses] == [200, 401, 401, 400, 401, 404, 401]
    for r in responses:
        assert secret not in r.text and secret not in str(r.headers)
    server_side = [rec for rec in caplog.records if not rec.name.startswith(("httpx", "httpcore"))]  # not the client's
    assert server_side and not [rec for rec in server_side if secret in rec.getMessage()]
    s = Settings(api_key=secret)
    assert secret not in repr(s) and secret not in str(s) and secret not in s.model_dump_json()


# ---- start-up ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [["-m", "service", "--model"], ["-m", "service.cli", "serve"]],
                         ids=["python -m service", "llamascope serve"])
def test_a_model_that_fails_to_load_ends_the_process_with_the_reason(tmp_path, command):
    """A file that is no GGUF fails on the loading thread, which starts before the web stack is imported
    (service/main.py): the process exits 1 within seconds, its last stderr line the reason (as `vllm serve` and
    `llama-server` do), instead of serving 503s forever."""
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMASCOPE_")}
    port = str(free_port())
    r = subprocess.run([sys.executable, *command, str(bad), "--port", port], capture_output=True, text=True, env=env,
                       timeout=120)
    last = r.stderr.strip().splitlines()[-1]
    prog = "llamascope serve" if "service.cli" in command else "python -m service"
    assert r.returncode == 1, r.stderr[-3000:]
    assert last.startswith(f"{prog}: error: model failed to load: ") and "broken.gguf" in last, r.stderr[-3000:]
    assert "Traceback" not in r.stderr


def test_serve_returns_1_when_the_engine_died_before_the_server_ran():
    from service.main import create_app
    from service.common.shutdown import serve

    settings = Settings()
    app = create_app(settings)
    app.state.server.fatal_error = "the engine stopped"  # (what `_engine_died` sets from the engine thread)
    assert serve(app, settings) == 1
