"""Is a server at full speed when /health first says ready? A single stream timed right after ready against the same
stream a minute later, on a fresh server each round.

    python -m benchmarks.ready_speed --rounds 3 --out benchmarks/results/ready-speed.json
    python -m benchmarks.ready_speed --root . --root /path/to/other/checkout   # two checkouts, alternating

Each round starts `python -m service` (the default model unless `--model`), waits for /health 200 (asked every
50 ms), and at once runs `--streams` single-stream greedy completions back to back (a 128-token prompt, 64 new
tokens, decode tok/s from the first token chunk to the last, as `benchmarks.vs_llama_server` times one); then
waits until `--later-s` seconds after ready and runs the same streams again. What it reports per checkout: the
medians of the first and of the later streams over all rounds, and their ratio (first / later, per round and the
median): a server whose background start-up work (the KV pool made resident, the weights moved onto 2 MB pages:
model/huge_pages.py) still runs when it says ready decodes its first streams slower than its later ones.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.load import ServedProcess
from benchmarks.machine import machine_info
from benchmarks.vs_llama_server import NEW_TOKENS, single_stream

ROOT = Path(__file__).resolve().parents[1]


class Checkout(ServedProcess):
    """`python -m service` of the checkout at `root` (its own sources first on the path)."""

    def __init__(self, root: Path, args: list[str], log_path: Path) -> None:
        self.port = self.free_port()
        self.root = root
        started = time.perf_counter()
        self.start([sys.executable, "-m", "service", "--port", str(self.port), *args], log_path,
                   {"PYTHONPATH": str(root)})
        self.load_s = time.perf_counter() - started

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def streams(url: str, n: int, vocab: int, seed: int) -> list[float]:
    return [single_stream(url, vocab, seed + i)["decode_tok_s"] for i in range(n)]


def run(args: argparse.Namespace) -> dict:
    roots = [Path(r).resolve() for r in (args.root or [str(ROOT)])]
    server_args = (["--model", args.model] if args.model else []) + args.server_args.split()
    results: dict[str, dict] = {str(r): {"first": [], "later": [], "ratios": [], "load_s_rounds": []} for r in roots}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            order = roots if rnd % 2 == 0 else roots[::-1]
            for root in order:
                r = results[str(root)]
                server = Checkout(root, server_args, Path(tmp) / f"server-{rnd}.log")
                ready = time.monotonic()
                try:
                    first = streams(server.url, args.streams, args.vocab, 100 * rnd)
                    first_end = time.monotonic() - ready
                    time.sleep(max(0.0, args.later_s - (time.monotonic() - ready)))
                    later = streams(server.url, args.streams, args.vocab, 100 * rnd)
                finally:
                    code = server.stop()
                ratio = statistics.median(first) / statistics.median(later)
                r["first"] += first
                r["later"] += later
                r["ratios"].append(ratio)
                r["load_s_rounds"].append(server.load_s)
                print(f"round {rnd + 1} {root}: ready in {server.load_s:.1f} s; first {len(first)} streams (done "
                      f"{first_end:.1f} s after ready) {', '.join(f'{x:.1f}' for x in first)} tok/s; after "
                      f"{args.later_s:.0f} s {', '.join(f'{x:.1f}' for x in later)}; first / later {ratio:.3f}; "
                      f"exit {code}", flush=True)
    summary = {root: {"first_tok_s": statistics.median(r["first"]), "later_tok_s": statistics.median(r["later"]),
                      "first_over_later": statistics.median(r["ratios"]),
                      "load_s": statistics.median(r["load_s_rounds"]), **r} for root, r in results.items()}
    return {"command": "python -m benchmarks.ready_speed " + " ".join(args.argv), "machine": machine_info("cpu", 0),
            "server_args": server_args, "streams": args.streams, "tokens": NEW_TOKENS, "later_s": args.later_s,
            "rounds": args.rounds, "checkouts": summary}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ready_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", action="append", help="a checkout to start (repeat for several; default: this one)")
    p.add_argument("--model", help="GGUF file or HF directory (default: the default model)")
    p.add_argument("--server-args", default="", help="more `python -m service` flags")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=3, help="single streams right after ready, and again later")
    p.add_argument("--later-s", type=float, default=60.0, help="seconds after ready of the later streams")
    p.add_argument("--vocab", type=int, default=49152, help="prompt ids are drawn below this")
    p.add_argument("--out", type=Path, help="write the JSON here")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    out = run(args)
    text = json.dumps(out, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    for root, s in out["checkouts"].items():
        print(f"{root}: first {s['first_tok_s']:.1f} tok/s, later {s['later_tok_s']:.1f}, first / later "
              f"{s['first_over_later']:.3f} (rounds {', '.join(f'{x:.3f}' for x in s['ratios'])}), ready in "
              f"{s['load_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
