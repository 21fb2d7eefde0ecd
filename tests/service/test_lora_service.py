"""LoRA adapters served per request (--lora-modules, model/features/lora/adapters.py) against HF transformers + PEFT on the same
files: a random-weight LLaMA saved by transformers, and two random adapters saved by PEFT (rank 8 on every
projection; rank 64 with rsLoRA on some). Over HTTP through the openai package: prompt logprobs at every position
within 1e-4 of PEFT's forward (float32) and the same greedy tokens; requests for the base and both adapters sent at
once give each exactly what it gives alone; /inspect under an adapter reads PEFT's residual stream; the adapters are
listed by /v1/models, counted in /metrics, loaded and unloaded at run time, and refused where an endpoint runs the
base alone."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import torch

from gguf_writer import write_lora_gguf
from hf_checkpoints import save_tiny_checkpoint
from hf_reference import top_margins
from live_server import LiveServer
from test_inspect_viewer import needs_chromium, page  # noqa: F401 (page: the browser fixture)
from service.config import Settings
from service.main import create_app

TOL = 1e-4
PROMPTS = ["The quick brown fox", "LoRA adapts a few matrices", "0123456789 abcdef"]
ADAPTERS = {
    # name: (rank, alpha, rsLoRA, targets)
    "r8": (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "r64": (64, 32, True, ["q_proj", "v_proj", "down_proj"]),
    "r4": (4, 8, False, ["q_proj", "k_proj"]),
    "r16": (16, 16, False, ["gate_proj", "up_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The base folder and each adapter's folder, written by transformers and PEFT."""
    peft = pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora")
    base_dir = save_tiny_checkpoint(root / "base")
    from transformers import LlamaForCausalLM

    folders = {}
    for seed, (name, (r, alpha, rs, targets)) in enumerate(ADAPTERS.items()):
        base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        cfg = peft.LoraConfig(r=r, lora_alpha=alpha, use_rslora=rs, target_modules=targets, init_lora_weights=False)
        torch.manual_seed(200 + seed)
        model = peft.get_peft_model(base, cfg)
        with torch.no_grad():  # PEFT's random init leaves B small: make each adapter move the logits visibly
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.normal_(0, 0.3 / r**0.25)
        model.save_pretrained(root / name)
        folders[name] = root / name
    return base_dir, folders


@pytest.fixture(scope="module")
def references(checkpoint):
    """name (None: the base) -> the HF model (PEFT-wrapped for an adapter), float32, eval."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    base_dir, folders = checkpoint
    refs = {None: LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()}
    for name, folder in folders.items():
        base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        refs[name] = PeftModel.from_pretrained(base, folder).eval()
    return refs


@pytest.fixture(scope="module")
def server(checkpoint):
    base_dir, folders = checkpoint
    config = json.loads((base_dir / "config.json").read_text())
    gguf = base_dir.parent / "r8.gguf"  # the rank-8 adapter as llama.cpp's converter writes it
    write_lora_gguf(gguf, folders["r8"], config["num_attention_heads"], config["num_key_value_heads"])
    settings = Settings(model=str(base_dir), dtype="float32", device="cpu", quantization="none",
                        kv_cache_bytes=32 << 20, max_num_seqs=32, served_model_name="base",
                        chat_template="{% for m in messages %}{{ m.content }}\n{% endfor %}",
                        lora_modules=[f"{n}={p}" for n, p in folders.items()] + [f"r8-gguf={gguf}"])
    with LiveServer(create_app(settings, wait_ready=True)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _ids(server, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]


@torch.no_grad()
def _reference(model, ids: list[int], n: int) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """The prompt's (T - 1,) log-probabilities of each next prompt token, then n greedy tokens (whole-sequence
    forwards) and the (n, V) log-probabilities each was chosen from."""
    prompt_lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    lp_prompt = prompt_lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    seq, lps = list(ids), []
    for _ in range(n):
        lp = model(torch.tensor([seq])).logits[0, -1].float().log_softmax(-1)
        lps.append(lp)
        seq.append(int(lp.argmax()))
    return lp_prompt, seq[len(ids):], torch.stack(lps) if lps else None


def test_models_lists_each_adapter_with_its_base(server):
    data = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["base", *ADAPTERS, "r8-gguf"]
    for m in data[1:]:
        assert m["parent"] == "base" and m["root"].endswith(m["id"].replace("-", "."))


@pytest.mark.parametrize("name", [None, *ADAPTERS])
def test_served_logprobs_equal_peft(server, client, references, name):
    """Every prompt position's logprob within 1e-4 of PEFT's forward, and PEFT's greedy tokens with their logprobs up
    to the first step where the reference's top-1 leads by less than 100x the tolerance (a near-tie could flip)."""
    model = name or "base"
    for text in PROMPTS:
        ids = _ids(server, text)
        want_prompt, want_tokens, want_lps = _reference(references[name], ids, 12)
        r = client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0, logprobs=1, echo=True)
        assert r.model == model
        lp = r.choices[0].logprobs.token_logprobs
        T = len(ids)
        assert max(abs(a - float(b)) for a, b in zip(lp[1:T], want_prompt)) <= TOL
        safe = top_margins(want_lps) > 100 * TOL
        k = int(safe.int().argmin()) if not bool(safe.all()) else len(want_tokens)  # the steps before a near-tie
        assert k >= 2
        got = client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0, logprobs=1)
        # each token's text as the server writes it in logprobs (the byte tokenizer: one id a text)
        want_texts = [httpx.post(server.url + "/detokenize", json={"tokens": [t]}).json()["prompt"]
                      for t in want_tokens[:k]]
        assert got.choices[0].logprobs.tokens[:k] == want_texts
        chosen = torch.tensor(got.choices[0].logprobs.token_logprobs[:k])
        assert float((chosen - want_lps[:k].max(-1).values).abs().max()) <= TOL


def test_adapters_and_base_in_one_batch_give_what_each_gives_alone(server, client):
    """32 requests over the base and four adapters on the same prompts (so also on each other's cached prefixes),
    sent at once into one batch: each request's tokens and logprobs exactly as alone."""
    models = ["base", *ADAPTERS]
    jobs = [(models[i % len(models)], PROMPTS[i % len(PROMPTS)]) for i in range(32)]

    def one(job):
        model, text = job
        r = client.completions.create(model=model, prompt=text, max_tokens=16, temperature=0, logprobs=2)
        lp = r.choices[0].logprobs
        return r.choices[0].text, lp.token_logprobs, [sorted(t.items()) for t in lp.top_logprobs]

    alone = {job: one(job) for job in sorted(set(jobs))}
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(one, jobs))
    assert together == [alone[j] for j in jobs]
    # and each adapter changes what the base says
    first = [alone[(m, PROMPTS[0])][1] for m in models]
    assert len({json.dumps(lp) for lp in first}) == len(models)


def test_an_unknown_model_is_refused_naming_what_is_served(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "'r8'" in e.value.body["message"]
    r = httpx.post(server.url + "/inspect/patch", json={"model": "r9", "clean": "hi there", "corrupted": "ho there",
                                                        "answer": "a"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    chat = client.chat.completions.create(model="r8", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "r8"


def test_requests_under_each_adapter_are_counted(server, client):
    client.completions.create(model="r64", prompt="count me", max_tokens=3)
    metrics = httpx.get(server.url + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith('llamascope_lora_requests_total{adapter="r64"}'))
    assert float(line.split()[-1]) >= 1
    assert 'llamascope_lora_generation_tokens_total{adapter="r64"}' in metrics


@pytest.fixture(scope="module")
def runtime_server(checkpoint):
    base_dir, _ = checkpoint
    settings = Settings(model=str(base_dir), dtype="float32", device="cpu", quantization="none",
                        kv_cache_bytes=32 << 20, max_num_seqs=8, served_model_name="base",
                        enable_lora_runtime_updates=True)
    with LiveServer(create_app(settings, wait_ready=True)) as live:
        yield live


def _prompt_logprobs(url: str, model: str, ids: list[int]) -> list[float]:
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 1, "echo": True,
                                                  "logprobs": 0, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)]


def test_adapters_load_and_unload_at_run_time(runtime_server, checkpoint, references):
    """vLLM's endpoints: a loaded adapter serves PEFT's numbers; a second load of a name, a folder that is not an
    adapter and an unknown name are refused; an unloaded name is a 404; a name loaded again with other weights serves
    the new ones (its prompt's cached K/V under the old load is not reused)."""
    url, (_, folders) = runtime_server.url, checkpoint
    load = lambda name, path: httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
    unload = lambda name: httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name})
    ids = httpx.post(url + "/tokenize", json={"prompt": PROMPTS[0] * 3}).json()["tokens"]  # several KV blocks

    def assert_serves(ref_name):  # greedy over the prompt's blocks as the prefix cache holds them, and echoed
        _, _, want = _reference(references[ref_name], ids, 8)
        assert float(top_margins(want).min()) > 100 * TOL  # no near-tie on the greedy path
        r = httpx.post(url + "/v1/completions", json={"model": "live", "prompt": ids, "max_tokens": 8, "logprobs": 1,
                                                      "temperature": 0}, timeout=60).json()
        got = torch.tensor(r["choices"][0]["logprobs"]["token_logprobs"])
        assert float((got - want.max(-1).values).abs().max()) <= TOL
        want_prompt, _, _ = _reference(references[ref_name], ids, 0)
        assert max(abs(a - float(b)) for a, b in zip(_prompt_logprobs(url, "live", ids), want_prompt)) <= TOL

    r = load("live", folders["r8"])
    assert r.status_code == 200 and "added" in r.text
    assert "live" in [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert_serves("r8")
    assert load("live", folders["r64"]).json()["error"]["param"] == "lora_name"
    bad = load("other", folders["r8"].parent / "base")
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    assert unload("nobody").status_code == 404
    assert unload("live").status_code == 200
    gone = httpx.post(url + "/v1/completions", json={"model": "live", "prompt": "x", "max_tokens": 1})
    assert gone.status_code == 404
    assert load("live", folders["r64"]).status_code == 200
    assert_serves("r64")


@pytest.mark.parametrize("name", [None, "r64"])
def test_inspect_under_an_adapter_reads_its_residual_stream(server, references, name):
    """/inspect naming an adapter runs the whole probe under it: a block's output equals PEFT's hidden state
    (transformers' output_hidden_states[l + 1]) within 1e-5 of the layer's scale, and the sequence's perplexity its."""
    ids = _ids(server, PROMPTS[1])
    # block 0 (transformers' last hidden state is after the final norm, ours before it), and the whole model's perplexity
    body = {"model": name or "base", "input_ids": ids, "layers": [0], "include": ["hidden_states", "prediction"],
            "hidden_dtype": "float32"}
    r = httpx.post(server.url + "/inspect", json=body, timeout=60)
    assert r.status_code == 200, r.text
    insp = r.json()
    assert insp["model"] == (name or "base")
    with torch.no_grad():
        out = references[name](torch.tensor([ids]), output_hidden_states=True)
    for layer in insp["layers"]:
        v = layer["hidden_states"]["values"]
        got = np.frombuffer(base64.b64decode(v["data"]), dtype="<f4").reshape(v["shape"])
        want = out.hidden_states[layer["layer"] + 1][0].numpy()
        assert np.abs(got - want).max() / np.abs(want).max() <= 1e-5
    lp = out.logits[0, :-1].float().log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])
    assert insp["prediction"]["perplexity"] == pytest.approx(float((-lp.mean()).exp()), rel=1e-4)


def test_an_adapter_from_its_converted_gguf_serves_what_its_peft_files_serve(client):
    """The rank-8 adapter from PEFT's files and from the GGUF llama.cpp's converter makes of them (q/k rows of B
    permuted, alpha in the metadata): the same tokens and logprobs."""
    for text in PROMPTS:
        a, b = (client.completions.create(model=m, prompt=text, max_tokens=12, temperature=0, logprobs=2)
                for m in ("r8", "r8-gguf"))
        assert a.choices[0].text == b.choices[0].text
        lp_a, lp_b = a.choices[0].logprobs.token_logprobs, b.choices[0].logprobs.token_logprobs
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) <= TOL


def _hidden(layer: dict) -> np.ndarray:
    v = layer["hidden_states"]["values"]
    if v["encoding"] == "list":
        return np.array(v["data"], dtype=np.float32)
    return np.frombuffer(base64.b64decode(v["data"]), dtype="<f4").reshape(v["shape"])


def test_compare_is_the_difference_of_two_inspections(server, references):
    """/inspect/compare between the base and an adapter: the residual stream's moves equal those of the two
    inspections' block outputs, the attention maps' difference theirs, and the logit lens' KL divergence PEFT's."""
    ids = _ids(server, PROMPTS[2])
    common = {"input_ids": ids, "layers": [0, 1], "mode": "full", "format": "list"}
    r = httpx.post(server.url + "/inspect/compare", json={**common, "compare": ["r8"]}, timeout=60)
    assert r.status_code == 200, r.text
    (cmp,) = r.json()["comparisons"]
    assert cmp["model"] == "r8" and r.json()["positions"] == list(range(len(ids)))
    both = httpx.post(server.url + "/inspect/compare", json={**common, "compare": ["r64", "r8"]}, timeout=60).json()
    assert [c["model"] for c in both["comparisons"]] == ["r64", "r8"]
    for one, two in zip(cmp["layers"], both["comparisons"][1]["layers"]):  # (a probe's row chunks follow its timing)
        for key, got in (("residual", "delta_norm"), ("residual", "cosine"), ("logit_lens", "kl")):
            assert np.allclose(one[key][got], two[key][got], rtol=1e-5, atol=1e-6)
    sides = [httpx.post(server.url + "/inspect", json={**common, "model": m, "include": ["attention", "hidden_states"],
                                                      "hidden_dtype": "float32"}, timeout=60).json()
             for m in ("base", "r8")]
    with torch.no_grad():
        peft = references["r8"]
        out = peft(torch.tensor([ids]), output_hidden_states=True)
        with peft.disable_adapter():
            base_out = peft(torch.tensor([ids]), output_hidden_states=True)
    model = peft.get_base_model()
    for layer, a, b in zip(cmp["layers"], sides[0]["layers"], sides[1]["layers"]):
        ha, hb = _hidden(a), _hidden(b)
        delta = np.linalg.norm(hb - ha, axis=-1)
        assert np.allclose(layer["residual"]["delta_norm"], delta, rtol=1e-5, atol=1e-5)
        cosine = (ha * hb).sum(-1) / np.linalg.norm(ha, axis=-1) / np.linalg.norm(hb, axis=-1)
        assert np.allclose(layer["residual"]["cosine"], cosine, atol=1e-5)
        maps = np.array(b["attention"]["maps"]["values"]["data"]) - np.array(a["attention"]["maps"]["values"]["data"])
        assert np.abs(np.array(layer["attention"]["values"]["data"]) - maps).max() <= 2e-3  # (float16 on the wire)
        # the lens: the final norm and head on each block output (transformers' last hidden state is normed already)
        with torch.no_grad():
            def lens(o):
                h = o.hidden_states[layer["layer"] + 1][0]
                return (o.logits[0] if layer["layer"] == 1 else model.lm_head(model.model.norm(h))).float().log_softmax(-1)
            la, lb = lens(base_out), lens(out)
            kl = (la.exp() * (la - lb)).sum(-1)
        assert np.allclose(layer["logit_lens"]["kl"], kl.numpy(), rtol=1e-3, atol=1e-5)
        assert float(kl.max()) > 1e-3  # the adapter moved the lens


def test_compare_refuses_what_it_cannot_compare(server):
    body = {"prompt": "hi there", "compare": ["r8"]}
    assert httpx.post(server.url + "/inspect/compare", json={**body, "mode": "topk"}).json()["error"]["param"] == "mode"
    r = httpx.post(server.url + "/inspect/compare", json={**body, "compare": ["nobody"]})
    assert r.status_code == 404


@needs_chromium
def test_the_viewers_adapters_tab_draws_a_comparison(server, page):
    """The viewer's Adapters tab in a real browser: it lists the served models, compares the base with an adapter
    through /inspect/compare and says the same largest move and lens KL the API returns."""
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/inspect/ui#adapters")
    page.wait_for_function("document.getElementById('lora-other').options.length > 1")
    assert page.input_value("#lora-ref") == "base" and page.input_value("#lora-other") == "r8"
    page.fill("#lora-prompt", PROMPTS[0])
    page.click("#lora-run")
    page.wait_for_selector("#lora-section:not([hidden])")
    summary = page.text_content("#lora-summary")
    api = httpx.post(server.url + "/inspect/compare", json={"prompt": PROMPTS[0], "compare": ["r8"], "mode": "none"}).json()
    layers = api["comparisons"][0]["layers"]
    moved = max(max(l["residual"]["relative"]) for l in layers)
    kl = max(max(l["logit_lens"]["kl"]) for l in layers)
    assert f"up to {moved:.3f} of its norm" in summary and f"up to {kl:.3f} nats" in summary, summary
    # the heatmaps are drawn: the largest cell is the full colour
    painted = page.evaluate("""() => { const c = document.getElementById('lora-kl');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        for (let i = 0; i < d.length; i += 4) if (d[i] === 194 && d[i + 1] === 65 && d[i + 2] === 12) return true;
        return false; }""")
    assert painted and not errors


def test_the_responses_api_runs_under_an_adapter(client):
    """`client.responses.create(model=adapter)`: the adapter's answer (greedy), the same text as chat's under it, and
    the response names the adapter."""
    r = client.responses.create(model="r16", input="hi there", max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model="r16", messages=[{"role": "user", "content": "hi there"}],
                                          max_tokens=6, temperature=0)
    base = client.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi there"}],
                                          max_tokens=6, temperature=0, logprobs=True)
    under = client.chat.completions.create(model="r16", messages=[{"role": "user", "content": "hi there"}],
                                           max_tokens=6, temperature=0, logprobs=True)
    assert r.model == "r16" and r.output_text == chat.choices[0].message.content
    assert [t.logprob for t in base.choices[0].logprobs.content] != [t.logprob for t in under.choices[0].logprobs.content]


# Patching, attribution and steering vectors under an adapter, against the same references the base's tests use
# (tests/attribution_reference.py: HF forward hooks and autograd, written from the definitions) on the adapter merged
# into its base's weights by PEFT: the same function of the input, up to float32 rounding.
CLEAN, CORRUPTED = "The quick brown fox jumps over a dog.", "The quick green cat jumps over a dog."


@pytest.fixture(scope="module")
def merged(checkpoint):
    """The rank-8 adapter (every projection) merged into its base by PEFT (`merge_and_unload`): a LlamaForCausalLM."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    base_dir, folders = checkpoint
    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, folders["r8"]).merge_and_unload().eval()


def _prompts(server):
    (answer,), (contrast,) = _ids(server, " "), _ids(server, "x")
    return _ids(server, CLEAN), _ids(server, CORRUPTED), answer, contrast


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_patching_under_an_adapter_equals_hooks_on_its_merged_weights(server, merged, direction):
    """/inspect/patch naming an adapter runs every row (the baselines, each cell, the heads' capture) under it: each
    cell within 1e-4 of the merged model's hooked forward, at residual and head sites; the base's grid differs."""
    from attribution_reference import HEADS, metric, patch_cell, run

    clean, corrupted, answer, contrast = _prompts(server)
    assert len(clean) == len(corrupted)
    sites, positions = ["block_output", "mlp_output", "head_q", "head_k", "head_output"], [11, 14, len(clean) - 1]
    body = {"model": "r8", "clean": CLEAN, "corrupted": CORRUPTED, "answer": " ", "contrast": "x", "sites": sites,
            "layers": "all", "positions": positions, "heads": [0, 3], "direction": direction}
    r = httpx.post(server.url + "/inspect/patch", json=body, timeout=300)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["model"] == "r8"
    source, target = (clean, corrupted) if direction == "denoise" else (corrupted, clean)
    layers = range(merged.config.num_hidden_layers)
    with torch.no_grad():
        src = run(merged, source, sites, layers)["values"]
        m_clean, m_corr = (float(metric(run(merged, ids, (), ())["logits"].double(), answer, contrast))
                           for ids in (clean, corrupted))
    assert got["baselines"]["clean"] == pytest.approx(m_clean, abs=1e-4)
    assert got["baselines"]["corrupted"] == pytest.approx(m_corr, abs=1e-4)
    worst = 0.0
    for s, site in enumerate(sites):
        for l in layers:
            heads = (got["kv_heads"] if site in ("head_k", "head_v") else got["heads"]) if site in HEADS else [None]
            for j, head in enumerate(heads):
                for i, p in enumerate(positions):
                    cell = got["raw"][s][l][j][i] if head is not None else got["raw"][s][l][i]
                    worst = max(worst, abs(cell - patch_cell(merged, src, target, answer, contrast, site, l, head, p)))
    assert worst <= 1e-4
    base = httpx.post(server.url + "/inspect/patch", json={**body, "model": "base"}, timeout=300).json()
    assert base["model"] == "base" and abs(base["baselines"]["clean"] - m_clean) > 1e-2


def test_attribution_under_an_adapter_equals_autograd_on_its_merged_weights(server, merged):
    """/inspect/attribute naming an adapter: direct logit attribution (each head through wo plus the adapter's o
    delta) and attribution patching's estimates (the backward through the adapter's deltas) within 1e-4 of HF's on
    the merged weights; `verify` patches its cells exactly under the adapter."""
    from attribution_reference import attribution_patching, direct_logit

    clean, corrupted, answer, contrast = _prompts(server)
    r = httpx.post(server.url + "/inspect/attribute", timeout=300, json={
        "model": "r8", "method": "direct_logit", "prompt": CLEAN, "answer": " ", "contrast": "x"})
    assert r.status_code == 200, r.text
    got, ref = r.json(), direct_logit(merged, clean, answer, contrast)
    assert got["model"] == "r8" and got["logit_diff"] == pytest.approx(ref["logit_diff"], abs=1e-4)
    assert torch.tensor(got["heads"]).sub(torch.tensor(ref["heads"])).abs().max() <= 1e-4
    assert torch.tensor(got["mlp"]).sub(torch.tensor(ref["mlp"])).abs().max() <= 1e-4
    assert max(map(abs, got["remainder"])) <= 1e-4  # the heads split the adapted attention output
    sites = ["block_output", "head_v", "head_output"]
    r = httpx.post(server.url + "/inspect/attribute", timeout=300, json={
        "model": "r8", "method": "attribution_patching", "clean": CLEAN, "corrupted": CORRUPTED, "answer": " ",
        "contrast": "x", "sites": sites, "qk_fix": False, "verify": 4})
    assert r.status_code == 200, r.text
    got = r.json()
    T, L = len(clean), merged.config.num_hidden_layers
    want, _ = attribution_patching(merged, clean, corrupted, answer, contrast, sites, range(L), range(T))
    base, worst = got["baselines"]["corrupted"], 0.0
    for s, site in enumerate(sites):
        for l in range(L):
            heads = [None] if site == "block_output" else got["kv_heads"] if site == "head_v" else got["heads"]
            for j, head in enumerate(heads):
                for p in range(T):
                    cell = got["raw"][s][l][p] if head is None else got["raw"][s][l][j][p]
                    worst = max(worst, abs(cell - base - want[(site, l, head, p)]))
    assert worst <= 1e-4 * max(1.0, max(map(abs, want.values())))
    for c in got["verified"]["cells"]:  # exact patches under the adapter: what /inspect/patch gives for the cell
        exact = httpx.post(server.url + "/inspect/patch", timeout=300, json={
            "model": "r8", "clean": CLEAN, "corrupted": CORRUPTED, "answer": " ", "contrast": "x", "sites": [c["site"]],
            "layers": [c["layer"]], "positions": [c["position"]],
            **({"heads": [c["head"]]} if c["site"] == "head_output" else {})}).json()
        cell = exact["raw"][0][0]
        if c["head"] is not None:
            cell = cell[(exact["kv_heads"] if c["site"] == "head_v" else exact["heads"]).index(c["head"])]
        assert cell[0] == pytest.approx(c["exact_raw"], abs=1e-5)


def test_a_steering_vector_read_under_an_adapter_is_its_residual_difference(server, merged):
    """POST /v1/vectors naming an adapter reads the prompts' block outputs under it (the merged model's hidden
    states within 1e-5 of their scale) and says so."""
    pos, neg = ["I love this", "What a joy"], ["I hate this", "What a pain"]
    body = {"name": "joy-r8", "model": "r8", "layers": [0], "positive": pos, "negative": neg}  # (HF: normed last)
    r = httpx.post(server.url + "/v1/vectors", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["adapter"] == "r8"
    with torch.no_grad():
        last = {t: merged(torch.tensor([_ids(server, t)]), output_hidden_states=True).hidden_states for t in pos + neg}
    for layer in (0,):
        v = np.frombuffer(base64.b64decode(got["data"][str(layer)]), dtype="<f4")
        want = torch.stack([last[p][layer + 1][0, -1].double() - last[n][layer + 1][0, -1].double()
                            for p, n in zip(pos, neg)]).mean(0).numpy()
        assert np.abs(v - want).max() <= 1e-5 * np.abs(want).max()
    httpx.delete(server.url + "/v1/vectors/joy-r8")
