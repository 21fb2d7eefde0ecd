"""The engine's lifecycle never strands a client: stats are snapshots the engine thread publishes, every open stream
and pending submission ends when the engine thread ends (whatever ended it), a failing step still delivers the
outputs of the sequences it finished, and the prompts of one request are admitted together."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from model.engine.async_engine import AsyncEngine, EngineDeadError
from model.engine import Engine, EngineConfig
from model.loaders.checkpoint import LoadedModel
from model.engine.sampling_params import SamplingParams
from service.config import Settings
from service.main import create_app
from tiny import byte_tokenizer, tiny_model

TIMEOUT = 20  # seconds: a stranded client fails the test instead of hanging it


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def _loaded(seed: int = 0) -> LoadedModel:
    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return LoadedModel(tiny_model(seed=seed), tok, Path("tiny"), "tiny", 0.0)


def test_metrics_scrapes_read_a_snapshot_published_by_the_engine_thread(monkeypatch):
    """/metrics never walks the engine's live dicts from the event loop (a scrape racing the engine thread could
    raise "dictionary changed size during iteration"): Engine.stats() runs on the engine thread only."""
    threads: list[str] = []
    real = Engine.stats

    def spy(self):
        threads.append(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(Engine, "stats", spy)
    with TestClient(create_app(Settings(), loaded=_loaded(), wait_ready=True)) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200
        threads.clear()
        for _ in range(5):
            m = client.get("/metrics")
            assert m.status_code == 200 and "llamascope_num_requests_running" in m.text
    assert set(threads) <= {"llamascope-engine"}


def _async_engine(**config) -> AsyncEngine:
    cfg = {"num_blocks": 64, "block_size": 4, "max_num_seqs": 4, **config}
    ae = AsyncEngine(Engine(tiny_model(seed=1), byte_tokenizer(), EngineConfig(**cfg)))
    ae.start()
    return ae


async def _drain(stream) -> list:
    return [o async for o in stream]


def test_engine_thread_ending_outside_a_step_ends_every_stream(monkeypatch):
    """An exception outside `step()` (here: the loop's own bookkeeping) ends the engine thread: the open stream, a
    submission not yet seen by the thread and a queued inspection job all end with EngineDeadError, and the
    engine reports it is not running (the service's /health turns 503 on that)."""
    ae = _async_engine()
    died: list[BaseException | None] = []
    ae.on_dead = died.append

    class Job:
        def step(self, budget_s: float) -> bool:
            return False  # never finishes by itself

    async def main():
        stream = ae.generate([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
        first = await stream.__anext__()
        assert first.token_ids
        monkeypatch.setattr(ae.engine, "has_unfinished", _raise)  # the loop's next check raises
        job = asyncio.ensure_future(ae.run_job(Job()))
        rest = asyncio.ensure_future(_drain(stream))
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(rest, TIMEOUT)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(job, TIMEOUT)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_drain(ae.generate([4, 5], SamplingParams(max_tokens=2))), TIMEOUT)

    asyncio.run(main())
    assert not ae.is_running
    assert len(died) == 1 and isinstance(died[0], RuntimeError)


def _raise(*_a, **_k):
    raise RuntimeError("injected: outside any step")


def test_stop_ends_open_streams():
    ae = _async_engine()

    async def main():
        stream = ae.generate([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        rest = asyncio.ensure_future(_drain(stream))
        await asyncio.to_thread(ae.stop)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(rest, TIMEOUT)

    asyncio.run(main())
    assert not ae.is_running


def test_health_turns_503_when_the_engine_thread_dies(monkeypatch):
    app = create_app(Settings(), loaded=_loaded(), wait_ready=True)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        engine = app.state.server.engine
        monkeypatch.setattr(engine.engine, "has_unfinished", _raise)
        engine._wake.set()
        for _ in range(200):
            if not engine.is_running:
                break
            threading.Event().wait(0.05)
        h = client.get("/health")
        assert h.status_code == 503 and "engine" in h.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503


def test_a_step_failing_after_some_sequences_finished_still_delivers_their_outputs(monkeypatch):
    """Sequence A finishes in a step (its last token), then B's output processing fails in the same step: A's final
    output must still reach its client; B ends with an error."""
    engine = Engine(tiny_model(seed=2), byte_tokenizer(), EngineConfig(num_blocks=64, block_size=4))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=1, ignore_eos=True))
    engine.add_request("b", [4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True))
    b_detok = engine.requests["b"].seqs[0].output.detok

    def broken(_token):
        raise RuntimeError("injected: detokenizer failure")

    monkeypatch.setattr(b_detok, "feed", broken)
    finals = {}
    for _ in range(10):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert finals["a"].finish_reason == "length" and finals["a"].error is None
    assert finals["b"].finish_reason == "error"
    assert not engine.has_unfinished() and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_the_prompts_of_one_request_are_admitted_in_the_same_step():
    """A completions request with several prompts submits them all at once, so they prefill together."""
    app = create_app(Settings(max_num_batched_tokens=512), loaded=_loaded(), wait_ready=True)
    steps: list[set[str]] = []
    with TestClient(app) as client:
        engine = app.state.server.engine
        engine.step_hooks.append(lambda _stats, step, _s: steps.append({s.request.request_id for s in step.seqs}))
        prompts = [[10 + i, 11, 12, 13] for i in range(4)]
        r = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200
    first = next(s for s in steps if s)
    assert len(first) == 4, steps


def test_max_model_len_is_clamped_to_what_the_kv_pool_holds():
    """A pool smaller than the model's context: the server clamps max_model_len to the pool at start-up and shows
    it, so a request without max_tokens is served instead of refused for a limit the user could not fix."""
    loaded = _loaded()
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # K and V x layers x block_size x KV heads x head_dim x float32 bytes
    app = create_app(Settings(kv_cache_bytes=8 * per_block, block_size=16), loaded=loaded, wait_ready=True)
    with TestClient(app) as client:
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 8 * 16
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"


def test_an_explicit_max_model_len_beyond_the_pool_refuses_to_start():
    with pytest.raises(ValueError, match=r"max_model_len 400 .* 128 tokens"):
        Engine(tiny_model(), byte_tokenizer(), EngineConfig(num_blocks=8, block_size=16, max_model_len=400))


def test_an_inspection_of_a_long_prompt_leaves_decoding_at_least_half_its_rate():
    """An inspection runs on the engine thread between serving steps; with a long prompt one whole block of it
    takes many decode steps' time. Each job step is bounded by a share of a serving step, so a stream decoding
    meanwhile keeps at least half its rate: its mean time per token during the inspection is at most twice its mean
    time per token just before it and (a stream like it) just after it. Both sides are token gaps, measured the same
    way and in the same minute, so what else loads the machine (CI builds an image beside the suite) weighs on both;
    the serving step's own time would leave out the output thread's work and any descheduling that the gaps include."""
    from model.probes import ProbeOptions, ProbeRun

    import time

    model = tiny_model(seed=3, max_seq_len=4096, dim=256, hidden_dim=512, n_layers=4)
    ae = AsyncEngine(Engine(model, byte_tokenizer(), EngineConfig(num_blocks=512, block_size=16)))
    # A timing test on two cores: no page work in the background while it measures (this engine's KV pool being
    # faulted in, or what earlier tests' engines and loaded models left running: model/huge_pages.py's threads).
    for t in threading.enumerate():
        if t.name in ("populate", "collapse"):
            t.join()
    ae.start()
    long_prompt = [(7 * i) % 250 + 1 for i in range(3000)]
    around = 40  # tokens measured before the inspection, and after it

    async def main():
        stamps: list[float] = []
        stream = ae.generate([1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True))

        async def decode(stream, into: list[float]):
            async for _ in stream:
                into.append(time.perf_counter())

        decoding = asyncio.ensure_future(decode(stream, stamps))
        while len(stamps) < around + 5:
            await asyncio.sleep(0.01)
        run = ProbeRun(model, long_prompt, ProbeOptions(mode="none"))
        t0 = time.perf_counter()
        await asyncio.wait_for(ae.run_job(run), 300)
        t1 = time.perf_counter()
        decoding.cancel()
        after: list[float] = []  # the same stream's rate after it, from a stream of its own (the first may have ended)
        await decode(ae.generate([1, 2, 3], SamplingParams(max_tokens=around, ignore_eos=True)), after)
        return stamps, after, (t0, t1), run

    try:
        stamps, after, (t0, t1), run = asyncio.run(main())
    finally:
        ae.stop()
    assert run.done and run.result().layers
    during = [t for t in stamps if t0 <= t <= t1]
    before = [t for t in stamps if t < t0][-around:]
    assert len(during) >= 20, "the inspection was too short to measure against"

    def mean_gap(ts: list[float]) -> float:
        return (ts[-1] - ts[0]) / (len(ts) - 1)

    per_token = mean_gap(during)
    alone = (mean_gap(before) + mean_gap(after)) / 2
    assert per_token <= 2 * alone, (per_token, alone)


# A program that ends without stopping its engine: the interpreter's exit stops it and waits for its threads (an
# atexit function registered before the engine's module is imported runs after the engine's own), so no engine
# thread is left mid-step when the interpreter halts its daemon threads, and the program exits with its own status.
EXITS_WITHOUT_STOP = """
import atexit, sys
seen = {}
atexit.register(lambda: print(seen["engine"].is_running, seen["engine"]._thread.is_alive()))
sys.path.insert(0, "tests")
from model.engine import Engine, EngineConfig
from model.engine.async_engine import AsyncEngine
from tiny import byte_tokenizer, tiny_model
seen["engine"] = AsyncEngine(Engine(tiny_model(), byte_tokenizer(), EngineConfig(num_blocks=64, block_size=4)))
seen["engine"].start()
sys.exit(3)
"""


def test_a_program_ending_without_stop_stops_its_engine_first():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", EXITS_WITHOUT_STOP], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert (out.returncode, out.stdout.split()) == (3, ["False", "False"]), out.stderr
