"""Each family served over HTTP as a user serves it (`--model DIR` of a checkpoint transformers saved, and the same
checkpoint as llama.cpp's converter writes a GGUF, float32): `/v1/completions` with `echo` gives a log-probability at
every prompt position within 1e-4 of transformers' forward and the same 32 greedy tokens (a path with no near-tie:
every step's top-1 leads by MIN_MARGIN, asserted first); a checkpoint of another architecture is refused at start."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from gguf_writer import write_tiny_gguf
from hf_checkpoints import FAMILIES, save_tiny_family_checkpoint
from hf_reference import hf_greedy, top_margins
from live_server import LiveServer
from service.config import Settings
from service.main import create_app
from tiny import byte_tokenizer

TOL = 1e-4
MIN_MARGIN = 0.01  # nats: 100 x the tolerance, so no greedy step can flip between the implementations
PROMPT = "The quick brown fox jumps over the lazy dog."  # 44 byte tokens: past Mistral's window, Phi-3's 16
# the checkpoint seed per family whose 32-token greedy path after PROMPT has no step closer than MIN_MARGIN (a
# random model's path often has one somewhere; `_check` asserts the margin before it compares tokens)
SEEDS = {"qwen2": 0, "qwen3": 3, "mistral": 2, "phi3": 0, "granite": 3, "olmo2": 3}
# Phi-3's served context: room for the prompt and 32 tokens (its tests' 64 would refuse them), past the original 16
OVERRIDES = {"phi3": dict(max_position_embeddings=128)}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(family, the HF model, its directory, its GGUF as the converter writes it)."""
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp(request.param)
    path = save_tiny_family_checkpoint(d / "hf", request.param, seed=SEEDS[request.param],
                                       **OVERRIDES.get(request.param, {}))
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    write_tiny_gguf(d / "m.gguf", hf, tokenizer=True)
    if request.param == "mistral":  # and a file that keeps the window (the converter drops it)
        write_tiny_gguf(d / "windowed.gguf", hf, tokenizer=True, sliding_window_key=True)
    return request.param, hf, path, d


def _complete(path) -> dict:
    settings = Settings(model=str(path), dtype="float32", quantization="none", kv_cache_bytes=16 << 20, max_num_seqs=4)
    with LiveServer(create_app(settings, wait_ready=True)) as live:
        body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "logprobs": 1, "echo": True}
        r = httpx.post(live.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]


def _check(choice: dict, hf) -> None:
    tok = byte_tokenizer()
    ids = tok.encode(PROMPT, add_bos=False)
    gen, ref = hf_greedy(hf, ids, 32)
    assert float(top_margins(ref).min()) > MIN_MARGIN
    assert choice["text"] == PROMPT + tok.decode(gen)
    with torch.no_grad():
        full = hf(torch.tensor([ids + gen])).logits[0].float().log_softmax(-1)  # (T + 32, V)
    want = [float(full[t - 1, tid]) for t, tid in enumerate(ids + gen) if t > 0]
    got = choice["logprobs"]["token_logprobs"]
    assert got[0] is None and len(got) == len(ids) + 32
    worst = max(abs(g - w) for g, w in zip(got[1:], want, strict=True))
    assert worst <= TOL, worst


def test_served_from_its_folder_equals_transformers(family):
    name, hf, path, _ = family
    _check(_complete(path), hf)


def test_served_from_its_gguf_equals_transformers(family):
    name, hf, _, d = family
    if name == "mistral":
        _check(_complete(d / "windowed.gguf"), hf)
        hf.config.sliding_window = None  # the converter's file: full attention, as llama.cpp runs it
        try:
            _check(_complete(d / "m.gguf"), hf)
        finally:
            hf.config.sliding_window = 8
        return
    _check(_complete(d / "m.gguf"), hf)


def test_an_unsupported_architecture_is_refused_at_start(tmp_path, caplog):
    """`--model DIR` of a gemma2 checkpoint: the server does not serve it; the start-up logs one line naming the
    architectures served, and /health's 503 says it."""
    path = save_tiny_family_checkpoint(tmp_path / "ck", "qwen2")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="gemma2", architectures=["Gemma2ForCausalLM"])
    (path / "config.json").write_text(json.dumps(cfg))
    state = create_app(Settings(model=str(path))).state.server
    with caplog.at_level("ERROR", logger="llamascope.service"):
        state.start()  # what the app's start-up runs
    assert state.engine is None and "\n" not in state.load_error
    assert "gemma2" in state.load_error
    assert all(f in state.load_error for f in ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "olmo2"))
    assert [r.getMessage() for r in caplog.records] == [f"model failed to load: {state.load_error}"]
