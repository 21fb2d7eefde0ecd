"""POST /inspect/patch against the same sweep done with HF transformers forward hooks on the same weights (float32):
every cell of the normalised grid within 1e-4, at every site, in both directions; the rows run in the engine's
batches beside other traffic (which keeps its own results), served from the prefix cache before the patched
position; bad input is a 400 naming the field, before anything runs.

The reference is written from the definition (Meng et al. 2022, causal tracing; Heimersheim & Nanda 2024): run the
source prompt, keep the module's output at (layer, site, position), run the target prompt with a hook that writes
it there, and read the metric at the last position."""

from __future__ import annotations


import httpx
import pytest
import torch

from hf_checkpoints import save_tiny_llama
from live_server import completions_beside
from model.loaders.hf import load_hf
from service.config import Settings
from tiny import byte_tokenizer

# byte tokens: one character each, so prompts of equal length are equal token counts
CLEAN = "The quick brown fox jumps over a dog."
CORRUPTED = "The quick green cat jumps over a dog."
N_LAYERS = 4


@pytest.fixture(scope="module")
def patch_server(tmp_path_factory, tiny_live):
    """(live server on ours, HF, the app) over one random checkpoint with the byte tokenizer's vocabulary."""
    d = tmp_path_factory.mktemp("hf-patch")
    hf = save_tiny_llama(d, vocab_size=258, num_hidden_layers=N_LAYERS)
    settings = Settings(max_patch_cells=400, max_num_seqs=16, max_background_tokens=64)
    with tiny_live(settings, load_hf(d)) as live:
        yield live, hf, live.app


def hf_module(hf, layer: int, site: str):
    block = hf.model.layers[layer]
    return {"block_output": block, "attention_output": block.self_attn, "mlp_output": block.mlp}[site]


def _out(out):
    return out[0] if isinstance(out, tuple) else out


def hf_metric(hf, ids: list[int], answer: int, contrast: int | None, hooks=()) -> float:
    handles = [hf_module(hf, l, s).register_forward_hook(h) for l, s, h in hooks]
    try:
        with torch.inference_mode():
            lp = hf(torch.tensor([ids])).logits[0, -1].double().log_softmax(-1)
    finally:
        for h in handles:
            h.remove()
    return float(lp[answer] - lp[contrast]) if contrast is not None else float(lp[answer])


def hf_sweep(hf, source: list[int], target: list[int], answer: int, contrast: int | None, sites, layers, positions):
    """The plain loop: one hooked HF forward per cell -> raw grid [site][layer][position]."""
    kept: dict[tuple[int, str], torch.Tensor] = {}

    def keep(l, s):
        def hook(mod, args, out):
            kept[(l, s)] = _out(out)[0].clone()  # (T, D)
        return (l, s, hook)

    hf_metric(hf, source, answer, contrast, [keep(l, s) for s in sites for l in layers])
    grid = []
    for s in sites:
        rows = []
        for l in layers:
            row = []
            for p in positions:
                def patch(mod, args, out, l=l, s=s, p=p):
                    h = _out(out).clone()
                    h[0, p] = kept[(l, s)][p]
                    return (h,) + tuple(out[1:]) if isinstance(out, tuple) else h
                row.append(hf_metric(hf, target, answer, contrast, [(l, s, patch)]))
            rows.append(row)
        grid.append(rows)
    return grid


def post(live, body: dict) -> httpx.Response:
    return httpx.post(f"{live.url}/inspect/patch", json=body, timeout=300)


@pytest.mark.parametrize("direction,metric", [("denoise", "logit_diff"), ("noise", "logprob")])
def test_grid_equals_hf_hooks(patch_server, direction, metric):
    live, hf, _ = patch_server
    tok = byte_tokenizer()
    clean, corrupted = tok.encode(CLEAN), tok.encode(CORRUPTED)
    answer, contrast = tok.encode(" ", add_bos=False)[0], tok.encode("x", add_bos=False)[0]
    sites = ["attention_output", "mlp_output", "block_output"]
    body = {"clean": CLEAN, "corrupted": CORRUPTED, "answer": " ", "metric": metric, "direction": direction,
            "sites": "all", "layers": "all", "positions": [0, 10, 12, 14, 17, 25, -1]}
    if metric == "logit_diff":
        body["contrast"] = "x"
    r = post(live, body)
    assert r.status_code == 200, r.text
    got = r.json()
    T = len(clean)
    positions = [0, 10, 12, 14, 17, 25, T - 1]
    assert got["positions"] == positions and got["layers"] == list(range(N_LAYERS)) and got["sites"] == sites
    assert [t["id"] for t in got["clean_tokens"]] == clean and [t["id"] for t in got["corrupted_tokens"]] == corrupted
    source, target = (clean, corrupted) if direction == "denoise" else (corrupted, clean)
    c = contrast if metric == "logit_diff" else None
    ref_raw = torch.tensor(hf_sweep(hf, source, target, answer, c, sites, range(N_LAYERS), positions), dtype=torch.float64)
    m_clean, m_corr = hf_metric(hf, clean, answer, c), hf_metric(hf, corrupted, answer, c)
    assert got["baselines"]["clean"] == pytest.approx(m_clean, abs=1e-4)
    assert got["baselines"]["corrupted"] == pytest.approx(m_corr, abs=1e-4)
    assert abs(m_clean - m_corr) > 0.1  # the two prompts differ in the metric, so normalising means something
    ref = (ref_raw - m_corr) / (m_clean - m_corr)
    ours = torch.tensor(got["normalized"], dtype=torch.float64)  # (S, L, P)
    print(f"{direction}/{metric}: max |ours - HF| {(ours - ref).abs().max():.2e}, grid spans "
          f"[{ref.min():.2f}, {ref.max():.2f}]")
    assert (ours - ref).abs().max().item() <= 1e-4
    assert (torch.tensor(got["raw"], dtype=torch.float64) - ref_raw).abs().max().item() <= 1e-4
    # the grid is not flat: some cells move the metric, and the definition's fixed points hold
    assert ref.max() - ref.min() > 0.3
    far = 1.0 if direction == "denoise" else 0.0  # the last block's output at the last position is the source's
    assert ours[2, -1, -1].item() == pytest.approx(far, abs=1e-4)
    same = 0.0 if direction == "denoise" else 1.0  # position 0 ("T") is the same token in both prompts
    assert ours[:, :, 0].sub(same).abs().max().item() <= 1e-4


def hf_stream_patch(hf, source, target, answer, contrast, site: str, layer: int, position: int) -> float:
    """One cell at resid_mid (the stream between the sub-blocks, post_attention_layernorm's input) or mlp_input (the
    MLP's input), from the definition: keep the source's value there, and run the target with the stream (as the
    attention output that makes `residual + attn` that value) or the MLP's input written at `position`."""
    block = hf.model.layers[layer]
    kept = {}
    if site == "resid_mid":
        h = block.post_attention_layernorm.register_forward_pre_hook(lambda m, a: kept.__setitem__("x", a[0][0].clone()))
    else:
        h = block.mlp.register_forward_pre_hook(lambda m, a: kept.__setitem__("x", a[0][0].clone()))
    try:
        hf_metric(hf, source, answer, contrast)
    finally:
        h.remove()
    seen = {}
    if site == "resid_mid":
        def attn(m, a, out):
            o = out[0].clone()
            o[0, position] = kept["x"][position] - seen["h"][0, position]
            return (o,) + tuple(out[1:])
        handles = [block.register_forward_pre_hook(
                       lambda m, a, kw: seen.__setitem__("h", a[0] if a else kw["hidden_states"]), with_kwargs=True),
                   block.self_attn.register_forward_hook(attn)]
    else:
        def mlp_in(m, a):
            x = a[0].clone()
            x[0, position] = kept["x"][position]
            return (x, *a[1:])
        handles = [block.mlp.register_forward_pre_hook(mlp_in)]
    try:
        return hf_metric(hf, target, answer, contrast)
    finally:
        for h in handles:
            h.remove()


def test_stream_sites_equal_hf_hooks(patch_server):
    """Sites resid_mid and mlp_input (what an intervention sets there: the stream itself, and the MLP's input alone)."""
    live, hf, _ = patch_server
    tok = byte_tokenizer()
    clean, corrupted = tok.encode(CLEAN), tok.encode(CORRUPTED)
    answer, contrast = tok.encode(" ", add_bos=False)[0], tok.encode("x", add_bos=False)[0]
    sites, layers, positions = ["resid_mid", "mlp_input"], [0, 2, 3], [10, 14, len(clean) - 1]
    r = post(live, {"clean": CLEAN, "corrupted": CORRUPTED, "answer": " ", "contrast": "x", "sites": sites,
                    "layers": layers, "positions": positions})
    assert r.status_code == 200, r.text
    got = torch.tensor(r.json()["raw"], dtype=torch.float64)  # (S, L, P)
    ref = torch.tensor([[[hf_stream_patch(hf, clean, corrupted, answer, contrast, s, l, p) for p in positions]
                         for l in layers] for s in sites], dtype=torch.float64)
    print(f"stream sites: max |ours - HF| {(got - ref).abs().max():.2e}, grid spans [{ref.min():.2f}, {ref.max():.2f}]")
    assert (got - ref).abs().max().item() <= 1e-4
    assert ref.max() - ref.min() > 0.1  # cells differ, so the equality means something


def test_rows_share_batches_with_traffic_and_the_prefix_cache(patch_server):
    """A sweep while completions stream: each completion's tokens are those it gets alone; the sweep's grid is HF's;
    cells past the first block took the target's blocks from the prefix cache."""
    live, hf, app = patch_server
    tok = byte_tokenizer()
    positions = [3, 20, 30, 35]
    body = {"clean": CLEAN, "corrupted": CORRUPTED, "answer": " ", "contrast": "x", "sites": ["mlp_output"],
            "layers": [1, 2], "positions": positions}
    engine = app.state.server.engine
    hits0 = engine.stats.prefix_cache_hits
    with completions_beside(live.url, 4) as (ref, texts):
        r = post(live, body)
    assert r.status_code == 200, r.text
    assert texts == [ref] * 4
    clean, corrupted = tok.encode(CLEAN), tok.encode(CORRUPTED)
    answer, contrast = tok.encode(" ", add_bos=False)[0], tok.encode("x", add_bos=False)[0]
    raw = torch.tensor(hf_sweep(hf, clean, corrupted, answer, contrast, ["mlp_output"], [1, 2], positions))
    m_clean, m_corr = hf_metric(hf, clean, answer, contrast), hf_metric(hf, corrupted, answer, contrast)
    ref_grid = (raw.double() - m_corr) / (m_clean - m_corr)
    assert (torch.tensor(r.json()["normalized"], dtype=torch.float64) - ref_grid).abs().max().item() <= 1e-4
    # 16-token blocks: the cells at position 20 and 30 (two layers each) find block 0 cached, those at 35 blocks 0-1
    assert engine.stats.prefix_cache_hits - hits0 >= 2 * 16 + 2 * 16 + 2 * 32


@pytest.mark.parametrize("change,param", [
    ({"sites": ["residual"]}, "sites"),
    ({"layers": [0, N_LAYERS]}, "layers"),
    ({"positions": [0, len(CLEAN)]}, "positions"),
    ({"positions": [-len(CLEAN) - 1]}, "positions"),
    ({"corrupted": CORRUPTED + "!"}, "corrupted"),
    ({"answer": "ab"}, "answer"),
    ({"contrast": "xy"}, "contrast"),
    ({"contrast": None}, "contrast"),
    ({"metric": "accuracy"}, "metric"),
    ({"direction": "sideways"}, "direction"),
    ({"layers": "all", "positions": "all", "sites": "all"}, "positions"),  # 3 x 4 x 37 = 444 cells > 400
    ({"corrupted": CLEAN}, "corrupted"),  # the two runs' metrics are equal: nothing to normalise by
])
def test_bad_input_is_a_400_naming_the_field(patch_server, change, param):
    live, _, app = patch_server
    body = {"clean": CLEAN, "corrupted": CORRUPTED, "answer": " ", "contrast": "x", "layers": [0], "positions": [1]}
    body.update(change)
    if body["contrast"] is None:
        del body["contrast"]
    r = post(live, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].split(".")[0] == param, err
    assert app.state.server.ready


def test_byte_budget_is_checked_before_anything_runs(patch_server, monkeypatch):
    live, _, app = patch_server
    engine = app.state.server.engine
    monkeypatch.setattr(app.state.server.settings, "max_inspect_response_bytes", 100_000)
    queries0 = engine.stats.prefix_cache_queries
    body = {"clean": CLEAN, "corrupted": CORRUPTED, "answer": " ", "contrast": "x", "layers": "all",
            "positions": "all"}  # 4 x 37 cells x 64 float32 x 3 = 114 KB
    r = post(live, body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "patch_too_large", r.text
    assert "budget" in r.json()["error"]["message"]
    assert engine.stats.prefix_cache_queries == queries0  # no row was submitted


# The worked example of docs/inspection.md: both answers lead by clear margins (float32: " Paris" by 2.86 nats over
# the next token on the clean prompt, " Rome" by 3.24 on the corrupted one; int4: 2.87 and 3.47)
EXAMPLE = {"clean": "The Eiffel Tower is in the city of", "corrupted": "The Colosseum is in the city of",
           "answer": " Paris", "contrast": " Rome"}
MIN_MARGIN = 1.0  # nats


@pytest.mark.slow
def test_worked_example_on_the_default_model_equals_hf_hooks(server, hf_gguf_model, default_model):
    """Every block's output at every position, on the default model (float32) over HTTP, against the plain loop over
    HF forward hooks on the same GGUF: within 1e-4 of the normalised metric; the example's answers lead clearly."""
    tok = default_model.tokenizer
    clean, corrupted = tok.encode(EXAMPLE["clean"]), tok.encode(EXAMPLE["corrupted"])
    answer, contrast = tok.encode(EXAMPLE["answer"], add_bos=False), tok.encode(EXAMPLE["contrast"], add_bos=False)
    assert len(answer) == len(contrast) == 1 and len(clean) == len(corrupted)
    for ids, want in ((clean, answer[0]), (corrupted, contrast[0])):
        with torch.inference_mode():
            top2 = hf_gguf_model(torch.tensor([ids])).logits[0, -1].log_softmax(-1).topk(2)
        assert top2.indices[0].item() == want and (top2.values[0] - top2.values[1]).item() > MIN_MARGIN
    r = httpx.post(f"{server.url}/inspect/patch", json={**EXAMPLE, "layers": "all", "positions": "all"}, timeout=1800)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["precision"]["dtype"] == "float32"
    L = default_model.model.config.n_layers
    raw = torch.tensor(hf_sweep(hf_gguf_model, clean, corrupted, answer[0], contrast[0], ["block_output"], range(L),
                                range(len(clean))), dtype=torch.float64)
    m_clean = hf_metric(hf_gguf_model, clean, answer[0], contrast[0])
    m_corr = hf_metric(hf_gguf_model, corrupted, answer[0], contrast[0])
    ref = (raw - m_corr) / (m_clean - m_corr)
    ours = torch.tensor(got["normalized"], dtype=torch.float64)
    print(f"default model: max |ours - HF| {(ours - ref).abs().max():.2e}; baselines {got['baselines']}; "
          f"{got['usage']['seconds']:.1f} s over HTTP")
    subject = [p for p in range(len(clean)) if clean[p] != corrupted[p]]
    for l in range(L):  # the figures docs/inspection.md quotes
        print(f"block {l:2d}: subject tokens {[round(ours[0, l, p].item(), 3) for p in subject]}, "
              f"last token {ours[0, l, -1].item():.3f}")
    assert (ours - ref).abs().max().item() <= 1e-4
    # where the clean answer comes back: the subject's tokens in the early blocks, the last position late
    assert ours[0, :4, subject].max().item() > 0.5 and ours[0, -1, -1].item() == pytest.approx(1.0, abs=1e-4)
