"""The inspection papers' findings, reproduced on the default model (SmolLM2-135M-Instruct, float32): the runs
docs/inspection.md quotes. `pytest -s tests/model/test_paper_findings.py` prints the figures.

- Sun et al. 2024 ("Massive Activations in Large Language Models", section 3): a massive activation acts as a
  fixed bias. Setting it to zero wrecks the model; setting it to its mean over inputs changes almost nothing.
- Xiao et al. 2024 ("Efficient Streaming Language Models with Attention Sinks", section 3.1): attention piles onto
  the first token, and a window over recent tokens keeps working only if those first tokens stay visible.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hf_reference import SENTENCES, SUMMER
from model.probes import ProbeOptions, inspect

BLOCK, DIM = 11, 507  # where the default model's massive activation first appears (token 0, dim 507)
GPL3 = Path("/usr/share/common-licenses/GPL-3")  # Debian's base-files: a long public text on every Debian machine


def nll_sum(logits: torch.Tensor, ids: list[int]) -> tuple[float, int]:
    """Summed next-token NLL of ids[1:] under logits (T, V), and the count."""
    target = torch.tensor(ids[1:])
    return float(torch.nn.functional.cross_entropy(logits[:-1].float(), target, reduction="sum")), len(ids) - 1


@torch.inference_mode()
def perplexity(model, sequences: list[list[int]], set_to: float | None = None) -> float:
    """exp(mean NLL over every predicted token of every sequence); `set_to` overwrites h[token 0, DIM] at the
    output of block BLOCK (a forward hook: the residual stream every later block reads)."""
    def hook(module, args, out):
        out[:, 0, DIM] = set_to
        return out

    handle = model.layers[BLOCK].register_forward_hook(hook) if set_to is not None else None
    try:
        total, count = 0.0, 0
        for ids in sequences:
            s, n = nll_sum(model(torch.tensor([ids]))[0], ids)
            total, count = total + s, count + n
    finally:
        if handle is not None:
            handle.remove()
    return math.exp(total / count)


@torch.inference_mode()
def block_output(model, ids: list[int], block: int) -> torch.Tensor:
    seen = {}

    def keep(module, args, out):  # returns None: the forward goes on unchanged
        seen["h"] = out[0].clone()

    handle = model.layers[block].register_forward_hook(keep)
    try:
        model(torch.tensor([ids]))
    finally:
        handle.remove()
    return seen["h"]  # (T, D)


def test_massive_activation_is_a_bias_zeroing_it_breaks_the_model(default_model):
    model, tok = default_model.model, default_model.tokenizer
    sequences = [tok.encode(s) for s in SENTENCES]
    values = []
    for ids in sequences:  # in every sentence the largest entry of block 11's output is token 0, dim 507
        h = block_output(model, ids, BLOCK)
        token, dim = divmod(int(h.abs().argmax()), h.shape[1])
        assert (token, dim) == (0, DIM)
        assert h[0, DIM].abs() > 1000 * h.abs().median()
        values.append(float(h[0, DIM]))
    mean = sum(values) / len(values)
    base = perplexity(model, sequences)
    zeroed = perplexity(model, sequences, set_to=0.0)
    averaged = perplexity(model, sequences, set_to=mean)
    print(f"\nmassive activation at block {BLOCK}, token 0, dim {DIM}: values {min(values):.0f}..{max(values):.0f}, "
          f"mean {mean:.0f}\nperplexity over {sum(len(s) - 1 for s in sequences)} tokens: original {base:.1f}, "
          f"set to 0 {zeroed:.3g}, set to the mean {averaged:.1f}")
    assert zeroed > 1000 * base  # the paper's Table 2: zeroing the few massive activations is catastrophic
    assert abs(averaged - base) < 0.05 * base  # ... setting them to their mean is harmless: they act as a bias


def test_attention_sinks_form_before_the_massive_activation(default_model):
    model, tok = default_model.model, default_model.tokenizer
    result = inspect(model, tok.encode(SUMMER), ProbeOptions(include=frozenset({"massive", "attention"})))
    sinks = result.sink_mass_by_layer
    early = [sinks[i] for i in range(3, 10)]
    print(f"\nfirst massive layer {result.massive_layers[0]}; mean first-token attention by block: "
          + ", ".join(f"{i}: {sinks[i]:.2f}" for i in sorted(sinks)))
    assert result.massive_layers[0] == BLOCK
    assert min(early) > 0.6  # blocks 3-9 already attend mostly to token 0, before any massive activation exists


@pytest.mark.slow
@pytest.mark.skipif(not GPL3.is_file(), reason=f"{GPL3} (Debian's base-files) is not on this machine")
def test_window_attention_needs_the_sink_tokens(hf_gguf_model, default_model):
    """Perplexity over 1,536 tokens with HF transformers on the same GGUF, under three causal masks: full, a
    256-token window plus the first 4 tokens (StreamingLLM's attention sinks), and the window alone. Positions stay
    0..T-1 (a mask, not a rolling cache), so only what each query may see changes."""
    ids = default_model.tokenizer.encode(GPL3.read_text())[:1536]
    T, window, sinks = len(ids), 256, 4
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    causal = k <= q
    masks = {"full": causal, "sinks + window": causal & ((q - k < window) | (k < sinks)),
             "window": causal & (q - k < window)}
    ppl = {}
    with torch.inference_mode():
        for name, allowed in masks.items():
            additive = torch.zeros(T, T).masked_fill(~allowed, float("-inf"))[None, None]  # (1, 1, T, T)
            logits = hf_gguf_model(torch.tensor([ids]), attention_mask=additive).logits[0]
            s, n = nll_sum(logits, ids)
            ppl[name] = math.exp(s / n)
    print(f"\nperplexity over {T} tokens of {GPL3}: " + ", ".join(f"{k} {v:.1f}" for k, v in ppl.items()))
    assert ppl["full"] < ppl["sinks + window"] < 1.15 * ppl["full"]  # keeping 4 sink tokens recovers the window
    assert ppl["window"] > 1.5 * ppl["full"]  # without them the same window is far worse


def engine_perplexity(model, tok, ids: list[int], window) -> float:
    """What `echo` + `logprobs` scores over HTTP: the engine's prompt logprobs of ids[1:], under `window`."""
    from model.engine import Engine, EngineConfig, RequestOptions, SamplingParams

    engine = Engine(model, tok, EngineConfig(kv_cache_bytes=256 << 20))
    engine.add_request("ppl", ids, SamplingParams(max_tokens=1, prompt_logprobs=0), RequestOptions(kv_window=window))
    lps = None
    while engine.has_unfinished():
        for out in engine.step():
            lps = out.prompt_logprobs or lps
    return math.exp(-sum(lp.logprob for lp in lps[1:]) / (len(ids) - 1))


@pytest.mark.slow
@pytest.mark.skipif(not GPL3.is_file(), reason=f"{GPL3} (Debian's base-files) is not on this machine")
def test_the_engines_sink_window_cache_keeps_the_finding(default_model):
    """The same 1,536 tokens through the engine's sink + window cache (model/features/kv_window/schedule.py: a rolling cache,
    positions within it, blocks evicted from the middle): with 4 sinks within 1.1x of full attention, and the window
    alone (the paper's control, sink_tokens 0) at least 1.5x worse. The README's table comes from
    benchmarks/streaming.py, which asks the server the same over HTTP."""
    from model.features import KVWindow

    model, tok = default_model.model, default_model.tokenizer
    ids = tok.encode(GPL3.read_text())[:1536]
    ppl = {name: engine_perplexity(model, tok, ids, w) for name, w in
           (("full", None), ("sinks + window", KVWindow(4, 256)), ("window", KVWindow(0, 256)))}
    print(f"\nengine perplexity over {len(ids)} tokens of {GPL3}: " + ", ".join(f"{k} {v:.1f}" for k, v in ppl.items()))
    assert ppl["sinks + window"] < 1.1 * ppl["full"]
    assert ppl["window"] > 1.5 * ppl["full"]
