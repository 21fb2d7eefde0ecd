"""LoRA rows in the engine's steps (model/features/lora/adapters.py): the native fused step applies each adapter's deltas inside its
block loop bitwise as the module path does (every family's switches, float32, bfloat16 and int4 bases, prefill and
decode, adapters and base rows mixed), and a request's tokens and logprobs do not depend on the rows beside it.
HF transformers + PEFT as the reference: tests/service/test_lora_service.py."""

from __future__ import annotations

import pytest
import torch

from model.engine import Engine, EngineConfig, InvalidOption, RequestOptions
from model.engine.sampling_params import SamplingParams
from model.features.lora import LoRAAdapter, LoRAPart, target
from model.quantize import quantize_model
from tiny import byte_tokenizer, tiny_family, tiny_model

PROMPTS = [[5, 9, 2, 7, 1] * k for k in (1, 3, 7)]


def random_adapter(name: str, config, rank: int, seed: int,
                   sites=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")) -> LoRAAdapter:
    """Targets on every block: q and v (two ranges of wqkv), o, gate and up (two of w13), down; rsLoRA-like scales."""
    g = torch.Generator().manual_seed(seed)
    adapter = LoRAAdapter(name, name, rank)
    for layer in range(config.n_layers):
        for module in sites:
            site, start, stop, fan_in = target(config, module)
            A = torch.randn(rank, fan_in, generator=g) * 0.3
            BT = torch.randn(rank, stop - start, generator=g) * 0.3  # B transposed
            adapter.parts.setdefault((layer, site), []).append(LoRAPart(start, stop, A, BT, 2.0 / rank**0.5))
    return adapter


def _run(model, native: bool, jobs: list[tuple[str | None, list[int]]], adapters: list[LoRAAdapter]):
    """Each job's (request: adapter name or None, prompt) greedy tokens with every logprob; and the steps by path."""
    engine = Engine(model, byte_tokenizer(), EngineConfig(num_blocks=96, block_size=4, native_step=native))
    for a in adapters:
        engine.feature("lora").add(a)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    for i, (lora, prompt) in enumerate(jobs):
        engine.add_request(str(i), prompt, params, RequestOptions(lora=lora))
    got: dict[str, list] = {str(i): [] for i in range(len(jobs))}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += [(t, lp.logprob, lp.top) for t, lp in zip(o.token_ids, o.logprobs)]
    return [got[str(i)] for i in range(len(jobs))], engine.stats().steps_by_path


def _jobs() -> list[tuple[str | None, list[int]]]:
    return [(lora, p) for p in PROMPTS for lora in (None, "a", "b")]


@pytest.mark.parametrize("mode,dtype", [("none", torch.float32), ("none", torch.bfloat16), ("int4", torch.float32)])
def test_native_step_applies_adapters_bitwise_as_the_module_path(mode, dtype):
    model = quantize_model(tiny_model(dtype=dtype), mode)
    adapters = [random_adapter("a", model.config, 8, 1),
                random_adapter("b", model.config, 16, 2, sites=("k_proj", "down_proj"))]
    fast, fast_paths = _run(model, True, _jobs(), adapters)
    slow, slow_paths = _run(model, False, _jobs(), adapters)
    assert fast_paths["native"] >= 6 and fast_paths["module"] == 0 and slow_paths["native"] == 0
    assert fast == slow
    assert fast[0] != fast[1] and fast[1] != fast[2]  # each adapter changes what the base says


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "granite", "olmo2"])
def test_adapters_under_each_familys_switches(family):
    """A bias after the adapted projection (Qwen2), q/k norms (Qwen3), multipliers (Granite), post-norms (OLMo-2)."""
    model = tiny_family(family)
    adapters = [random_adapter("a", model.config, 8, 3), random_adapter("b", model.config, 4, 4)]
    assert _run(model, True, _jobs(), adapters)[0] == _run(model, False, _jobs(), adapters)[0]


def test_a_request_under_an_adapter_gets_what_it_gets_alone():
    model = quantize_model(tiny_model(), "int4")
    adapters = [random_adapter("a", model.config, 8, 5), random_adapter("b", model.config, 32, 6)]
    together, _ = _run(model, True, _jobs(), adapters)
    alone = [_run(model, True, [job], adapters)[0][0] for job in _jobs()]
    assert together == alone


def test_an_adapter_is_removed_only_when_no_request_runs_under_it():
    model = tiny_model()
    engine = Engine(model, byte_tokenizer(), EngineConfig(num_blocks=32, block_size=4))
    engine.feature("lora").add(random_adapter("a", model.config, 4, 7))
    with pytest.raises(ValueError, match="already loaded"):
        engine.feature("lora").add(random_adapter("a", model.config, 4, 8))
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True), RequestOptions(lora="a"))
    engine.step()
    with pytest.raises(ValueError, match="serving 1 request"):
        engine.feature("lora").remove("a")
    while engine.has_unfinished():
        engine.step()
    engine.feature("lora").remove("a")
    with pytest.raises(InvalidOption, match="no LoRA adapter 'a'"):
        engine.check(RequestOptions(lora="a"))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_changes_no_token_of_an_adapters_rows(method):
    """Drafts (prompt lookup, or the base model drafting for itself at int8: it has no adapter) verified in the
    target's step under the row's adapter: the same greedy tokens and logprobs as without speculation."""
    from model.engine import SpeculativeConfig

    model = tiny_model()
    spec = SpeculativeConfig.parse({"method": method, "num_speculative_tokens": 4, "disable_by_batch_size": None,
                                    **({"prompt_lookup_min": 1} if method == "ngram" else
                                       {"model": "self", "quantization": "int8"})})
    draft = quantize_model(tiny_model(), "int8") if method == "draft_model" else None
    adapters = [random_adapter("a", model.config, 8, 9), random_adapter("b", model.config, 4, 10)]
    prompts = [[5, 9, 2, 7, 1] * 4, [3, 3, 4, 3, 3, 4] * 3]
    runs = []
    for speculative in (None, spec):
        engine = Engine(model, byte_tokenizer(), EngineConfig(num_blocks=96, block_size=4, speculative=speculative),
                        draft_model=draft if speculative else None)
        if speculative is not None:
            engine.drafter.row_cost = engine.drafter.draft_cost = 0.0  # draft whatever a row may
        for a in adapters:
            engine.feature("lora").add(a)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
        for i, (lora, p) in enumerate((lora, p) for p in prompts for lora in (None, "a", "b")):
            engine.add_request(str(i), p, params, RequestOptions(lora=lora))
        got: dict[str, list] = {}
        while engine.has_unfinished():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend((t, lp.logprob, lp.top) for t, lp in zip(o.token_ids, o.logprobs))
        runs.append((got, engine.stats()))
    assert runs[1][0] == runs[0][0]
    assert runs[1][1].spec_decode.num_draft_tokens > 0  # drafts were verified
