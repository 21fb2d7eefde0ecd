"""`--tensor-parallel-size 2` end to end: the service (this process is rank 0, one gloo worker process) answers
/v1/completions and /inspect as the TP=1 service does on the same tiny random checkpoint."""

from __future__ import annotations

import httpx
import pytest
import torch

from live_server import LiveServer
from service.config import Settings, parse_cli
from service.main import create_app
from hf_checkpoints import save_tiny_checkpoint


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(TP=1, TP=2) services on one checkpoint, each serving a PEFT LoRA adapter on every projection as "ad"."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("tpsvc")
    path = save_tiny_checkpoint(root / "tiny", num_key_value_heads=2)
    torch.manual_seed(3)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft.get_peft_model(LlamaForCausalLM.from_pretrained(path), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)).save_pretrained(root / "ad")
    common = dict(model=str(path), kv_cache_bytes=1 << 20, max_num_seqs=4, lora_modules=[f"ad={root / 'ad'}"])
    threads = torch.get_num_threads()  # a TP service on CPU splits the cores among its ranks: restored after
    try:
        with LiveServer(create_app(Settings(**common), wait_ready=True)) as one, \
                LiveServer(create_app(Settings(**common, tensor_parallel_size=2), wait_ready=True)) as two:
            yield one, two
    finally:
        torch.set_num_threads(threads)
        # The last test kills the workers as a fatal step does, leaving the process group to the process's exit
        # (TPModel.abort): left here, a later module's TP group in this process could not start.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_flag():
    assert parse_cli(["--tensor-parallel-size", "2"]).tensor_parallel_size == 2


def test_completions_equal(servers):
    body = {"prompt": ["Summer is warm.", "Winter", "a b c d e f g h i j k l m n o p"], "max_tokens": 10,
            "temperature": 0, "logprobs": 3, "echo": True}
    a, b = (_post(s, "/v1/completions", body) for s in servers)
    worst = 0.0
    for ca, cb in zip(a["choices"], b["choices"]):
        assert ca["text"] == cb["text"] and ca["logprobs"]["tokens"] == cb["logprobs"]["tokens"]
        assert len(ca["logprobs"]["tokens"]) > 10  # echoed prompt + 10 generated
        for x, y in zip(ca["logprobs"]["token_logprobs"], cb["logprobs"]["token_logprobs"]):
            worst = max(worst, abs(x - y) if x is not None else 0.0)
    assert worst <= 1e-4, worst


def test_inspect_maps_equal(servers):
    body = {"prompt": "Tensor parallel inspection", "layers": [0, 1], "heads": [0, 3], "mode": "full",
            "format": "list"}
    a, b = (_post(s, "/inspect", body) for s in servers)
    assert a["kv_groups"] == b["kv_groups"] == [0, 1]
    for la, lb in zip(a["layers"], b["layers"]):
        ma, mb = la["attention"]["maps"]["values"], lb["attention"]["maps"]["values"]
        assert ma["shape"] == mb["shape"] and ma["shape"][0] == 2 and ma["shape"][1] == ma["shape"][2] > 3
        flat = lambda m: [v for h in m["data"] for row in h for v in row]  # noqa: E731
        assert max(abs(x - y) for x, y in zip(flat(ma), flat(mb))) <= 1e-4
        for ha, hb in zip(la["attention"]["heads"], lb["attention"]["heads"]):
            assert ha["sink_mass"] == pytest.approx(hb["sink_mass"], abs=1e-4)


def test_completions_under_a_lora_adapter_equal(servers):
    """`--lora-modules` with `--tensor-parallel-size 2`: every rank serves its share of the adapter, and a request
    naming it gets TP=1's tokens and logprobs; /inspect under it needs the whole model in one process (a 400)."""
    body = {"model": "ad", "prompt": ["Summer is warm.", "a b c d e f"], "max_tokens": 8, "temperature": 0,
            "logprobs": 2}
    a, b = (_post(s, "/v1/completions", body) for s in servers)
    base = _post(servers[0], "/v1/completions", {**body, "model": None})
    for ca, cb, cbase in zip(a["choices"], b["choices"], base["choices"]):
        assert ca["text"] == cb["text"] and ca["logprobs"]["token_logprobs"] == pytest.approx(
            cb["logprobs"]["token_logprobs"], abs=1e-4)
        assert ca["logprobs"]["token_logprobs"] != pytest.approx(cbase["logprobs"]["token_logprobs"], abs=1e-3)
    r = httpx.post(servers[1].url + "/inspect", json={"model": "ad", "prompt": "hi there", "layers": [0]}, timeout=60)
    assert r.status_code == 400 and "tensor-parallel" in r.json()["error"]["message"]


def test_a_failing_step_under_tensor_parallelism_is_fatal(servers, monkeypatch):
    """Rank 0 fails after the step's broadcast: the worker may be left inside a collective, so the engine does not
    carry on. The client gets its error, /health turns 503, the workers are killed, and the server is told to
    exit (a real server then exits 1 for its orchestrator to restart it). Last in this file: it ends the module's
    TP server (one process holds one default process group, so the test cannot start a second one)."""
    server = servers[1]
    state = server.app.state.server
    fatal: list[bool] = []
    state.on_fatal = lambda: fatal.append(True)

    def broken(*a, **k):  # runs after TPModel has broadcast the step to the worker
        raise RuntimeError("injected: rank 0 fails inside the step")

    monkeypatch.setattr(state.loaded.model.shard, "forward", broken)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
    assert r.status_code in (500, 503) and r.json()["error"]
    h = httpx.get(server.url + "/health", timeout=10)
    assert h.status_code == 503 and "engine" in h.json()["error"]["message"]
    assert fatal == [True]
    assert all(p.poll() is not None for p in state.loaded.model.workers)
