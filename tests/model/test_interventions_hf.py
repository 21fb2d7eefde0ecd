"""Interventions and hidden states against HF transformers on the same weights (float32): an edit at a block's
site equals a forward hook doing the same edit on the HF model (logits <= 1e-4), for add, set, scale and
project_out at block_output, add at attention_output and mlp_output, add and set at resid_mid (the stream between the
sub-blocks) and add and project_out at mlp_input (the MLP's normed input); the block outputs the engine and /inspect
return equal HF's `output_hidden_states` (<= 1e-5 of the layer's scale), and its reads of resid_mid, mlp_input and
mlp_normalized equal post_attention_layernorm's input, its output, and its input / rms without the gain.

HF's `hidden_states` tuple is (embeddings, block 0's output, ..., block L-2's output, final_norm(block L-1's
output)): our layer l is its entry l + 1, except the last block, whose output HF only shows after the final norm
(compared here through a forward hook on the decoder layer instead)."""

from __future__ import annotations

import pytest
import torch

from hf_checkpoints import save_tiny_llama
from model.edits import EditTables, Segment
from model.engine import Engine, EngineConfig, RequestOptions
from model.engine.forward_context import ForwardContext
from model.engine.paged_cache import PagedKVCache, SeqSlice
from model.engine.sampling_params import SamplingParams
from model.interventions import HiddenStateRead, Intervention, InterventionPlan
from model.loaders.hf import load_hf
from model.probes import ProbeOptions, ProbeRun
from tiny import byte_tokenizer

VOCAB = 101


@pytest.fixture(scope="module")
def ours_and_hf(tmp_path_factory):
    """(ours, HF) on one random checkpoint: 3 blocks, width 64, GQA."""
    d = tmp_path_factory.mktemp("hf-edits")
    hf = save_tiny_llama(d, num_hidden_layers=3)
    return load_hf(d), hf


def _direction(seed: int, norm: float, dim: int = 64) -> torch.Tensor:
    v = torch.randn(dim, generator=torch.Generator().manual_seed(seed))
    return v / v.norm() * norm


CASES = {
    "add": Intervention(1, "block_output", "add", "all", _direction(0, 4.0), scale=1.5),
    "set": Intervention(1, "block_output", "set", (0, 3), dims=(2, 17, 40), values=(0.0, 5.0, -3.0)),
    "scale": Intervention(0, "block_output", "scale", "all", dims=(5, 6, 7), factor=-1.5),
    "project_out": Intervention(2, "block_output", "project_out", "all", _direction(1, 1.0)),
    "add@attention_output": Intervention(0, "attention_output", "add", (1, 2, 3, 4), _direction(2, 6.0)),
    "add@mlp_output": Intervention(2, "mlp_output", "add", "all", _direction(3, 6.0), scale=-1.0),
    "add@resid_mid": Intervention(1, "resid_mid", "add", "all", _direction(5, 4.0)),
    "set@resid_mid": Intervention(0, "resid_mid", "set", (2, 5), dims=(1, 33, 60), values=(2.0, -4.0, 0.0)),
    "add@mlp_input": Intervention(2, "mlp_input", "add", (0, 4, 7), _direction(6, 3.0)),
    "project_out@mlp_input": Intervention(0, "mlp_input", "project_out", "all", _direction(7, 1.0)),
}


def hf_hook(hf, it: Intervention):
    """The edit as a forward hook on the HF module whose output is the site (written from the definition): at
    resid_mid, LlamaDecoderLayer's `residual + self_attn(...)`, as the attention output that makes that sum the edited
    stream (the layer's input kept by a pre-hook); at mlp_input, as a pre-hook on the MLP. -> the handles."""
    layer = hf.model.layers[it.layer]
    module = {"block_output": layer, "attention_output": layer.self_attn, "mlp_output": layer.mlp,
              "resid_mid": layer.self_attn, "mlp_input": layer.mlp}[it.site]

    def edit(h):  # (1, T, D)
        h = h.clone()
        rows = [t for t in range(h.shape[1]) if it.applies(t, h.shape[1])]
        if it.op == "add":
            h[0, rows] += it.scale * it.vector
        elif it.op == "set":
            for d, v in zip(it.dims, it.values):
                h[0, rows, d] = v
        elif it.op == "scale":
            for d in it.dims:
                h[0, rows, d] *= it.factor
        else:
            u = it.vector / it.vector.norm()
            h[0, rows] -= (h[0, rows] @ u)[:, None] * u
        return h

    if it.site == "mlp_input":
        return [module.register_forward_pre_hook(lambda mod, args: (edit(args[0]), *args[1:]))]
    seen = {}

    def hook(mod, args, out):
        if it.site == "resid_mid":
            f = lambda a: edit(seen["h"] + a) - seen["h"]  # noqa: E731
        else:
            f = edit
        return (f(out[0]),) + tuple(out[1:]) if isinstance(out, tuple) else f(out)

    handles = [module.register_forward_hook(hook)]
    if it.site == "resid_mid":
        handles.append(layer.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.__setitem__("h", args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True))
    return handles


def our_logits(model, ids: list[int], items: list[Intervention] | None) -> torch.Tensor:
    """Our module path over a paged cache (the engine's), with the step's edits table -> (T, V)."""
    T, bs = len(ids), 16
    cache = PagedKVCache.for_model(model, num_blocks=-(-T // bs), block_size=bs)
    edits = None
    if items:
        plan = InterventionPlan(items, T, model.config.n_layers, model.config.dim)
        edits, _ = EditTables(model.config.n_layers, model.config.dim, model.device,
                              model.config.norm_eps).build([Segment(0, 0, T, plan)])
    ctx = ForwardContext.from_slices(cache, [SeqSlice(0, T, T, list(range(-(-T // bs))))], edits)
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(T)[None], ctx)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_edit_equals_a_hooked_hf_forward(ours_and_hf, case):
    ours, hf = ours_and_hf
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]
    it = CASES[case]
    handles = hf_hook(hf, it)
    try:
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0]
    finally:
        for h in handles:
            h.remove()
    got = our_logits(ours, ids, [it])
    with torch.inference_mode():
        plain = hf(torch.tensor([ids])).logits[0]
    print(f"{case}: max |ours - HF| {(got - ref).abs().max():.2e}, the edit moved logits by {(ref - plain).abs().max():.2f}")
    assert (got - ref).abs().max().item() <= 1e-4
    assert (ref - plain).abs().max().item() > 1e-2  # the edit changes the logits, so the equality means something


def test_engine_generation_under_an_edit_follows_hf(ours_and_hf):
    """Greedy decoding through the engine (prefill on the module path, decode fused) with an add on the generated
    positions: the tokens HF picks with the same hook, and the same prompt and generated logprobs (<= 1e-4)."""
    ours, hf = ours_and_hf
    it = Intervention(1, "block_output", "add", "generated", _direction(4, 5.0))
    prompt = [7, 1, 44, 9, 12, 80, 5]
    engine = Engine(ours, byte_tokenizer(), EngineConfig(num_blocks=16, block_size=4))
    engine.add_request("r", prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0,
                                                   prompt_logprobs=0), RequestOptions(interventions=[it]))
    tokens, lps, prompt_lps = [], [], None
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.token_ids
            lps += [lp.logprob for lp in o.logprobs or []]
            prompt_lps = prompt_lps or [lp.logprob for lp in o.prompt_logprobs[1:]]
    seq = prompt + tokens
    # HF sees one sequence of len(seq) tokens: "generated" (relative to the prompt) as the explicit positions
    it_hf = Intervention(1, "block_output", "add", tuple(range(len(prompt), len(seq))), it.vector)
    handles = hf_hook(hf, it_hf)
    try:
        with torch.inference_mode():
            ref = hf(torch.tensor([seq])).logits[0].log_softmax(-1)
    finally:
        for h in handles:
            h.remove()
    P = len(prompt)
    assert tokens == ref[P - 1 : -1].argmax(-1).tolist()
    want = ref[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
    assert prompt_lps == pytest.approx(want[: P - 1].tolist(), abs=1e-4)
    assert lps == pytest.approx(want[P - 1 :].tolist(), abs=1e-4)
    assert engine.runner.path_counts["native"] + engine.runner.path_counts["module"] > 0


def hf_hidden(hf, ids: list[int]) -> torch.Tensor:
    """(T, L, D): every block's output, HF's own: `output_hidden_states` (and a hook for the last block)."""
    last = {}
    n = len(hf.model.layers)
    handle = hf.model.layers[n - 1].register_forward_hook(
        lambda m, a, o: last.__setitem__("h", (o[0] if isinstance(o, tuple) else o)[0].clone()))
    try:
        with torch.inference_mode():
            hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    return torch.stack([hs[l + 1][0] for l in range(n - 1)] + [last["h"]], 1)


def test_hidden_states_equal_hf_output_hidden_states(ours_and_hf):
    """The engine's reads (prompt and generated positions, next to other requests) and /inspect's probe."""
    ours, hf = ours_and_hf
    prompts = [[5, 9, 33, 2, 71, 18, 40, 11, 3], [60, 61, 62], [8, 8, 9, 100, 4, 17]]
    engine = Engine(ours, byte_tokenizer(), EngineConfig(num_blocks=32, block_size=4, max_num_batched_tokens=8))
    read = HiddenStateRead([0, 1, 2], "all")
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                           RequestOptions(hidden_states=read if i != 1 else None))
    out = {str(i): ([], []) for i in range(3)}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id][0].extend(o.token_ids)
            if o.hidden_states is not None:
                out[o.request_id][1].append(o.hidden_states)
    worst = 0.0
    for r in ("0", "2"):
        seq = prompts[int(r)] + out[r][0]
        ref = hf_hidden(hf, seq[:-1])  # every position the engine computed
        hs = out[r][1]
        got = torch.cat([h.values for h in hs])
        assert [p for h in hs for p in h.positions] == list(range(len(seq) - 1))
        err = ((got - ref).abs().amax((0, 2)) / ref.abs().amax((0, 2))).max().item()  # per layer, relative
        worst = max(worst, err)
        probe = ProbeRun(ours, seq, ProbeOptions(include=frozenset({"hidden_states"}))).run()
        ref_all = hf_hidden(hf, seq)
        for lp in probe.layers:
            rel = ((lp.hidden - ref_all[:, lp.layer]).abs().max() / ref_all[:, lp.layer].abs().max()).item()
            worst = max(worst, rel)
    print(f"hidden states vs HF output_hidden_states: max relative difference {worst:.1e}")
    assert worst <= 1e-5


def hf_stream_sites(hf, ids: list[int], items: list[Intervention]) -> dict[tuple[int, str], torch.Tensor]:
    """{(layer, site): (T, D)} of HF's LLaMA under `items` (hf_hook's edits): resid_mid, post_attention_layernorm's
    input; mlp_input, the MLP's input (after its edits); mlp_normalized, TransformerLens' ln2.hook_normalized, the norm's
    input over its root mean square, without the gain (transformer_lens/components/rms_norm.py)."""
    seen, handles = {}, [h for it in items for h in hf_hook(hf, it)]
    eps = hf.config.rms_norm_eps
    for l, layer in enumerate(hf.model.layers):
        def before(m, a, l=l):
            x = a[0][0].float()
            seen[(l, "resid_mid")] = x.clone()
            seen[(l, "mlp_normalized")] = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(before))
        handles.append(layer.mlp.register_forward_pre_hook(
            lambda m, a, l=l: seen.__setitem__((l, "mlp_input"), a[0][0].float().clone())))
    try:
        with torch.inference_mode():
            hf(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return seen


def test_stream_site_reads_equal_hf(ours_and_hf):
    """The engine's reads of resid_mid, mlp_normalized and mlp_input (prompt and generated positions; prefill on
    the module path, decode fused), under an edit of resid_mid before them, equal HF's tensors there (<= 1e-5 of
    the site's scale)."""
    ours, hf = ours_and_hf
    prompt = [5, 9, 33, 2, 71, 18, 40, 11, 3]
    edit = Intervention(1, "resid_mid", "add", "all", _direction(8, 4.0))
    sites = ("resid_mid", "mlp_normalized", "mlp_input")
    read = HiddenStateRead([0, 1, 2], "all", sites)
    engine = Engine(ours, byte_tokenizer(), EngineConfig(num_blocks=32, block_size=4, max_num_batched_tokens=8))
    engine.add_request("r", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                       RequestOptions(interventions=[edit], hidden_states=read))
    tokens, hs = [], []
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.token_ids
            hs += [o.hidden_states] if o.hidden_states is not None else []
    seq = prompt + tokens
    ref = hf_stream_sites(hf, seq[:-1], [edit])
    got = torch.cat([h.values for h in hs])  # (T - 1, layers x sites, D)
    assert [p for h in hs for p in h.positions] == list(range(len(seq) - 1))
    worst = 0.0
    for j, (layer, site) in enumerate((l, s) for l in read.layers for s in sites):
        want = ref[(layer, site)]
        worst = max(worst, ((got[:, j] - want).abs().max() / want.abs().max()).item())
    print(f"stream sites vs HF: max relative difference {worst:.1e}")
    assert worst <= 1e-5
    plain = hf_stream_sites(hf, seq[:-1], [])
    assert (plain[(2, "resid_mid")] - ref[(2, "resid_mid")]).abs().max() > 1e-2  # the edit reached later blocks
