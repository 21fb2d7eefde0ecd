"""benchmarks/gpu_check.py, the device check, without a device: `--dry-run` runs every check's CPU-side set-up (its
models, engines, subprocesses, the benchmark run and its reading) and must say DRY for each, none left out."""

from __future__ import annotations

import json

from benchmarks import gpu_check


def test_the_dry_run_runs_every_check(tmp_path, capsys):
    out = tmp_path / "gpu-check-dry-run.json"
    report = gpu_check.main(["--dry-run", "--out", str(out)])
    names = [name for name, _, _ in gpu_check.CHECKS]
    assert names == ["versions", "triton_kernels", "gpu_tests", "sync_free_decode", "overlap_equals_serial",
                     "graphs_equal_eager", "lora_interventions_graphs", "long_context_decode", "decode_benchmark"]
    on_disk = json.loads(out.read_text())
    assert list(on_disk["checks"]) == names and on_disk["dry_run"] is True
    failed = {n: c for n, c in on_disk["checks"].items() if c["verdict"] != "DRY"}
    assert not failed, failed
    lines = [line for line in capsys.readouterr().out.splitlines() if line[:4] in ("DRY ", "PASS", "FAIL")]
    assert [line.split()[1].rstrip(":") for line in lines] == names  # a verdict line per check, in order
    assert report["checks"]["gpu_tests"]["files"]  # the tests marked gpu were found (and collected)
    assert report["checks"]["versions"]["pin"] == report["checks"]["versions"]["torch"].split("+")[0]


def test_a_check_that_raises_fails_and_the_rest_still_run(tmp_path, monkeypatch, capsys):
    def broken(ctx):
        raise RuntimeError("CUDA error: an illegal memory access (simulated)")

    monkeypatch.setattr(gpu_check, "CHECKS", [("broken", broken, 1), ("versions", gpu_check.check_versions, 1)])
    report = gpu_check.main(["--dry-run", "--out", str(tmp_path / "r.json")])
    assert report["checks"]["broken"]["verdict"] == "FAIL" and "illegal memory access" in report["checks"]["broken"]["error"]
    assert report["checks"]["versions"]["verdict"] == "DRY"
    assert "FAIL broken: error=RuntimeError" in capsys.readouterr().out
