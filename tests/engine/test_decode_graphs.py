"""The engine's static-buffer decode step (model/engine/cuda_graphs.py) without the CUDA capture: on CPU, "eager" mode
runs exactly what a graph would replay (static buffers, bucket padding, the scratch block, attention reading block
tables on the device) and must give the tokens the ordinary step gives."""

from __future__ import annotations

import pytest

from model import kernels
from model.engine import Engine, EngineConfig
from model.engine.sampling_params import SamplingParams
from test_engine import _prompts, assert_pool_clean, greedy, run
from tiny import byte_tokenizer, tiny_model

pytestmark = pytest.mark.skipif(kernels.native() is None, reason=f"native kernels: {kernels.status()}")


def _engine(mode: str, model=None, **kw) -> Engine:
    cfg = dict(num_blocks=48, block_size=4, max_num_seqs=6, max_num_batched_tokens=40, decode_graphs=mode)
    cfg.update(kw)
    return Engine(model if model is not None else tiny_model(), byte_tokenizer(), EngineConfig(**cfg))


def test_static_decode_step_gives_the_ordinary_steps_tokens():
    prompts = _prompts(7, seed=3, hi=25)
    requests = {str(i): (p, greedy(12 + i)) for i, p in enumerate(prompts)}
    arrive = {str(i): 2 * i for i in range(len(prompts))}  # batch sizes 1..6 come and go: every bucket, padded
    eager = _engine("eager")
    graphs = eager.runner.graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4, 8]
    # the scratch block the padding rows write to is outside what the KV manager hands out
    assert eager.cache.num_blocks == eager.kv.num_blocks + 1 == 49
    calls = []
    original = graphs.run
    graphs.run = lambda batch, lora=None: calls.append(batch.meta.num_tokens) or original(batch, lora)
    got = run(eager, requests, arrive)
    want = run(_engine("off"), requests, arrive)
    assert {r: c[0]["tokens"] for r, c in got.items()} == {r: c[0]["tokens"] for r, c in want.items()}
    assert len(calls) > 20 and set(calls) >= {1, 3, 5}  # it did run, at sizes that pad (3 -> 4, 5 -> 8)
    assert eager.runner.path_counts["cuda_graph"] == len(calls)  # and the runner recorded the path it took
    assert_pool_clean(eager)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "granite", "olmo2"])
def test_static_decode_step_on_the_families(family):
    """The families' switches on the static step (Mistral's window over tables whose leading blocks went back to the
    pool, biases, q/k norms, Granite's scale and multipliers, post-norms): the ordinary step's tokens."""
    from tiny import tiny_family

    model = tiny_family(family)
    prompts = _prompts(5, seed=4, lo=10, hi=30)
    requests = {str(i): (p, greedy(16)) for i, p in enumerate(prompts)}
    arrive = {str(i): 2 * i for i in range(len(prompts))}
    eager = _engine("eager", model)
    got = run(eager, requests, arrive)
    want = run(_engine("off", model), requests, arrive)
    assert {r: c[0]["tokens"] for r, c in got.items()} == {r: c[0]["tokens"] for r, c in want.items()}
    assert eager.runner.path_counts["cuda_graph"] > 10
    assert_pool_clean(eager)


def test_sampled_and_logprob_requests_take_the_static_step_too():
    prompts = _prompts(3, seed=5)
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=7, logprobs=2)
    requests = {str(i): (p, params) for i, p in enumerate(prompts)}
    got, want = run(_engine("eager"), requests), run(_engine("off"), requests)
    for r in requests:
        assert got[r][0]["tokens"] == want[r][0]["tokens"]
        assert [lp.logprob for lp in got[r][0]["logprobs"]] == pytest.approx([lp.logprob for lp in want[r][0]["logprobs"]], abs=1e-4)


def test_adapter_rows_replay_the_adapted_step_over_every_loaded_adapter():
    """Rows of the base and of LoRA adapters decoding together on the static step (model/features/lora/graph.py: each row's adapter
    by its slot, every loaded adapter applied to the bucket with the others' rows masked to exact zeros): the tokens
    and logprobs of the ordinary step (LoRARows over the native kernels); an adapter loaded mid-run makes a new set,
    which the next adapted step holds."""
    from model.engine import RequestOptions
    from test_lora_engine import random_adapter

    model = tiny_model()
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    prompts = _prompts(6, seed=8, lo=5, hi=30)
    names = [None, "a", "b", "a", None, "b"]

    def serve(mode: str):
        engine = _engine(mode, model)
        for name, seed in (("a", 1), ("b", 2)):
            engine.feature("lora").add(random_adapter(name, model.config, 4, seed, sites=every))
        adapted = []
        if engine.runner.graphs is not None:
            graphs, original = engine.runner.graphs, engine.runner.graphs.run
            graphs.run = lambda batch, lora=None: adapted.append(lora is not None) or original(batch, lora)
        out: dict[str, list] = {}
        params = greedy(10, logprobs=1)
        for i, (p, name) in enumerate(zip(prompts, names)):
            engine.add_request(str(i), p, params, RequestOptions(lora=name))
        step = 0
        while engine.has_unfinished():
            if step == 6:  # a third adapter, mid-run, and a request under it
                engine.feature("lora").add(random_adapter("c", model.config, 8, 3, sites=("v_proj", "down_proj")))
                engine.add_request("c", prompts[0], params, RequestOptions(lora="c"))
            for o in engine.step():
                out.setdefault(o.request_id, []).extend((t, lp.logprob) for t, lp in zip(o.token_ids, o.logprobs))
            step += 1
        return out, engine, adapted

    got, eager, adapted = serve("eager")
    want, _, _ = serve("off")
    assert got.keys() == want.keys()
    for r in want:
        assert [t for t, _ in got[r]] == [t for t, _ in want[r]], r
        assert [lp for _, lp in got[r]] == pytest.approx([lp for _, lp in want[r]], abs=1e-5)
    assert got["c"] != got["0"]  # the third adapter changes what the base says on the same prompt
    held = [(a.name, a.serial) for a in eager.runner.graphs.feature_parts[0].adapters]
    assert sum(adapted) > 10 and held == [("a", 1), ("b", 2), ("c", 3)]
    assert_pool_clean(eager)


def test_auto_captures_only_on_cuda():
    auto = _engine("auto")
    assert auto.runner.graphs is None  # CPU: the one-call native step serves every step instead
    run(auto, {"a": ([1, 2, 3], greedy(4))})
    assert auto.stats().steps_by_path == {"cuda_graph": 0, "native": 4, "module": 0}
    off = _engine("off")
    assert off.runner.graphs is None and off.cache.num_blocks == off.kv.num_blocks


def test_static_step_samples_each_row_from_its_own_logits_when_a_row_is_not_sampled():
    """A one-token step in which a row has not caught up (a background prefill at one token a step, ahead of a
    decoding row in the batch): the graph's logits are one per token row, and each sampled row must read its own,
    not the row at its index among the sampled ones (a bug once: row k's logits went to row k + 1)."""
    from model.engine.request_options import RequestOptions

    fg, bg = _prompts(2, seed=11, lo=12, hi=12)
    want = run(_engine("off"), {"fg": (fg, greedy(10))})["fg"][0]["tokens"]
    eager = _engine("eager", max_background_tokens=1)
    eager.add_request("bg", bg * 4, greedy(2), RequestOptions(background=True))
    eager.step()  # the background sequence is admitted alone, first in the batch
    eager.add_request("fg", fg, greedy(10))
    tokens, one_token_steps = [], 0
    while eager.has_unfinished():
        before = eager.runner.path_counts["cuda_graph"]
        for out in eager.step():
            if out.request_id == "fg":
                tokens += out.token_ids
        one_token_steps += eager.runner.path_counts["cuda_graph"] - before
    assert one_token_steps >= 5  # steps of [background prefill token, foreground decode] did take the static path
    assert tokens == want
