"""The structured-output benchmarks end to end at tiny sizes: every number they report is there and sane, and
every phase of bench_structured did the same amount of model work (each request ran to max_tokens)."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.slow  # loads the default model; a minute or so on 2 shared cores


def test_bench_structured_quick(tmp_path):
    from benchmarks.bench_structured import main

    out = tmp_path / "r.json"
    r = main(["--rounds", "1", "--num-requests", "4", "--max-tokens", "4", "--single-max-tokens", "4",
              "--out", str(out)])
    assert json.loads(out.read_text())["ratios"] == r["ratios"]
    assert all(x["output_tokens"] == 4 for k, v in r["rounds"].items() if k.startswith("single") for x in v)
    assert all(x["output_tokens"] == 16 for k, v in r["rounds"].items() if k.startswith("concurrent") for x in v)
    assert all(math.isfinite(v) and v > 0 for v in r["ratios"].values())
    assert 0 < r["compile"]["schema_compile_ms_median"] < 5000 and r["compile"]["cached_compile_us"] > 0


def test_bench_grammar_engines_quick(tmp_path):
    from benchmarks.bench_grammar_engines import main

    r = main(["--rounds", "1", "--out", str(tmp_path / "g.json")])
    ll = r["engines"]["llguidance"]
    assert ll["compile_ms_median"] > 0 and ll["batch32"]["row_us_mean"] > 0  # every mask held the valid token
    assert "xgrammar" in r["engines"]  # measured where installed, else reported missing
