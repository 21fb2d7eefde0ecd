"""Attention telemetry (model/features/telemetry/): the decode kernels' record of each row's softmax equals its
definition, the engine's per-token telemetry equals /inspect's rows of the same final sequence on every path, and
asking for it changes no token or logit."""

from __future__ import annotations

import random

import pytest
import torch

from model import kernels
from model.engine import Engine, EngineConfig, RequestOptions, SamplingParams
from model.features import KVWindow, TelemetryOptions
from model.kernels import attention_telemetry
from model.kernels.attention_telemetry import AttentionTelemetry
from model.probes import ProbeOptions, inspect
from test_engine import assert_pool_clean, run
from tiny import byte_tokenizer, tiny_model

needs_native = pytest.mark.skipif(kernels.native() is None, reason=f"native kernels: {kernels.status()}")


def _pools(lens: list[int], H: int, K: int, E: int, bs: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-n // bs) for n in lens) + 2
    k_pool = torch.randn(n_blocks, bs, K, E, generator=g).to(dtype)
    v_pool = torch.randn(n_blocks, bs, K, E, generator=g).to(dtype)
    ids = list(range(n_blocks))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for n in lens:
        tables.append(ids[at : at + -(-n // bs)])
        at += -(-n // bs)
    width = max(map(len, tables))
    q = (torch.randn(len(lens) + 1, H + 2 * K, E, generator=g) * 2).to(dtype)[:, :H]  # a view, as the model passes it
    return q, k_pool, v_pool, torch.tensor([t + [0] * (width - len(t)) for t in tables]), torch.tensor(lens)


def _telemetry(slots: list[int], sink_len: list[int], H: int, k: int) -> AttentionTelemetry:
    Rt = len(sink_len)
    return AttentionTelemetry(torch.tensor(slots), torch.tensor(sink_len), torch.full((Rt, H), -1.0),
                              torch.full((Rt, H, k), -7, dtype=torch.long), torch.full((Rt, H, k), -1.0))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_records_the_definition(dtype):
    """Rows shorter and longer than k, sinks of 0, 1 and 4 keys, a row that records nothing; the attention output
    is bitwise the plain kernel's."""
    H, K, E, bs, k = 4, 2, 64, 16, 5
    lens = [1, 3, 17, 40, 100]
    q, kp, vp, tables, lens_t = _pools(lens, H, K, E, bs, dtype)
    rows = torch.tensor([4, 0, 2, 1, 3])
    slots, sink_len = [0, 1, -1, 2, 3], [1, 4, 0, 1]
    got, want = _telemetry(slots, sink_len, H, k), _telemetry(slots, sink_len, H, k)
    out_plain, out_tel = torch.zeros(6, H, E, dtype=dtype), torch.zeros(6, H, E, dtype=dtype)
    native = kernels.native()
    native.paged_decode_attention(q, kp, vp, rows, tables, lens_t, out_plain)
    native.paged_decode_attention_telemetry(q, kp, vp, rows, tables, lens_t, out_tel, *got)
    assert torch.equal(out_plain, out_tel)
    ids = tables.reshape(-1)
    kd = kp.index_select(0, ids).view(len(lens), -1, K, E)  # (R, S, K, E) gathered
    attention_telemetry.reference(q[rows], kd, lens_t, want)
    assert torch.allclose(got.sink_mass, want.sink_mass, atol=1e-6)
    assert torch.allclose(got.top_prob, want.top_prob, atol=1e-6)
    assert torch.equal(got.top_pos, want.top_pos)
    assert (got.top_pos[0, :, 1:] == -1).all() and (got.top_pos[0, :, 0] == 0).all()  # one key: itself, then none
    assert torch.allclose(got.sink_mass[0], torch.ones(H)) and (got.sink_mass[2] == 0).all()  # no sinks: mass 0


@needs_native
def test_native_kernel_breaks_ties_toward_the_earlier_key():
    """Equal weights (a key repeated) rank by position, in the kernel and in the reference alike."""
    H, K, E, bs = 1, 1, 8, 4
    kp = torch.zeros(3, bs, K, E)
    kp[0, :, 0, 0] = torch.tensor([1.0, 2.0, 2.0, 0.5])
    kp[1, :, 0, 0] = torch.tensor([2.0, 0.1, 2.0, 1.0])
    q = torch.ones(1, H, E)
    lens, tables, rows = torch.tensor([8]), torch.tensor([[0, 1]]), torch.tensor([0])
    got = _telemetry([0], [1], H, 4)
    kernels.native().paged_decode_attention_telemetry(q, kp, kp.clone(), rows, tables, lens, torch.zeros(1, H, E), *got)
    assert got.top_pos[0, 0].tolist() == [1, 2, 4, 6]


def _generate(model, prompt, n, tel: TelemetryOptions | None, window=None, **cfg):
    config = dict(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    config.update(cfg)
    engine = Engine(model, byte_tokenizer(), EngineConfig(**config))
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = []
    engine.add_request("a", prompt, params, RequestOptions(telemetry=tel, kv_window=window))
    while engine.has_unfinished():
        outs += engine.step()
    assert_pool_clean(engine)
    return engine, outs


PATHS = [{}, {"native_step": False}, {"decode_graphs": "eager"}]


@pytest.mark.parametrize("cfg", PATHS, ids=["native", "module", "graph_step"])
def test_engine_telemetry_is_inspects_rows_and_changes_nothing(cfg):
    """Every generated token's telemetry (its first from the prefill's last row, the rest from decode rows) equals
    the rows /inspect reports for the final sequence: sink mass within 1e-5, the same top-k keys in the same order;
    tokens and logprobs are those of the same run without telemetry."""
    model = tiny_model(n_layers=3)
    prompt = [random.Random(3).randrange(256) for _ in range(13)]
    _, plain = _generate(model, prompt, 14, None, **cfg)
    engine, outs = _generate(model, prompt, 14, TelemetryOptions(top_k=4), **cfg)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.logprobs[0].logprob for o in outs] == [o.logprobs[0].logprob for o in plain]
    if cfg.get("decode_graphs") == "eager":  # the graphs' step declines telemetry steps: the module path serves
        assert engine.runner.path_counts["cuda_graph"] == 0
    elif not cfg:
        assert engine.runner.path_counts["native"] == 14  # every step, the prefill too (paged_prefill)
    seq = prompt + [o.token_ids[0] for o in outs]
    rows = [o.features.get("telemetry").position for o in outs]
    assert rows == list(range(len(prompt) - 1, len(seq) - 1))
    probe = inspect(model, seq, ProbeOptions(mode="rows", rows=rows, include=frozenset({"attention", "massive"})))
    for layer in probe.layers:
        p = layer.maps.values  # (H, R, T)
        for i, o in enumerate(outs):
            t = o.features.get("telemetry")
            assert torch.allclose(t.sink_mass[layer.layer], p[:, i, 0], atol=1e-5)
            order = torch.sort(p[:, i], dim=-1, descending=True, stable=True)
            assert torch.equal(t.top_positions[layer.layer], order.indices[:, :4])
            assert torch.allclose(t.top_probs[layer.layer], order.values[:, :4], atol=1e-5)


def test_massive_activation_fields_read_the_tokens_hidden_state():
    """The listed activations are the token's largest |h| after each block, flagged by Sun et al.'s rule against
    this token's own median (a low threshold makes the tiny model's largest entries count)."""
    model = tiny_model(n_layers=2)
    prompt = [7, 8, 9, 10, 11]
    hidden = {}
    hooks = [b.register_forward_hook(lambda m, i, o, l=l: hidden.__setitem__(l, o[0, -1].float()))
             for l, b in enumerate(model.layers)]
    try:
        with torch.inference_mode():
            model(torch.tensor([prompt]))
    finally:
        for h in hooks:
            h.remove()
    _, outs = _generate(model, prompt, 1, TelemetryOptions(massive_threshold=1.0, massive_ratio=2.0, massive_top_k=2))
    t = outs[0].features.get("telemetry")
    for layer, h in hidden.items():
        mag = h.abs()
        top = mag.topk(2)
        assert t.top_dims[layer].tolist() == top.indices.tolist()
        assert torch.allclose(t.top_values[layer], h[top.indices], atol=1e-4)
        assert t.median_abs[layer].item() == pytest.approx(mag.median().item(), abs=1e-5)
        flagged = (mag > 1.0) & (mag >= 2.0 * mag.median())
        assert t.num_massive[layer].item() == int(flagged.sum()) and t.top_massive[layer].tolist() == flagged[top.indices].tolist()


def test_windowed_telemetry_reports_token_positions_and_the_sinks_mass():
    """Under a kv_window the top-k keys are token positions (sinks, or the window behind the query) and the sink
    mass counts the window's sink tokens."""
    model = tiny_model()
    w = KVWindow(3, 6)
    prompt = [random.Random(5).randrange(256) for _ in range(9)]
    for cfg in PATHS[:2]:
        _, outs = _generate(model, prompt, 40, TelemetryOptions(top_k=6), window=w, **cfg)
        for o in outs:
            t, q = o.features.get("telemetry"), o.features.get("telemetry").position
            assert t.sink_tokens == 3
            kept = set(range(3)) | set(range(3 + w.evicted(q, 4), q + 1))
            got = set(t.top_positions.flatten().tolist()) - {-1}
            assert got <= kept, (q, sorted(got - kept))
        assert max(o.features.get("telemetry").top_positions.max().item() for o in outs) == len(prompt) + 40 - 2


def test_no_telemetry_no_extra_work(monkeypatch):
    """A step in which nobody asked builds nothing: the runner hands every path a metadata without telemetry (the
    prefill's general step asks and gets None; the decode steps after it take the decode path, which has none)."""
    from model.features.telemetry import feature

    seen = []
    real = feature.step_telemetry
    monkeypatch.setattr(feature, "step_telemetry", lambda *a: seen.append(real(*a)) or seen[-1])
    _generate(tiny_model(), [1, 2, 3], 5, None)
    assert len(seen) == 1 and all(s is None for s in seen)
