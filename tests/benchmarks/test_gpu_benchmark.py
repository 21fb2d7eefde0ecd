"""The GPU benchmark's pieces that need no GPU: its report header, the results file it keeps current while a run
fails part-way, and the agreement check between decode paths (benchmarks/agreement.py)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu
from benchmarks.agreement import StepLogprobs, compare


def test_report_header_names_the_gpu(capsys):
    machine = {"device_name": "NVIDIA H200", "cpu_model": "AMD EPYC 9654", "device": "cuda"}  # machine_info's keys
    gpu.print_report({"machine": machine, "dtype": "torch.bfloat16", "hbm_spec_tb_s": 4.8,
                      "measured_copy_bandwidth_gb_s": 4000.0, "workload": {"concurrency": [1]}, "models": {}})
    header = capsys.readouterr().out.strip().splitlines()[0]
    assert header.startswith("NVIDIA H200, torch.bfloat16") and "EPYC" not in header


def test_a_failing_phase_is_recorded_and_every_other_figure_kept(tmp_path, monkeypatch):
    """A phase that raises (here the engine's, as an out-of-memory would) costs only its own figures: the run goes
    on, the file on disk holds everything else, and the error is named."""

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(gpu, "engine_phase", out_of_memory)
    out = tmp_path / "gpu.json"
    r = gpu.main(["--dry-run", "--device", "cpu", "--skip-hf", "--out", str(out)])
    on_disk = json.loads(out.read_text())
    assert len(gpu.errors(r)) == 2  # one per model
    for m in on_disk["models"].values():
        assert m["errors"] == {"engine": "RuntimeError: CUDA out of memory (simulated)"}
        assert m["graph_single_tok_s"] > 0 and set(m["graph_tok_s"]) == {"1", "2"}  # the static decoder still ran
        assert "engine_single_tok_s" not in m and m["agreement"] == {}  # nothing to compare the static decoder with
    assert on_disk["sizing"] and on_disk["tensor_parallel"] == {"skipped": "dry run"}


def test_results_are_on_disk_after_each_phase(tmp_path):
    results = gpu.Results(tmp_path / "r.json", {"models": {}})
    r = results.data["models"]["m"] = {}
    with results.phase(r, "first", torch.device("cpu")):
        r["a"] = 1.0
    assert json.loads((tmp_path / "r.json").read_text())["models"]["m"] == {"a": 1.0}
    with results.phase(r, "second", torch.device("cpu")):
        r["b"] = 2.0
        raise ValueError("boom")
    on_disk = json.loads((tmp_path / "r.json").read_text())["models"]["m"]
    assert on_disk == {"a": 1.0, "b": 2.0, "errors": {"second": "ValueError: boom"}}


def _steps(*rows: tuple[int, dict[int, float]]) -> list[StepLogprobs]:
    return [StepLogprobs(token, top) for token, top in rows]


def test_agreement_within_tolerance():
    ref = _steps((5, {5: -0.1, 7: -2.5}), (3, {3: -0.5, 4: -1.2}))
    other = _steps((5, {5: -0.12, 7: -2.45}), (3, {3: -0.49, 4: -1.25}))
    c = compare(ref, other, tolerance=0.1, first=2)
    assert c["agree"] and c["first_divergence"] is None and c["max_abs_logprob_diff"] == pytest.approx(0.05)
    assert not compare(ref, other, tolerance=0.01, first=2)["agree"]  # the same runs, a tighter tolerance


def test_agreement_near_tie_flip_is_not_a_disagreement():
    # step 1: the reference prefers 3 over 4 by 0.02 nats, the other path picks 4: rounding can do that
    ref = _steps((5, {5: -0.1, 7: -2.5}), (3, {3: -0.70, 4: -0.72}), (9, {9: -0.1, 1: -3.0}))
    other = _steps((5, {5: -0.1, 7: -2.5}), (4, {4: -0.70, 3: -0.71}), (8, {8: -0.2, 1: -1.0}))
    c = compare(ref, other, tolerance=0.05, first=3)
    assert c["first_divergence"] == 1 and c["ref_margin_at_divergence"] == pytest.approx(0.02)
    assert c["agree"] and not c["first_tokens_equal"]  # step 2 saw other contexts: not compared


def test_agreement_clear_flip_in_the_first_tokens_disagrees():
    ref = _steps((5, {5: -0.1, 7: -2.5}), (3, {3: -0.1, 4: -3.0}))
    other = _steps((5, {5: -0.1, 7: -2.5}), (4, {4: -0.1, 3: -3.0}))
    c = compare(ref, other, tolerance=0.05, first=2)
    assert not c["agree"] and c["first_divergence"] == 1
    # a token missing from the other's top-k counts with at least its distance to the other's k-th
    assert c["max_abs_logprob_diff"] == pytest.approx(2.9)


def test_step_logprobs_from_logits():
    s = StepLogprobs.from_logits(torch.tensor([0.0, 2.0, 1.0, -1.0]), k=2)
    lp = torch.log_softmax(torch.tensor([0.0, 2.0, 1.0, -1.0]), -1)
    assert s.token == 1 and list(s.top) == [1, 2] and s.top[1] == pytest.approx(lp[1].item())


def test_graph_keys_through_the_benchmarks_own_reading(monkeypatch):
    """The benchmark reads an engine's decode graphs by their keys, (bucket, edited, adapted): captured here on the
    CPU by a stand-in for CUDA's capture (tests/fake_cuda_graphs.py), one bucket's capture failing, and an adapter
    loaded (its graphs are captured as it loads)."""
    from model import kernels
    from model.engine import Engine, EngineConfig

    from fake_cuda_graphs import fake_capture
    from model.features.lora import LoRAAdapter, LoRAPart, target
    from tiny import byte_tokenizer, tiny_model

    if kernels.native() is None:
        pytest.skip(f"the static-buffer step runs on the native kernels: {kernels.status()}")
    model = tiny_model()
    engine = Engine(model, byte_tokenizer(), EngineConfig(num_blocks=32, block_size=4, max_num_seqs=3,
                                                          max_num_batched_tokens=32, decode_graphs="eager"))
    rec = fake_capture(monkeypatch, engine)
    rec.fail = {(2, False, False)}
    engine.runner.capture_graphs()
    adapter = LoRAAdapter("a", "a", 2)
    site, start, stop, fan_in = target(model.config, "down_proj")
    adapter.parts[(0, site)] = [LoRAPart(start, stop, torch.randn(2, fan_in), torch.randn(2, stop - start), 0.5)]
    engine.feature("lora").add(adapter)
    r: dict = {}
    r.update(gpu.graph_buckets(engine.runner.graphs))
    assert r == {"engine_graph_buckets": [1, 4], "engine_graph_buckets_failed": [2], "engine_edited_graph_buckets": [1, 2, 4],
                 "engine_adapted_graph_buckets": [1, 2, 4]}
