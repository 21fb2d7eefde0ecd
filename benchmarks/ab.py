"""A/B: the same benchmark on two checkouts, run alternately in fresh processes, so both see the same machine.

    .venv/bin/python -m benchmarks.ab --base /path/to/old/checkout [--rounds 3] -- bench_decode --skip-hf --skip-llama-cpp
    .venv/bin/python -m benchmarks.ab --base /path/to/old/checkout -- bench_engine --skip-hf --quick

Each round runs the benchmark once in the base checkout and once in this one (the order alternates between
rounds), each as `python -m benchmarks.<name> --out <file> ...` with the checkout as the working directory (so its
own `model`, `benchmarks` and `service` packages are imported; it needs its own native kernels built:
`python -m model.kernels` there). It then prints, for every numeric figure both results share, the median of
each side, their ratio, and the spread between rounds of each side: a difference smaller than that spread is the
machine's run-to-run noise, not the change. The figures and the per-round values go to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _flatten(obj, prefix: str = "") -> dict[str, float]:
    """{"a": {"b": 1.0}} -> {"a.b": 1.0}: every number in a results JSON, by its path (lists by index)."""
    out: dict[str, float] = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        path = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[path] = float(v)
        elif isinstance(v, (dict, list)) and not (isinstance(v, list) and len(v) > 64):  # token id lists: skip
            out.update(_flatten(v, path))
    return out


def _run(checkout: Path, bench: str, args: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", f"benchmarks.{bench}", "--out", str(out), *args]
    # the checkout first (its own packages), then whatever the caller had (e.g. a peer such as llama-cpp-python)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH")) if p)}
    subprocess.run(cmd, cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True, help="the other checkout (e.g. a git worktree of the old commit)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--match", default="tok_s", help="report only figures whose path contains this (default: tok_s)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("bench", help="benchmark module under benchmarks/ (bench_decode, bench_engine, ...)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    a = p.parse_args(argv)
    args = [x for x in a.args if x != "--"]
    sides = {"base": a.base.resolve(), "this": HERE}
    runs: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = ["base", "this"] if r % 2 == 0 else ["this", "base"]
            for side in order:
                print(f"[ab] round {r + 1}/{a.rounds}: {side} ({sides[side]})", file=sys.stderr, flush=True)
                runs[side].append(_flatten(_run(sides[side], a.bench, args, Path(tmp) / f"{side}-{r}.json")))
    shared = sorted(set.intersection(*(set(x) for x in runs["base"] + runs["this"])))
    rows = {}
    for key in shared:
        if a.match not in key:
            continue
        b = [x[key] for x in runs["base"]]
        t = [x[key] for x in runs["this"]]
        mb, mt = statistics.median(b), statistics.median(t)
        rows[key] = {"base": mb, "this": mt, "ratio": mt / mb if mb else float("nan"),
                     "base_spread": (max(b) - min(b)) / mb if mb else float("nan"),
                     "this_spread": (max(t) - min(t)) / mt if mt else float("nan"), "base_runs": b, "this_runs": t}
    width = max((len(k) for k in rows), default=10)
    print(f"{'figure':<{width}}  {'base':>10} {'this':>10} {'ratio':>7} {'spread base/this':>18}")
    for key, v in rows.items():
        print(f"{key:<{width}}  {v['base']:10.2f} {v['this']:10.2f} {v['ratio']:7.3f} "
              f"{v['base_spread']:8.1%} / {v['this_spread']:.1%}")
    if a.out:
        from benchmarks.machine import machine_info

        a.out.write_text(json.dumps({"machine": machine_info("cpu", os.cpu_count() or 1), "base": str(sides["base"]),
                                     "bench": a.bench, "args": args, "rounds": a.rounds,
                                     "load_avg": list(os.getloadavg()), "figures": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
