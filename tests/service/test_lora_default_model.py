"""LoRA adapters on the default model (SmolLM2-135M, its GGUF served at float32) against HF transformers + PEFT on
the same weights (transformers' GGUF loader): a rank-8 adapter on all seven projections and a rank-64 rsLoRA one on
three, random, saved by PEFT. Prompt logprobs at every position within 1e-4 and the greedy path's logprobs too,
through the openai package."""

from __future__ import annotations

import copy

import httpx
import openai
import pytest
import torch

from hf_reference import top_margins
from live_server import LiveServer
from service.config import Settings
from service.main import create_app

TOL = 1e-4
PROMPT = "The capital of France is"
ADAPTERS = {
    "r8": (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "r64": (64, 32, True, ["q_proj", "v_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_gguf_dir, default_gguf):
    """name -> (its folder, the PEFT-wrapped reference model, float32)."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_gguf_dir, gguf_file=default_gguf.name, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("lora-default")
    out = {}
    for seed, (name, (r, alpha, rs, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(300 + seed)
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            r=r, lora_alpha=alpha, use_rslora=rs, target_modules=targets, init_lora_weights=False))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.normal_(0, 0.05 / r**0.25)
        model.save_pretrained(root / name)
        out[name] = (root / name, peft.PeftModel.from_pretrained(copy.deepcopy(base), root / name).eval())
    return out


@pytest.fixture(scope="module")
def server(default_gguf, adapters):
    settings = Settings(model=str(default_gguf), dtype="float32", device="cpu", quantization="none",
                        kv_cache_bytes=64 << 20, max_num_seqs=4,
                        lora_modules=[f"{n}={folder}" for n, (folder, _) in adapters.items()])
    with LiveServer(create_app(settings, wait_ready=True)) as live:
        yield live


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_default_model_under_an_adapter_equals_peft(server, adapters, hf_gguf_tokenizer, name):
    _, ref = adapters[name]
    ids = hf_gguf_tokenizer(PROMPT).input_ids
    assert httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"] == ids
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    r = client.completions.create(model=name, prompt=ids, max_tokens=8, temperature=0, logprobs=1, echo=True)
    lp = r.choices[0].logprobs.token_logprobs
    with torch.no_grad():
        full = ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        want_prompt = full[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        seq, steps = list(ids), []
        for _ in range(8):
            step = ref(torch.tensor([seq])).logits[0, -1].float().log_softmax(-1)
            steps.append(step)
            seq.append(int(step.argmax()))
        with ref.disable_adapter():
            base = ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    T = len(ids)
    assert float((full - base).abs().max()) > 100 * TOL  # the adapter moves the model well beyond the tolerance
    assert max(abs(a - float(b)) for a, b in zip(lp[1:T], want_prompt)) <= TOL
    want = torch.stack(steps)
    assert float(top_margins(want).min()) > 100 * TOL  # the greedy path has no near-tie: the tokens cannot flip
    assert float((torch.tensor(lp[T:]) - want.max(-1).values).abs().max()) <= TOL
    assert r.choices[0].text == PROMPT + hf_gguf_tokenizer.decode(seq[T:])
