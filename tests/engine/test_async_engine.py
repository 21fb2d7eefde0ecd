"""AsyncEngine: streams from the engine thread, refuses beyond the queue limit, frees blocks on disconnect."""

from __future__ import annotations

import asyncio

import pytest

from model.engine.async_engine import AsyncEngine
from model.engine import Engine, EngineConfig
from model.generate import generate
from model.engine.sampling_params import SamplingParams
from model.engine.scheduler import QueueFullError
from tiny import byte_tokenizer, tiny_model


@pytest.fixture
def engine():
    model = tiny_model(seed=1)
    ae = AsyncEngine(Engine(model, byte_tokenizer(), EngineConfig(num_blocks=64, block_size=4, max_waiting=4, max_num_seqs=2)))
    ae.start()
    yield ae
    ae.stop()
    assert not ae.is_running


async def _collect(ae: AsyncEngine, prompt, params):
    outs = [o async for o in ae.generate(prompt, params)]
    return outs


def test_concurrent_streams_match_alone(engine):
    prompts = [[i + 1, 7, 9, 11 * i % 256] for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def main():
        return await asyncio.gather(*[_collect(engine, p, params) for p in prompts])

    results = asyncio.run(main())
    for prompt, outs in zip(prompts, results):
        assert [t for o in outs for t in o.token_ids] == list(generate(engine.engine.model, prompt, 12))
        assert outs[-1].finish_reason == "length" and sum(o.num_output_tokens > 0 for o in outs) == 12
        text = "".join(o.text for o in outs)
        assert text == engine.engine.tokenizer.decode([t for o in outs for t in o.token_ids])


def test_invalid_and_queue_full_are_raised_before_streaming(engine):
    async def main():
        with pytest.raises(ValueError, match="exceeds the context length"):
            await _collect(engine, [1] * 500, SamplingParams(max_tokens=100))
        # a burst of 10 against 2 running slots + 4 waiting places: at least 4 are refused at once
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        results = await asyncio.gather(*[_collect(engine, [1, 2, 3], params) for _ in range(10)], return_exceptions=True)
        return results

    results = asyncio.run(main())
    refused = [r for r in results if isinstance(r, QueueFullError)]
    served = [r for r in results if isinstance(r, list)]
    assert len(refused) >= 4 and served and len(refused) + len(served) == 10
    assert all(r[-1].finish_reason == "length" for r in served)


def test_client_leaving_mid_stream_frees_blocks(engine):
    async def main():
        agen = engine.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        got = 0
        async for out in agen:
            got += len(out.token_ids)
            if got >= 3:
                break
        await agen.aclose()
        for _ in range(100):  # the abort travels through the inbox to the engine thread
            await asyncio.sleep(0.02)
            if not engine.engine.has_unfinished():
                break

    asyncio.run(main())
    kv = engine.engine.kv
    assert kv.num_free_blocks == kv.num_blocks and not engine.engine.requests


def test_step_failure_reaches_the_client_and_engine_survives(engine, monkeypatch):
    # the engine's fault hook: the first step fails as a failing forward would, whichever path it was to take
    state = {"fail": True}

    def flaky(scheduled):
        if state["fail"]:
            state["fail"] = False
            raise RuntimeError("boom")

    monkeypatch.setattr(engine.engine, "step_fault_hook", flaky)

    async def main():
        first = await _collect(engine, [1, 2], SamplingParams(max_tokens=4))
        second = await _collect(engine, [1, 2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        return first, second

    first, second = asyncio.run(main())
    assert first[-1].finish_reason == "error" and "RuntimeError" in first[-1].error
    assert second[-1].finish_reason == "length" and len([t for o in second for t in o.token_ids]) == 4
