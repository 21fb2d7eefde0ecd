"""What the server says over HTTP against HF transformers on the same file: the default model served at float32
(`--quantization none --dtype float32`, said explicitly), `/v1/completions` with `echo` prompt logprobs and
`/v1/chat/completions` with logprobs, greedy. Texts equal, every log-probability (prompt, chosen, alternatives)
within 1e-4.

The prompts' greedy paths have no near-tie: at every step transformers' top-1 leads by more than MIN_MARGIN nats,
asserted below, 500 times the tolerance, so the greedy texts cannot flip between the implementations."""

from __future__ import annotations

import httpx
import pytest
import torch

from live_server import LiveServer
from service.config import Settings
from service.main import create_app
from hf_reference import CHAT, MIN_MARGIN, reference_chat_ids, hf_greedy, top_margins

TOL = 1e-4
PROMPT = "The capital of France is"  # float32 greedy: " Paris.\n\nThe answer is:", no step closer than 0.2 nats


@pytest.fixture(scope="module")
def f32_server(default_gguf):
    """The server loading the default model itself, as `python -m service --quantization none --dtype float32`."""
    settings = Settings(model=str(default_gguf), dtype="float32", device="cpu", quantization="none",
                        kv_cache_bytes=64 << 20, max_num_seqs=4)
    with LiveServer(create_app(settings, wait_ready=True)) as live:
        yield live


@torch.no_grad()
def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(T, V) log-probabilities of the token after each position, one forward over the whole sequence."""
    return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _assert_top(ours: dict[str, float] | list[dict], ref: torch.Tensor, k: int, tok) -> None:
    """Alternatives at one step: the same k token texts (as decoded alone) with log-probabilities within TOL."""
    top = ref.topk(k)
    want = {tok.decode([int(i)]): float(v) for v, i in zip(top.values, top.indices)}
    got = ours if isinstance(ours, dict) else {e["token"]: e["logprob"] for e in ours}
    assert got.keys() == want.keys(), (got, want)
    assert max(abs(got[t] - want[t]) for t in want) <= TOL


def test_completion_with_echo_equals_transformers(f32_server, hf_gguf_model, hf_gguf_tokenizer):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 3, "echo": True}
    r = httpx.post(f32_server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = hf_gguf_tokenizer(PROMPT).input_ids
    assert httpx.post(f32_server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"] == ids
    gen, ref = hf_greedy(hf_gguf_model, ids, 8)
    assert float(top_margins(ref).min()) > MIN_MARGIN
    assert choice["text"] == PROMPT + hf_gguf_tokenizer.decode(gen)
    lp = choice["logprobs"]
    T = len(ids)
    assert lp["tokens"] == [hf_gguf_tokenizer.decode([t]) for t in ids + gen]
    # prompt logprobs: token t given tokens < t, teacher-forced through the whole echoed sequence
    full = _hf_logprobs(hf_gguf_model, ids + gen)  # (T + 8, V)
    want = [float(full[t - 1, tid]) for t, tid in enumerate(ids + gen) if t > 0]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    worst = max(abs(g - w) for g, w in zip(lp["token_logprobs"][1:], want, strict=True))
    assert worst <= TOL, worst
    for t in range(1, T + len(gen)):
        _assert_top(lp["top_logprobs"][t], full[t - 1], 3, hf_gguf_tokenizer)
    # the generated steps agree with the cached greedy run's own distributions too
    assert max(abs(lp["token_logprobs"][T + i] - float(ref[i, g])) for i, g in enumerate(gen)) <= TOL


def test_chat_with_logprobs_equals_transformers(f32_server, hf_gguf_model, hf_gguf_tokenizer, default_model):
    body = {"messages": CHAT, "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    r = httpx.post(f32_server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = reference_chat_ids(default_model.tokenizer, hf_gguf_tokenizer)
    gen, ref = hf_greedy(hf_gguf_model, ids, 16)
    end = gen.index(hf_gguf_tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert float(top_margins(ref[:end + 1]).min()) > MIN_MARGIN
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == hf_gguf_tokenizer.decode(gen[:end])
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content[:end]] == [hf_gguf_tokenizer.decode([t]) for t in gen[:end]]
    assert len(content) in (end, end + 1)  # with or without the closing <|im_end|>
    worst = max(abs(e["logprob"] - float(ref[i, gen[i]])) for i, e in enumerate(content))
    assert worst <= TOL, worst
    for i, e in enumerate(content):
        _assert_top(e["top_logprobs"], ref[i], 3, hf_gguf_tokenizer)
