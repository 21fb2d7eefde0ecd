"""benchmarks/tp_gpu.py's CPU/gloo path at toy sizes: it runs TP=1 and TP=2 and finds the same greedy tokens."""

from __future__ import annotations

import json
import math

from benchmarks.tp_gpu import main


def test_tiny_gloo_run(tmp_path, capsys):
    out = tmp_path / "tp.json"
    r = main(["--tp", "2", "--tiny", "--device", "cpu", "--batch", "3", "--prompt-len", "8", "--max-tokens", "6",
              "--kv-cache-mb", "4", "--out", str(out)])
    assert r["greedy_tokens_equal"] and json.loads(out.read_text())["tp"] == 2
    assert r["agreement"]["agree"] and r["agreement"]["first_divergence"] is None  # float32: every token equal
    for side in ("tp1", "tp2"):
        assert math.isfinite(r[side]["decode_tok_s"]) and r[side]["decode_tok_s"] > 0
        assert r[side]["decode_graphs"] is False  # like with like: both sides eager
    assert "skipped" in r["graphs"]  # no decode graphs on CPU, so no graphs pair
    assert r["tp2"]["rank0_parameter_mb"] < r["tp1"]["rank0_parameter_mb"]
    assert "TP=2" in capsys.readouterr().out
