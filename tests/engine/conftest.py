"""The engine tests' models: one tiny random model (GQA, 2 layers, the byte tokenizer's vocabulary) and the same
shape at each precision the batch-invariant kernels serve."""

from __future__ import annotations

import pytest

from model.quantize import quantize_model
from tiny import PRECISIONS, byte_tokenizer, tiny_model


@pytest.fixture(scope="session")
def model():
    return tiny_model()


@pytest.fixture(scope="session")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module", params=PRECISIONS, ids=[p[0] for p in PRECISIONS])
def precision_model(request):
    """A tiny model at float32, bfloat16, int8 and int4 (a test runs once per precision)."""
    _, dtype, mode = request.param
    return quantize_model(tiny_model(seed=3, dtype=dtype), mode)
