"""--kv-cache-dtype over HTTP: a float32 model over a float16, bfloat16 or int8 KV cache says so in /v1/models with
the tokens its pool holds (twice the float32 cache's in the same --kv-cache-bytes for 16 bits; 2E / (E + 4) times
the 16-bit one's for int8, whose head rows carry a 4-byte scale), and answers through the `openai` client with
logprobs within the cache's rounding of the float32 cache's; a 16-bit or int8 cache under a bfloat16 model on CPU is
refused at start with the reason, and an unknown dtype by the settings."""

from __future__ import annotations

import openai
import pytest
from pydantic import ValidationError

from live_server import tiny_live_server
from model import kernels
from service.config import Settings
from service.main import create_app
from tiny import tiny_model

pytestmark = pytest.mark.skipif(kernels.native() is None, reason=f"native kernels: {kernels.status()}")


def _answer(live) -> tuple[dict, list[float], int]:
    info = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    r = info.completions.create(model="tiny", prompt="the cat sat on the mat; the cat", max_tokens=12, temperature=0,
                                logprobs=1)
    model = info.models.list().data[0].model_dump()
    return model, r.choices[0].logprobs.token_logprobs, live.app.state.server.stats.num_blocks


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_16_bit_cache_under_a_float32_model(dtype):
    model = tiny_model()
    settings = dict(kv_cache_bytes=1 << 22)
    with tiny_live_server(Settings(**settings), model=model) as live:
        model_info, reference, blocks = _answer(live)
    with tiny_live_server(Settings(kv_cache_dtype=dtype, **settings), model=model) as live:
        info16, got, blocks16 = _answer(live)
    assert model_info["kv_cache_dtype"] == "float32" and model_info["dtype"] == "float32"
    assert info16["kv_cache_dtype"] == dtype and info16["dtype"] == "float32"
    assert blocks16 == 2 * blocks
    assert model_info["kv_cache_tokens"] == 16 * blocks and info16["kv_cache_tokens"] == 16 * blocks16  # (block_size)
    # the first token's logprob reads the prompt's keys and values rounded to 16 bits: close, not equal
    assert got[0] == pytest.approx(reference[0], abs=0.05) and got[0] != reference[0]


def test_an_int8_cache_under_a_float32_model():
    model = tiny_model()  # head_dim 16: an int8 head row is 20 bytes against float16's 32
    settings = dict(kv_cache_bytes=1 << 22)
    with tiny_live_server(Settings(kv_cache_dtype="float16", **settings), model=model) as live:
        info16, reference, blocks16 = _answer(live)
    with tiny_live_server(Settings(kv_cache_dtype="int8", **settings), model=model) as live:
        info8, got, blocks8 = _answer(live)
    assert info8["kv_cache_dtype"] == "int8" and info8["dtype"] == "float32"
    assert info8["kv_cache_tokens"] == 16 * blocks8 and blocks8 == pytest.approx(blocks16 * 32 / 20, rel=1e-3)
    # int8's rounding (half a step: a row's largest entry / 254) against float16's: close, not equal
    assert got[0] == pytest.approx(reference[0], abs=0.1) and got[0] != reference[0]


@pytest.mark.parametrize("kv", ["float16", "int8"])
def test_refused_where_the_cache_cannot_be_read_under_bfloat16_on_cpu(kv):
    state = create_app(Settings(dtype="bfloat16", kv_cache_dtype=kv)).state.server
    state.start()  # what the app's start-up runs
    assert state.engine is None and f"kv_cache_dtype {kv} with a bfloat16 model" in state.load_error
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        Settings(kv_cache_dtype="fp8")
