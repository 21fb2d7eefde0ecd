"""Speculative decoding (model/engine/speculative/) changes no output: with n-gram prompt lookup or a draft model
(the same tiny model quantized to int8 or int4, as `"model": "self"` does), every request's tokens, logprobs, top
logprobs, text and finish reason are those of the same engine without speculation, whatever the request carries
(stop strings and ids, max_tokens, n > 1, seeds, penalties, interventions, per-request K, preemption, prefix
caching); seeded sampling draws the same noise; sampled (T > 0) tokens keep the target's distribution (a
chi-squared test against the model's own probabilities); bad configurations are refused with the reason."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from model import kernels
from model.engine import Engine, EngineConfig, RequestOptions, SpeculativeConfig
from model.engine.sampling_params import SamplingParams
from model.engine.speculative.ngram import lookup
from model.interventions import Intervention
from model.quantize import quantize_model
from tiny import byte_tokenizer, tiny_model

pytestmark = pytest.mark.skipif(kernels.native() is None, reason=f"native kernels: {kernels.status()}")

NGRAM = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                 "disable_by_batch_size": None})


def _draft_config(k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig.parse({"method": "draft_model", "model": "self", "quantization": "int8",
                                    "num_speculative_tokens": k, "disable_by_batch_size": None})


@pytest.fixture(scope="module")
def draft():
    return quantize_model(tiny_model(), "int8")  # the `model` fixture's weights (seed 0) at int8


def _prompts(n: int, seed: int = 5) -> list[list[int]]:
    """Prompts that repeat a phrase: a random model's greedy output soon repeats too, so n-grams find drafts."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(32, 127) for _ in range(rng.randrange(3, 7))]
        out.append((phrase * 4)[: rng.randrange(9, 24)] + [rng.randrange(32, 127) for _ in range(rng.randrange(0, 5))])
    return out


def _serve(engine: Engine, requests: list[tuple], max_steps: int = 4000) -> dict:
    """requests: (rid, prompt, params, options, arrive_step) -> {rid: {choice: (tokens, logprobs, tops, text,
    finish, stop_reason)}}; stepping until done."""
    got: dict = {}
    pending = sorted(requests, key=lambda r: r[4])
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][4] <= step:
            rid, prompt, params, options, _ = pending.pop(0)
            engine.add_request(rid, prompt, params, options)
        for o in engine.step():
            c = got.setdefault(o.request_id, {}).setdefault(o.index, [[], [], [], "", None, None])
            c[0] += o.token_ids
            if o.logprobs:
                c[1] += [lp.logprob for lp in o.logprobs]
                c[2] += [lp.top for lp in o.logprobs]
            c[3] += o.text
            if o.finish_reason is not None:
                c[4], c[5] = o.finish_reason, o.stop_reason
        step += 1
        assert step < max_steps
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return got


def _engine(model, spec=None, draft_model=None, eager=True, **kw) -> Engine:
    """eager: the speculator's cost model off (every row drafts what it may), so that a random model's rows draft
    as much as possible; the cost model has tests of its own."""
    cfg = dict(num_blocks=128, block_size=4, max_num_batched_tokens=32, max_num_seqs=8)
    cfg.update(kw)
    engine = Engine(model, byte_tokenizer(), EngineConfig(speculative=spec, **cfg), draft_model=draft_model)
    if eager and spec is not None:
        engine.drafter.row_cost = engine.drafter.draft_cost = 0.0
    return engine


def _mixed_requests(n_layers: int, dim: int) -> list[tuple]:
    ps = _prompts(10)
    greedy = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    steer = torch.zeros(dim)
    steer[3] = 4.0
    return [
        ("plain", ps[0], SamplingParams(**greedy, logprobs=3), RequestOptions(), 0),
        ("stop-str", ps[1], SamplingParams(max_tokens=40, temperature=0.0, stop=["q", "e"]), RequestOptions(), 0),
        ("stop-id", ps[2], SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[101, 33]), RequestOptions(), 1),
        ("short", ps[3], SamplingParams(max_tokens=3, temperature=0.0, logprobs=1), RequestOptions(), 1),
        ("n3", ps[4], SamplingParams(**greedy, n=3), RequestOptions(), 2),
        ("seeded", ps[5], SamplingParams(max_tokens=40, temperature=0.8, top_k=20, seed=11, n=2, logprobs=2), RequestOptions(), 2),
        ("penalty", ps[6], SamplingParams(**greedy, repetition_penalty=1.3, presence_penalty=0.5), RequestOptions(), 3),
        ("steered", ps[7], SamplingParams(**greedy, logprobs=2), RequestOptions(interventions=(
            Intervention(layer=1, op="add", vector=steer, positions="generated"),)), 3),
        ("k1", ps[8], SamplingParams(**greedy), RequestOptions(num_speculative_tokens=1), 4),
        ("off", ps[9], SamplingParams(**greedy), RequestOptions(num_speculative_tokens=0), 4),
        ("repeat", ps[0], SamplingParams(**greedy), RequestOptions(), 30),  # the prefix cache serves its prompt
    ]


def _unspeculated(request: tuple) -> tuple:
    """The request without its own num_speculative_tokens (an engine without speculation refuses one)."""
    rid, prompt, params, options, arrive = request
    return rid, prompt, params, dataclasses.replace(options, num_speculative_tokens=None), arrive


def test_ngram_lookup():
    t = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert lookup(t, 3, 1, 3) == [7, 8, 1]  # the latest earlier "1 2 3" was followed by 7 8 1
    assert lookup(t, 9, 1, 3) == [7, 8, 1, 2, 3]  # no further than the sequence goes
    assert lookup(np.array([5, 6, 7, 8]), 3, 1, 3) == []  # no earlier occurrence of any suffix
    assert lookup(np.array([4, 1, 4, 2, 3, 4]), 2, 1, 2) == [2, 3]  # longest n first: "3 4" is new, then "4"
    assert lookup(np.array([4, 1, 4, 2, 3, 4]), 2, 2, 2) == []


@pytest.mark.parametrize("method,kv", [("ngram", "auto"), ("draft_int8", "auto"), ("draft_int4", "auto"),
                                       ("draft_int4", "float16"), ("draft_int4", "int8")])
def test_speculation_changes_no_output(model, method, kv):
    """Every request of a mixed batch (arriving over several steps) gets exactly what the engine gives without
    speculation, and drafts were verified, accepted and rejected along the way (over a float16 and an int8 KV cache
    too: a rejected draft's keys and values, with their int8 scales, are simply written over)."""
    c = model.config
    reqs = _mixed_requests(c.n_layers, c.dim)
    reference = _serve(_engine(model, kv_cache_dtype=kv), [_unspeculated(r) for r in reqs])
    if method == "ngram":
        engine = _engine(model, NGRAM, kv_cache_dtype=kv)
    else:
        engine = _engine(model, _draft_config(), draft_model=quantize_model(tiny_model(), method.split("_")[1]),
                         kv_cache_dtype=kv)
    got = _serve(engine, reqs)
    assert got == reference
    st = engine.stats().spec_decode
    # a random model rarely repeats itself: n-grams find few drafts that hold, the int8 / int4 copy many
    assert st.num_accepted_tokens > (5 if method == "ngram" else 40), st
    assert st.num_draft_tokens > st.num_accepted_tokens, st
    assert {"seeded", "steered", "penalty", "n3", "stop-str", "k1"} <= set(got)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "phi3", "granite", "olmo2"])
def test_speculation_changes_no_output_on_the_families(family):
    """The families' switches under speculation (a draft of the same family at int4, as `"model": "self"` drafts;
    n-gram lookup too for Mistral, whose sliding window releases blocks behind each row as drafts are settled): the
    mixed batch's output is the one without speculation."""
    from tiny import tiny_family

    model = tiny_family(family)
    c = model.config
    reqs = _mixed_requests(c.n_layers, c.dim)
    reference = _serve(_engine(model), [_unspeculated(r) for r in reqs])
    engine = _engine(model, _draft_config(), draft_model=quantize_model(tiny_family(family), "int4"))
    assert _serve(engine, reqs) == reference
    assert engine.stats().spec_decode.num_accepted_tokens > 20
    if family == "mistral":
        assert _serve(_engine(model, NGRAM), reqs) == reference


def test_preemption_under_speculation(model, draft):
    """A KV pool too small for the batch: sequences are preempted and recomputed while drafting (their drafts
    dropped, the draft model's own cache kept), and the output is still the one without speculation."""
    reqs = [(str(i), p, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=1), RequestOptions(), 0)
            for i, p in enumerate(_prompts(6, seed=9))]
    reference = _serve(_engine(model, num_blocks=40), reqs)
    for spec, dm in ((NGRAM, None), (_draft_config(), draft)):
        engine = _engine(model, spec, dm, num_blocks=40)
        assert _serve(engine, reqs) == reference
        assert engine.scheduler.num_preemptions > 0 and engine.stats().spec_decode.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft_int8"])
def test_structured_outputs_under_speculation(model, draft, method):
    """Grammar-constrained requests draft too: only drafts their grammar accepts are verified, each verification
    row masked as the grammar stands after the drafts before it, and the output is the one without speculation
    (greedy and sampled), every answer still matching its grammar."""
    import json
    import re

    from model.features.structured.spec import StructuredOutputSpec

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"enum": ["ab", "cd"]}}},
              "required": ["name", "tags"]}
    regex = "(ab|cd|efg)+x"
    specs = [StructuredOutputSpec("regex", regex), StructuredOutputSpec.json_schema(schema)]
    ps = _prompts(4, seed=4)
    reqs = []
    for i, spec in enumerate(specs):
        for j, params in enumerate((SamplingParams(max_tokens=60, temperature=0.0, logprobs=2),
                                    SamplingParams(max_tokens=60, temperature=0.9, seed=3))):
            reqs.append((f"{spec.kind}-{j}", ps[2 * i + j], params, RequestOptions(structured=spec), 0))
    reference = _serve(_engine(model), reqs)
    engine = _engine(model, NGRAM) if method == "ngram" else _engine(model, _draft_config(), draft_model=draft)
    got = _serve(engine, reqs)
    assert got == reference
    assert engine.stats().spec_decode.num_accepted_tokens > 10, engine.stats().spec_decode
    for rid, choices in got.items():
        text = choices[0][3]
        if rid.startswith("regex"):
            assert re.fullmatch(regex, text), text
        elif choices[0][4] == "stop":
            json.loads(text)


@pytest.mark.parametrize("positions", ["last", "all"])
def test_hidden_state_reads_under_speculation(model, draft, positions):
    """Hidden-state reads of drafting rows return the positions of kept tokens only, each once, with the values
    of decoding one token at a time (a stop string ending the choice inside a run of accepted drafts included)."""
    from model.interventions import HiddenStateRead

    ps = _prompts(3, seed=8)
    read = RequestOptions(hidden_states=HiddenStateRead(layers=[0, 1], positions=positions))
    reqs = [("a", ps[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), read, 0),
            ("b", ps[1], SamplingParams(max_tokens=40, temperature=0.0, stop=["e", "o"]), read, 0),
            ("c", ps[2], SamplingParams(max_tokens=40, temperature=0.8, seed=5), read, 1)]

    def serve(engine) -> dict:
        got: dict = {}
        for rid, prompt, params, options, _ in reqs:
            engine.add_request(rid, prompt, params, options)
        while engine.has_unfinished():
            for o in engine.step():
                r = got.setdefault(o.request_id, {"tokens": [], "positions": [], "values": []})
                r["tokens"] += o.token_ids
                if o.hidden_states is not None:
                    r["positions"] += o.hidden_states.positions
                    r["values"].append(o.hidden_states.values)
        return {rid: (r["tokens"], r["positions"], torch.cat(r["values"]).tolist()) for rid, r in got.items()}

    reference = serve(_engine(model))
    engine = _engine(model, _draft_config(), draft_model=draft)
    got = serve(engine)
    assert got == reference
    assert engine.stats().spec_decode.num_accepted_tokens > 10 and engine.stats().spec_decode.num_draft_tokens > \
        engine.stats().spec_decode.num_accepted_tokens
    for tokens, seen, _ in got.values():
        assert len(seen) == len(set(seen))


TELEMETRY_FIELDS = ("position", "sink_tokens", "sink_mass", "top_positions", "top_probs", "max_abs", "median_abs",
                    "top_dims", "top_values", "top_massive", "num_massive")


@pytest.mark.parametrize("method,cfg", [("ngram", {}), ("draft", {}), ("draft", {"native_step": False}),
                                        ("draft", {"native_step": False, "paged_prefill": False}),
                                        ("draft", {"kv_cache_dtype": "int8"})],
                         ids=["ngram", "draft", "draft-module", "draft-sdpa-prefill", "draft-kv-int8"])
def test_telemetry_of_kept_tokens_under_speculation(model, draft, method, cfg, monkeypatch):
    """Rows with attention telemetry draft like any: every verification row records its own, and each kept token
    arrives in its own delta with the record of decoding one token at a time (equal, field by field), none of a
    rejected draft's; with a kv window and a stop string too. Where prefill chunks run through SDPA (the GPU's
    way; here forced), each verification row goes once more through the decode kernel over its own keys: the same
    records within float tolerance."""
    from model.features import KVWindow, TelemetryOptions
    from model.engine.paged_cache import PagedKVCache

    cfg = dict(cfg)
    exact = cfg.pop("paged_prefill", True)
    if not exact:
        monkeypatch.setattr(PagedKVCache, "paged_prefill", property(lambda self: False))

    ps = _prompts(3, seed=7)
    tel = TelemetryOptions(top_k=3, massive_top_k=2)
    reqs = [("tel", ps[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1),
             RequestOptions(telemetry=tel)),
            ("stop", ps[1], SamplingParams(max_tokens=40, temperature=0.0, stop=["e", "o"]), RequestOptions(telemetry=tel)),
            ("win", ps[2], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
             RequestOptions(telemetry=tel, kv_window=KVWindow(4, 12)))]

    def serve(engine) -> dict:
        got: dict = {}
        for rid, prompt, params, options in reqs:
            engine.add_request(rid, prompt, params, options)
        while engine.has_unfinished():
            for o in engine.step():
                assert len(o.token_ids) == 1 and o.features.get("telemetry") is not None  # one delta per token, with its record
                got.setdefault(o.request_id, []).append(
                    (o.token_ids, o.text, o.finish_reason, [getattr(o.features.get("telemetry"), f) for f in TELEMETRY_FIELDS]))
        return got

    reference = serve(_engine(model, **cfg))
    engine = _engine(model, NGRAM if method == "ngram" else _draft_config(),
                     draft_model=draft if method == "draft" else None, **cfg)
    got = serve(engine)
    spec = engine.stats().spec_decode  # (n-grams of a random model's text are seldom kept: a few here)
    assert spec.num_accepted_tokens > (10 if method == "draft" else 2) and spec.num_draft_tokens > spec.num_accepted_tokens
    assert got.keys() == reference.keys()
    for rid in reference:
        assert len(got[rid]) == len(reference[rid])
        for (tokens, text, finish, fields), (rtokens, rtext, rfinish, rfields) in zip(got[rid], reference[rid]):
            assert (tokens, text, finish) == (rtokens, rtext, rfinish)
            for name, a, b in zip(TELEMETRY_FIELDS, fields, rfields):
                if isinstance(a, int) or a.dtype != torch.float32:
                    assert (a == b if isinstance(a, int) else torch.equal(a, b)), (rid, name)
                else:
                    assert torch.equal(a, b) if exact else torch.allclose(a, b, atol=1e-5), (rid, name)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_kv_window_rows_speculate_up_to_each_eviction(model, draft, method):
    """Sink + window sequences draft, never past their next eviction point, and give the output of decoding one
    token at a time: rejected drafts are rolled back before the eviction and key shift that follow them, with sinks
    a whole block (4) and not (6), and past the model's context (max_model_len 64)."""
    from model.features import KVWindow

    ps = _prompts(4, seed=3)
    greedy = SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True, logprobs=2)
    reqs = [("w4", ps[0], greedy, RequestOptions(kv_window=KVWindow(4, 16)), 0),
            ("w6", ps[1], greedy, RequestOptions(kv_window=KVWindow(6, 13)), 0),
            ("seeded", ps[2], SamplingParams(max_tokens=70, temperature=0.8, seed=3),
             RequestOptions(kv_window=KVWindow(4, 9)), 1)]
    reference_engine = _engine(model, max_model_len=64)
    reference = _serve(reference_engine, reqs)
    engine = _engine(model, NGRAM if method == "ngram" else _draft_config(),
                     draft_model=draft if method == "draft" else None, max_model_len=64)
    crossed = []
    real = engine.kv.rollback

    def rollback(seq, n):  # a drafting row ends at its next eviction point at the latest
        start = seq.num_computed_tokens - len(seq.draft_token_ids) - 1
        crossed.append(seq.num_computed_tokens - start > seq.window.chunk_limit(start, engine.kv.block_size))
        real(seq, n)

    engine.kv.rollback = rollback
    assert _serve(engine, reqs) == reference
    spec = engine.stats().spec_decode
    assert spec.num_draft_tokens > 50 and spec.num_draft_tokens > spec.num_accepted_tokens
    if method == "draft":  # (a random model's windowed text repeats too little for n-grams to be kept often; the
        assert spec.num_accepted_tokens > 10  # draft, which sees the whole history, agrees with it now and then)
    assert engine.context_shift.num_evictions == reference_engine.context_shift.num_evictions > 20
    assert not any(crossed) and len(crossed) > 10


def test_back_off_by_batch_size(model):
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 3,
                                    "prompt_lookup_min": 1})
    engine = _engine(model, spec)
    reqs = [(str(i), p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), RequestOptions(), 0)
            for i, p in enumerate(_prompts(4, seed=1))]
    _serve(engine, reqs)
    assert engine.stats().spec_decode.num_drafts == 0  # four running: never drafted
    _serve(engine, reqs[:2])
    assert engine.stats().spec_decode.num_drafts > 0


def _verified_samples(model) -> tuple[list[int], dict[int, float], list[int], dict[int, float], list]:
    """T > 0 with drafts that are often wrong: the second generated token (a verified row: the draft d2 is the
    target's second most likely token) and, where d2 was kept, the third, with the target's top-k distributions at
    those prefixes (from the model itself), and the drafter's (drafts, accepted) log."""
    from drafting import PerSequence

    prompt, top_k, N = [40, 41, 42, 43, 44, 45], 6, 1500
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, ignore_eos=True)
    engine = _engine(model, max_num_seqs=32, num_blocks=512)

    def probs(prefix: list[int]) -> dict[int, float]:  # the target's sampling distribution after prefix
        with torch.no_grad():
            logits = model(torch.tensor([prefix]))[0, -1].float()
        top = logits.topk(top_k)
        return dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))

    p1 = probs(prompt)
    t1 = max(p1, key=p1.get)  # condition on the most likely first token
    p2 = probs(prompt + [t1])
    d2 = sorted(p2, key=p2.get)[-2]  # accepted about p2[d2] of the time
    p3 = probs(prompt + [t1, d2])
    d3 = max(p3, key=p3.get)
    engine.drafter = PerSequence(lambda seq: [d2, d3] if seq.output_token_ids == [t1] else [])
    seconds, thirds = [], []
    for batch in range(N // 30):
        reqs = [(f"{batch}-{i}", prompt, params, RequestOptions(), 0) for i in range(30)]
        for r in _serve(engine, reqs).values():
            toks = r[0][0]
            if toks[0] == t1:
                seconds.append(toks[1])
                if toks[1] == d2:
                    thirds.append(toks[2])
    return seconds, p2, thirds, p3, engine.drafter.resolutions


def test_the_cost_model_backs_off_as_the_batch_grows():
    """The drafts a row gets by acceptance rate: more for a row that keeps its drafts, none below break-even, fewer
    in a larger batch (where a row costs about a token), none for a costly draft model in a batch of 8."""
    from model.engine.speculative.speculator import ROW_COST, best_k_table

    one = best_k_table(8, 1, ROW_COST, 0.0)
    assert one[10] == 0 and one[60] >= 1 and one[95] > one[60] and one[100] == 8
    assert all(a <= b for a, b in zip(one, one[1:]))  # more drafts the more of them are kept
    for B in (2, 4, 8):
        assert all(k <= k1 for k, k1 in zip(best_k_table(8, B, ROW_COST, 0.0), one))
    assert sum(best_k_table(8, 8, ROW_COST, 0.14)) == 0


def test_rejection_sampling_keeps_the_target_distribution(model):
    """Verified rows' tokens follow the target's distribution: chi-squared against the model's probabilities."""
    seconds, p2, thirds, p3, resolutions = _verified_samples(model)
    assert {a for _, a in resolutions} == {0, 1}  # drafts rejected and accepted (max_tokens leaves room for one)
    for observed, p in ((seconds, p2), (thirds, p3)):
        assert len(observed) > 150
        keys = sorted(p)
        counts = [observed.count(k) for k in keys]
        assert sum(counts) == len(observed)  # nothing outside the target's top-k
        assert _chi_squared_p(counts, [p[k] * len(observed) for k in keys]) > 1e-3, counts


def _chi_squared_p(observed: list[int], expected: list[float]) -> float:
    """Pearson's chi-squared goodness-of-fit p-value (k - 1 degrees of freedom): P(X > stat) = Q(df/2, stat/2)."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def test_a_wrong_acceptance_rule_fails_the_chi_squared_test(model, monkeypatch):
    """The statistical test above can fail: an engine that keeps every draft skews the verified tokens."""
    from model.engine.speculative import verification

    def keep_all(self, seq, sampled):
        drafts = seq.draft_token_ids
        seq.draft_token_ids = []
        self.kv.commit(seq)
        self.drafter.resolved(seq, len(drafts), len(drafts))
        return [(d, lp) for d, (_, lp) in zip(drafts, sampled)] + [sampled[len(drafts)]]

    monkeypatch.setattr(verification.Verification, "resolve", keep_all)
    seconds, p2, _, _, _ = _verified_samples(model)
    keys = sorted(p2)
    assert _chi_squared_p([seconds.count(k) for k in keys], [p2[k] * len(seconds) for k in keys]) < 1e-6


@pytest.mark.parametrize("bad, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "unknown method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": 17}, r"\[1, 16\]"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_model": "x"}, "unknown keys"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "draft_model", "model": "self", "num_speculative_tokens": 2}, "needs a 'quantization'"),
    ({"method": "draft_model", "model": "self", "quantization": "fp8", "num_speculative_tokens": 2}, "quantization must"),
    ("{not json", "not JSON"),
])
def test_bad_configurations_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(bad)


def test_engine_refusals(model):
    with pytest.raises(ValueError, match="vocabulary"):
        _engine(model, _draft_config(), draft_model=tiny_model(vocab_size=300))
    with pytest.raises(ValueError, match="needs the draft model"):
        _engine(model, _draft_config())
    plain, spec = _engine(model), _engine(model, NGRAM)
    with pytest.raises(ValueError, match="not configured"):
        plain.add_request("a", [1, 2], SamplingParams(max_tokens=2), RequestOptions(num_speculative_tokens=2))
    with pytest.raises(ValueError, match="at most 4"):
        spec.add_request("a", [1, 2], SamplingParams(max_tokens=2), RequestOptions(num_speculative_tokens=5))


def test_a_draft_models_kv_pool_must_fit_beside_the_engines(model, draft, monkeypatch):
    """Both pools are checked against the memory available before either is allocated: one byte short is refused
    with the figures, the exact fit builds (the figures are the pools' allocated sizes)."""
    from model.loaders import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: None)  # (cannot be read: not checked)
    engine = _engine(model, _draft_config(), draft_model=draft)
    pools = engine.cache.nbytes + engine.drafter._propose.__self__.cache.nbytes
    assert engine.drafter._propose.__self__.cache.nbytes > 0
    monkeypatch.setattr(memory, "available_bytes", lambda: pools - 1)
    with pytest.raises(MemoryError, match=r"the KV pools need .* the draft model's .* GiB is available"):
        _engine(model, _draft_config(), draft_model=draft)
    with pytest.raises(MemoryError):  # twice the blocks: twice both pools
        _engine(model, _draft_config(), draft_model=draft, num_blocks=256)
    monkeypatch.setattr(memory, "available_bytes", lambda: pools)
    _engine(model, _draft_config(), draft_model=draft)
    monkeypatch.setattr(memory, "available_bytes", lambda: 0)
    _engine(model, NGRAM)  # no draft model: the engine's pool is the load's to check (reserve_bytes)
