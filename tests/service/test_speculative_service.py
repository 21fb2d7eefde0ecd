"""Speculative decoding over HTTP (--speculative-config): a server drafting with its own checkpoint at int8
(`"model": "self"`) answers every request exactly as one without speculation (text, logprobs, finish reasons,
streamed or not, through the `openai` client), says its configuration in /v1/models, counts drafts in /metrics,
and refuses a bad configuration at start and a bad per-request K with a 400."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import ValidationError

from hf_checkpoints import save_tiny_checkpoint, save_tiny_llama
from live_server import LiveServer
from model import kernels
from service.config import Settings
from service.main import create_app
from tiny import byte_tokenizer

pytestmark = pytest.mark.skipif(kernels.native() is None, reason=f"native kernels: {kernels.status()}")

SELF_INT8 = json.dumps({"method": "draft_model", "model": "self", "quantization": "int8", "num_speculative_tokens": 4,
                        "disable_by_batch_size": 16})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "tiny")


@pytest.fixture(scope="module")
def servers(checkpoint):
    plain = create_app(Settings(model=str(checkpoint)), wait_ready=True)
    spec = create_app(Settings(model=str(checkpoint), speculative_config=SELF_INT8), wait_ready=True)
    with LiveServer(plain) as a, LiveServer(spec) as b:
        yield a, b


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


PROMPTS = ["abcabcabcab", "the cat sat on the mat; the cat", "0123456789012345", "zyx wvu zyx"]


def _answers(server) -> list:
    c = _client(server)
    out = []
    for i, p in enumerate(PROMPTS):
        r = c.completions.create(model="tiny", prompt=p, max_tokens=40, temperature=0, logprobs=2,
                                 stop=["q"] if i == 1 else None)
        ch = r.choices[0]
        out.append((ch.text, ch.finish_reason, ch.logprobs.token_logprobs, ch.logprobs.top_logprobs))
        seeded = c.completions.create(model="tiny", prompt=p, max_tokens=30, temperature=0.9, seed=7, n=2)
        out.append([(x.text, x.finish_reason) for x in seeded.choices])
        stream = c.completions.create(model="tiny", prompt=p[::-1], max_tokens=30, temperature=0, stream=True,
                                      logprobs=1, stop=["e"])
        chunks = [(ch.text, ch.finish_reason, ch.logprobs and ch.logprobs.token_logprobs)
                  for e in stream for ch in e.choices]
        out.append(("".join(x or "" for x, _, _ in chunks), [f for _, f, _ in chunks if f],
                    [lp for _, _, lps in chunks for lp in (lps or [])]))
    return out


def test_speculation_over_http_changes_no_answer(servers):
    plain, spec = servers
    assert _answers(spec) == _answers(plain)
    metrics = httpx.get(spec.url + "/metrics").text
    accepted = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("llamascope_spec_decode_num_accepted_tokens_total"))
    assert accepted > 20
    assert 'llamascope_spec_decode_num_accepted_tokens_per_pos_total{position="3"}' in metrics
    assert "llamascope_spec_decode_num_drafts_total 0.0" not in metrics


def test_models_says_the_configuration(servers):
    plain, spec = servers
    assert httpx.get(plain.url + "/v1/models").json()["data"][0]["speculative_config"] is None
    got = httpx.get(spec.url + "/v1/models").json()["data"][0]["speculative_config"]
    assert got == {"method": "draft_model", "model": "self", "quantization": "int8", "num_speculative_tokens": 4,
                   "disable_by_batch_size": 16}


def test_per_request_k(servers):
    plain, spec = servers
    for server, k, message in ((spec, 5, "at most 4"), (plain, 2, "not configured")):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 3, "num_speculative_tokens": k})
        assert r.status_code == 400 and message in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "num_speculative_tokens"
    body = {"prompt": "abcabcabc", "max_tokens": 20, "temperature": 0}
    texts = {k: httpx.post(spec.url + "/v1/completions", json={**body, "num_speculative_tokens": k}).json()["choices"][0]["text"]
             for k in (0, 1, 4)}
    texts["plain"] = httpx.post(plain.url + "/v1/completions", json=body).json()["choices"][0]["text"]
    assert len(set(texts.values())) == 1, texts


def test_bad_configurations_stop_the_server(checkpoint, tmp_path):
    with pytest.raises(ValidationError, match="unknown method 'eagle'"):
        Settings(speculative_config='{"method": "eagle", "num_speculative_tokens": 3}')
    # a draft model of another vocabulary: the server does not start, and /health says why
    other = tmp_path / "other"
    save_tiny_llama(other, vocab_size=300)
    byte_tokenizer()._tk.save(str(other / "tokenizer.json"))
    config = json.dumps({"method": "draft_model", "model": str(other), "num_speculative_tokens": 2})
    state = create_app(Settings(model=str(checkpoint), speculative_config=config)).state.server
    state.start()  # what the app's start-up runs
    assert state.engine is None and "another tokenizer or vocabulary" in state.load_error
