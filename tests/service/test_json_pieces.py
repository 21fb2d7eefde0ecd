"""A response built in bounded pieces (service/microscope/json_pieces.py) and as slices of an engine-thread job
(`ThenRespond`): byte for byte what one `json.dumps` makes (non-finite floats null, `usage.response_bytes` the
body's own length across a change in its digits), with no piece larger than its bound, and the job stepping one
unit per slice when its budget is spent."""

from __future__ import annotations

import json
import random

from service.microscope.json_pieces import CHUNK, SMALL, STRING_CHUNK, drain, dumps_with_size_steps, nan_to_none, pieces
from service.microscope.probing import ThenRespond


def reference(x) -> str:
    return json.dumps(x, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def random_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 2 or r < 0.3:
        return rng.choice([0, -7, 2**40, 3.25, 1e-7, 0.1 + 0.2, True, False, None, "", 'q"b\\s\n\t\x01',
                           "caf\u00e9 \u4e2d \U0001f600"])
    if r < 0.65:
        n = rng.choice([0, 1, 2, SMALL, SMALL + 1, 2 * CHUNK + 3] if depth == 0 else [0, 1, 3, SMALL, SMALL + 1])
        return [random_value(rng, depth + 1) for _ in range(n)]
    return {f"k{i}\u00e9": random_value(rng, depth + 1) for i in range(rng.choice([0, 1, 5, SMALL + 2]))}


def test_pieces_join_to_json_dumps():
    rng = random.Random(0)
    for _ in range(60):
        x = random_value(rng)
        assert "".join(pieces(x)) == reference(x)
    odd = {"a": (1, 2.5, ("x", None)), "b": [[1, 2]] * (CHUNK + 1),
           "long": ['"\u00e9\\' * STRING_CHUNK, {"s": "x" * (STRING_CHUNK + 1)}]}
    assert "".join(pieces(odd)) == reference(odd)


def test_non_finite_floats_become_null():
    x = {"max_abs": float("inf"), "norm": [1.0, float("nan")] * CHUNK, "deep": [{"v": [float("-inf")] * (SMALL + 1)}]}
    assert "".join(pieces(x)) == reference(nan_to_none(x))
    assert json.loads("".join(pieces(x)))["deep"] == [{"v": [None] * (SMALL + 1)}]


def test_no_piece_is_larger_than_its_bound():
    """The bound is what keeps each unit of an engine-thread slice short: one json.dumps over at most CHUNK items of
    at most SMALL scalars, or STRING_CHUNK characters of a long string."""
    floats = [i / 7 for i in range(60 * CHUNK)]
    rows = [[i, i / 3] for i in range(10 * CHUNK)]
    tokens = [{"index": i, "id": i, "text": "t", "offset": [i, i + 1]} for i in range(10 * CHUNK)]
    big = "A" * (20 * STRING_CHUNK)
    body = {"floats": floats, "rows": rows, "tokens": tokens, "maps": {"data": big}}
    out = list(pieces(body))
    assert "".join(out) == reference(body)
    longest = max(len(reference(v)) for v in (floats[-1], rows[-1], tokens[-1]))
    assert max(len(p) for p in out) <= max(CHUNK * (longest + 1) + 1, STRING_CHUNK + 2)
    assert len(out) >= 60 + 10 + 10 + 20


def test_response_bytes_is_the_bodys_length_across_a_change_of_digits():
    for n in range(9930, 10010):  # bodies whose length crosses 10,000 bytes with its own digits
        body = {"id": "insp", "data": "x" * n, "usage": {"prompt_tokens": 3, "response_bytes": 0}, "after": [1.5]}
        data = drain(dumps_with_size_steps(body))
        size = json.loads(data)["usage"]["response_bytes"]
        assert size == len(data)
        assert data == reference({**body, "usage": {"prompt_tokens": 3, "response_bytes": size}}).encode()


class _Job:
    """A job that takes `steps` steps."""

    def __init__(self, steps: int) -> None:
        self.left = steps

    def step(self, budget_s: float) -> bool:
        self.left -= 1
        return self.left == 0


def test_then_respond_runs_the_job_then_one_unit_per_spent_budget():
    ran = []

    def respond():
        for i in range(5):
            ran.append(i)
            yield
        return b"done"

    job = ThenRespond(_Job(2), respond)
    assert job.step(0.0) is False and ran == []  # the job's first step
    assert job.step(0.0) is False and ran == [0]  # its last, then one unit in the same slice
    for n in range(1, 5):
        assert job.step(0.0) is False and ran == list(range(n + 1))
    assert job.step(0.0) is True and job.data == b"done" and job.units == 5
    whole = ThenRespond(_Job(1), respond)
    assert whole.step(60.0) is True and whole.data == b"done"  # a budget that covers everything: one slice
