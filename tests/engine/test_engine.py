"""Engine: paged cache == uncached forward; batched == alone; seeds, stops, aborts, preemption, prefix reuse."""

from __future__ import annotations

import random

import pytest
import torch

from model.engine import Engine, EngineConfig
from model.generate import generate
from model.engine.forward_context import ForwardContext
from model.engine.paged_cache import PagedKVCache, SeqSlice
from model.engine.sampling_params import SamplingParams
from model.engine.scheduler import QueueFullError, SchedulerOutput
from tiny import EOS


def _prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]], arrive_at: dict[str, int] | None = None,
        max_steps: int = 10_000) -> dict[str, dict]:
    """Drive the engine to completion; requests join at their `arrive_at` step (default 0)."""
    arrive_at = arrive_at or {}
    results: dict[str, dict] = {}
    step = 0
    pending = dict(requests)
    while pending or engine.has_unfinished():
        for rid in [r for r in pending if arrive_at.get(r, 0) <= step]:
            engine.add_request(rid, *pending.pop(rid))
        for out in engine.step():
            r = results.setdefault(out.request_id, {})
            c = r.setdefault(out.index, {"tokens": [], "text": "", "deltas": [], "logprobs": []})
            c["tokens"] += out.token_ids
            c["text"] += out.text
            c["deltas"].append(out.text)
            c["logprobs"] += out.logprobs or []
            if out.prompt_logprobs is not None:
                c["prompt_logprobs"] = out.prompt_logprobs
            if out.finished:
                c["finish_reason"], c["stop_reason"] = out.finish_reason, out.stop_reason
        step += 1
        assert step < max_steps
    return results


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def assert_pool_clean(engine: Engine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert all(c == 0 for c in engine.kv.pool.ref_count)
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests


# ---- 1. the paged cache computes what an uncached forward computes --------------------------------------------


def test_paged_cache_matches_uncached_forward(model):
    """Two sequences in scattered blocks: chunked prefill, then decode steps packed with the other's prefill."""
    bs = 4
    cache = PagedKVCache.for_model(model, num_blocks=32, block_size=bs)
    a, b = _prompts(1, seed=1, lo=23, hi=23)[0], _prompts(1, seed=2, lo=17, hi=17)[0]
    blocks = {"a": [7, 3, 30, 12, 5, 21, 9], "b": [1, 18, 25, 4, 27]}  # deliberately non-contiguous
    with torch.no_grad():
        full = {"a": model(torch.tensor([a]))[0], "b": model(torch.tensor([b]))[0]}  # (T, V)
    # steps: (seq, start, n) packed per step
    plan = [
        [("a", 0, 10)],
        [("a", 10, 9), ("b", 0, 6)],
        [("a", 19, 1), ("b", 6, 7)],
        [("a", 20, 1), ("b", 13, 1)],
        [("a", 21, 1), ("b", 14, 3)],
        [("a", 22, 1)],
    ]
    got = {"a": {}, "b": {}}
    seqs = {"a": a, "b": b}
    for step in plan:
        slices, tokens, positions, offset = [], [], [], 0
        for name, start, n in step:
            slices.append(SeqSlice(offset, n, start + n, blocks[name]))
            tokens += seqs[name][start : start + n]
            positions += range(start, start + n)
            offset += n
        ctx = ForwardContext.from_slices(cache, slices)
        with torch.no_grad():
            logits = model(torch.tensor([tokens]), torch.tensor([positions]), ctx)[0]  # (N, V)
        offset = 0
        for name, start, n in step:
            for j in range(n):
                got[name][start + j] = logits[offset + j]
            offset += n
    for name in ("a", "b"):
        assert sorted(got[name]) == list(range(len(seqs[name])))
        diff = (torch.stack([got[name][i] for i in range(len(seqs[name]))]) - full[name]).abs().max().item()
        assert diff <= 1e-4, (name, diff)


# ---- 2. batched == alone (greedy) -----------------------------------------------------------------------------


def _alone(model, prompts, max_tokens):
    return [list(generate(model, p, max_tokens)) for p in prompts]


@pytest.mark.parametrize(
    "name,config,arrivals",
    [
        ("together", EngineConfig(num_blocks=256, block_size=4), False),
        ("arrive-mid-run", EngineConfig(num_blocks=256, block_size=4), True),
        ("chunked-prefill", EngineConfig(num_blocks=256, block_size=4, max_num_batched_tokens=7), True),
        ("few-seq-slots", EngineConfig(num_blocks=256, block_size=8, max_num_seqs=3), True),
        ("preemption", EngineConfig(num_blocks=24, block_size=4, max_num_batched_tokens=32), False),
    ],
)
def test_batched_equals_alone(model, tok, name, config, arrivals):
    prompts = _prompts(10, seed=3)
    ref = _alone(model, prompts, 16)
    engine = Engine(model, tok, config)
    reqs = {str(i): (p, greedy(16)) for i, p in enumerate(prompts)}
    arrive = {str(i): (3 * i if arrivals else 0) for i in range(len(prompts))}
    res = run(engine, reqs, arrive)
    assert [res[str(i)][0]["tokens"] for i in range(len(prompts))] == ref
    assert all(res[str(i)][0]["finish_reason"] == "length" for i in range(len(prompts)))
    if name == "preemption":
        assert engine.scheduler.num_preemptions > 0
    assert_pool_clean(engine)


def test_shared_prefix_blocks_are_reused(model, tok):
    system = _prompts(1, seed=4, lo=24, hi=24)[0]
    prompts = [system + p for p in _prompts(6, seed=5, lo=1, hi=9)]
    ref = _alone(model, prompts, 12)
    engine = Engine(model, tok, EngineConfig(num_blocks=128, block_size=4))
    first = run(engine, {"0": (prompts[0], greedy(12))})
    rest = run(engine, {str(i): (p, greedy(12)) for i, p in enumerate(prompts) if i})
    res = {**first, **rest}
    assert [res[str(i)][0]["tokens"] for i in range(len(prompts))] == ref
    stats = engine.stats()
    assert stats.prefix_cache_hits >= 5 * 24  # every later prompt found the 24-token prefix (6 blocks) cached
    assert_pool_clean(engine)


def test_prefix_cache_reports_cached_tokens(model, tok):
    engine = Engine(model, tok, EngineConfig(num_blocks=64, block_size=4))
    p = _prompts(1, seed=6, lo=21, hi=21)[0]
    engine.add_request("a", p, greedy(2))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    engine.add_request("b", p, greedy(2))
    while engine.has_unfinished():
        outs += engine.step()
    cached = {o.request_id: o.num_cached_tokens for o in outs}
    assert cached == {"a": 0, "b": 20}  # 5 full blocks of the 21-token prompt


# ---- 3. seeded sampling is independent of the batch -----------------------------------------------------------


def test_seeded_request_same_alone_and_in_a_crowd(model, tok):
    prompt = _prompts(1, seed=7, lo=12, hi=12)[0]
    params = lambda: SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = run(Engine(model, tok, EngineConfig(num_blocks=128, block_size=4)), {"x": (prompt, params())})["x"][0]
    crowd = {f"n{i}": (p, SamplingParams(max_tokens=15, temperature=1.0, seed=None if i % 2 else i, ignore_eos=True))
             for i, p in enumerate(_prompts(12, seed=8))}
    crowd["x"] = (prompt, params())
    engine = Engine(model, tok, EngineConfig(num_blocks=128, block_size=4, max_num_batched_tokens=24))
    res = run(engine, crowd, {"x": 2})
    assert res["x"][0]["tokens"] == alone["tokens"] and res["x"][0]["text"] == alone["text"]
    other = run(Engine(model, tok, EngineConfig(num_blocks=128, block_size=4)),
                {"y": (prompt, SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=99, ignore_eos=True))})
    assert other["y"][0]["tokens"] != alone["tokens"]


def test_n_choices_share_prompt_blocks_and_differ(model, tok):
    prompt = _prompts(1, seed=9, lo=33, hi=33)[0]
    engine = Engine(model, tok, EngineConfig(num_blocks=128, block_size=4))
    res = run(engine, {"r": (prompt, SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=5, ignore_eos=True))})
    choices = [res["r"][i]["tokens"] for i in range(3)]
    assert all(len(c) == 10 for c in choices) and len({tuple(c) for c in choices}) == 3
    assert engine.stats().prefix_cache_hits == 2 * 32  # choices 1 and 2 reused the 8 full prompt blocks
    assert_pool_clean(engine)


# ---- 4. stop strings -----------------------------------------------------------------------------------------


ASCII_ONLY = {t: -100.0 for t in range(128, 256)}  # keep the random model's bytes printable ASCII


def test_stop_string_across_tokens_stops_exactly(model, tok):
    prompt = tok.encode("Once upon a time")
    base = run(Engine(model, tok, EngineConfig(num_blocks=64, block_size=4)),
               {"a": (prompt, greedy(40, logit_bias=ASCII_ONLY))})["a"][0]["text"]
    assert len(base) == 40 and base.isascii()
    stop = base[17:21]  # four single-byte tokens: the stop string spans token boundaries
    cut = base.find(stop)
    res = run(Engine(model, tok, EngineConfig(num_blocks=64, block_size=4)),
              {"b": (prompt, greedy(40, logit_bias=ASCII_ONLY, stop=["zzzz-never", stop]))})["b"][0]
    assert res["text"] == base[:cut]
    assert res["finish_reason"] == "stop" and res["stop_reason"] == stop
    # no streamed delta ever carried text past the cut, not even a partial stop string
    streamed = ""
    for d in res["deltas"]:
        streamed += d
        assert base[:cut].startswith(streamed)


def test_stop_token_ids_and_eos(model, tok):
    prompt = tok.encode("abc")
    base = run(Engine(model, tok, EngineConfig(num_blocks=64, block_size=4)), {"a": (prompt, greedy(20))})["a"][0]
    target = base["tokens"][5]
    res = run(Engine(model, tok, EngineConfig(num_blocks=64, block_size=4)),
              {"b": (prompt, greedy(20, stop_token_ids=[target]))})["b"][0]
    cut = base["tokens"].index(target)
    assert res["tokens"] == base["tokens"][: cut + 1] and res["stop_reason"] == target
    # EOS stops unless ignore_eos; min_tokens holds it off
    eos_bias = {EOS: 100.0}
    r = run(Engine(model, tok, EngineConfig(num_blocks=64, block_size=4)), {
        "eos": (prompt, SamplingParams(max_tokens=10, temperature=0, logit_bias=eos_bias)),
        "min": (prompt, SamplingParams(max_tokens=10, temperature=0, logit_bias=eos_bias, min_tokens=4)),
        "ign": (prompt, SamplingParams(max_tokens=10, temperature=0, logit_bias=eos_bias, ignore_eos=True)),
    })
    assert r["eos"][0]["tokens"] == [EOS] and r["eos"][0]["finish_reason"] == "stop" and r["eos"][0]["text"] == ""
    assert len(r["min"][0]["tokens"]) == 5 and EOS not in r["min"][0]["tokens"][:4] and r["min"][0]["tokens"][4] == EOS
    assert r["ign"][0]["tokens"] == [EOS] * 10 and r["ign"][0]["finish_reason"] == "length"


# ---- 5. aborts free everything -------------------------------------------------------------------------------


def test_random_requests_and_aborts_leak_nothing(model, tok):
    rng = random.Random(11)
    engine = Engine(model, tok, EngineConfig(num_blocks=40, block_size=4, max_num_batched_tokens=24, max_num_seqs=8))
    prompts = _prompts(200, seed=12, hi=30)
    submitted = finished = aborted = 0
    live: list[str] = []
    step = 0
    while submitted < 200 or engine.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if submitted < 200:
                n = rng.choice([1, 1, 1, 2, 3])
                params = SamplingParams(n=n, max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 1.0]),
                                        seed=rng.randrange(100), ignore_eos=rng.random() < 0.5,
                                        logprobs=rng.choice([None, 2]))
                engine.add_request(f"r{submitted}", prompts[submitted], params)
                live.append(f"r{submitted}")
                submitted += 1
        if live and rng.random() < 0.3:
            rid = live.pop(rng.randrange(len(live)))
            aborted += bool(engine.abort(rid))
        for out in engine.step():
            finished += out.finished
        live = [r for r in live if r in engine.requests]
        step += 1
        assert step < 5000
    assert aborted > 20
    assert_pool_clean(engine)


# ---- 6 & limits ----------------------------------------------------------------------------------------------


def test_queue_limit_and_invalid_requests(model, tok):
    engine = Engine(model, tok, EngineConfig(num_blocks=16, block_size=4, max_waiting=3))
    for i in range(3):
        engine.add_request(str(i), [1, 2, 3], greedy(2))
    with pytest.raises(QueueFullError):
        engine.add_request("3", [1, 2, 3], greedy(2))
    with pytest.raises(ValueError, match="exceeds the context length of 64"):  # the pool's 16 x 4 tokens
        engine.add_request("long", [1] * 60, greedy(20))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], greedy(2))
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 258\)"):
        engine.add_request("oov", [300], greedy(2))
    run(engine, {})
    assert_pool_clean(engine)


def test_failing_step_fails_only_its_requests(model, tok, monkeypatch):
    engine = Engine(model, tok, EngineConfig(num_blocks=64, block_size=4))
    engine.add_request("doomed", [5, 6, 7], greedy(8))
    calls = {"n": 0}

    def flaky(scheduled):  # the engine's fault hook: the second step fails as a failing forward would
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")

    engine.step_fault_hook = flaky
    outs = engine.step() + engine.step()
    assert outs[-1].finish_reason == "error" and "RuntimeError" in outs[-1].error
    engine.step_fault_hook = None
    res = run(engine, {"fine": ([5, 6, 7], greedy(8))})
    assert res["fine"][0]["tokens"] == list(generate(model, [5, 6, 7], 8))
    assert_pool_clean(engine)


def test_logprobs_and_prompt_logprobs_match_full_forward(model, tok):
    prompt = _prompts(1, seed=13, lo=14, hi=14)[0]
    engine = Engine(model, tok, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=5))  # chunked
    res = run(engine, {"e": (prompt, greedy(6, logprobs=3, prompt_logprobs=2))})["e"][0]
    seq = prompt + res["tokens"]
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([seq]))[0].float(), dim=-1)  # (T, V)
    pl = res["prompt_logprobs"]
    assert len(pl) == len(prompt) and pl[0] is None
    for j in range(1, len(prompt)):
        assert pl[j].token_id == prompt[j]
        assert abs(pl[j].logprob - full[j - 1, prompt[j]].item()) <= 1e-4
        assert [t for t, _ in pl[j].top] == full[j - 1].topk(2).indices.tolist()
    for i, lp in enumerate(res["logprobs"]):
        pos = len(prompt) - 1 + i
        assert lp.token_id == res["tokens"][i] and lp.rank == 1  # greedy picks the top token
        assert abs(lp.logprob - full[pos, lp.token_id].item()) <= 1e-4
        assert len(lp.top) == 3


def _check_prompt_logprobs(model, prompt, pl) -> None:
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([prompt]))[0].float(), dim=-1)  # (T, V)
    assert len(pl) == len(prompt) and pl[0] is None
    for j in range(1, len(prompt)):
        assert pl[j].token_id == prompt[j], f"position {j} scores the wrong token"
        assert abs(pl[j].logprob - full[j - 1, prompt[j]].item()) <= 1e-4, f"position {j}"


def test_prompt_logprobs_stay_aligned_when_the_first_admission_fails_on_kv(model, tok, monkeypatch):
    """The prompt is in the prefix cache, and the request's first admission attempt finds no free block: the
    retry must still compute (not take from the cache) every prompt position it has not scored yet."""
    prompt = _prompts(1, seed=21, lo=17, hi=17)[0]
    engine = Engine(model, tok, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64))
    run(engine, {"warm": (prompt, greedy(2))})  # the prompt's full blocks are now cached
    real, failed = engine.kv.allocate, []

    def allocate(seq, n):
        if seq.request.request_id == "pl" and not failed:
            failed.append(seq)
            return False  # cache pressure at the first attempt
        return real(seq, n)

    monkeypatch.setattr(engine.kv, "allocate", allocate)
    other = _prompts(1, seed=23, lo=5, hi=5)[0]  # keeps the batch busy while "pl" waits for blocks
    res = run(engine, {"other": (other, greedy(4)), "pl": (prompt, greedy(2, prompt_logprobs=1))})["pl"][0]
    assert failed
    _check_prompt_logprobs(model, prompt, res["prompt_logprobs"])


def test_prompt_logprobs_stay_aligned_across_a_preemption(model, tok):
    """Preempted after its first prefill chunk, with the rest of its prompt cached by an earlier request: on
    re-admission the cache may serve only what was already scored."""
    prompt = _prompts(1, seed=22, lo=24, hi=24)[0]
    engine = Engine(model, tok, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8))  # 8-token chunks
    run(engine, {"warm": (prompt, greedy(2))})
    engine.add_request("pl", prompt, greedy(2, prompt_logprobs=1))
    outs = engine.step()  # the first chunk: positions 0..7
    seq = engine.requests["pl"].seqs[0]
    assert seq.num_computed_tokens == 8 and not outs
    engine.scheduler.running.remove(seq)
    engine.scheduler._preempt(seq, SchedulerOutput())  # as the scheduler does when it runs out of blocks
    res = run(engine, {})
    _check_prompt_logprobs(model, prompt, res["pl"][0]["prompt_logprobs"])


def test_scheduled_time_is_the_first_admission(model, tok):
    """`RequestOutput.scheduled_time` (where a request trace's time in the queue ends): the scheduler's first
    admission of the choice, before its first token; a request waiting for the one sequence slot is admitted after
    the one ahead of it produced its tokens; a preemption keeps the first admission's stamp."""
    engine = Engine(model, tok, EngineConfig(num_blocks=64, block_size=4, max_num_seqs=1))
    engine.add_request("a", [1, 2, 3], greedy(3))
    engine.add_request("b", [4, 5, 6], greedy(3))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    last = {o.request_id: o for o in outs if o.finished}
    a, b = last["a"], last["b"]
    assert a.scheduled_time <= a.first_token_time < b.scheduled_time <= b.first_token_time
    assert all(o.scheduled_time == last[o.request_id].scheduled_time for o in outs)

    prompt = _prompts(1, seed=23, lo=24, hi=24)[0]
    engine = Engine(model, tok, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8))
    engine.add_request("p", prompt, greedy(2))
    engine.step()  # the first prefill chunk
    seq = engine.requests["p"].seqs[0]
    admitted = seq.scheduled_time
    assert admitted is not None and seq.num_computed_tokens == 8
    engine.scheduler.running.remove(seq)
    engine.scheduler._preempt(seq, SchedulerOutput())  # as the scheduler does when it runs out of blocks
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert seq.num_preemptions == 1 and {o.scheduled_time for o in outs} == {admitted}
