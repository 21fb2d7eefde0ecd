"""Continuous arrivals in-process: requests arrive as a Poisson process while the engine steps, with mixed prompt and
output lengths; throughput and the latency percentiles a client would see (TTFT, inter-token latency).

    .venv/bin/python -m benchmarks.arrivals                              # the default model on CPU, 2 requests/s
    .venv/bin/python -m benchmarks.arrivals --rate 20 --duration 60 --device cuda --shape llama-2-7b --random-weights

Each request arrives at its time (the process's exponential gaps at `--rate` a second, seeded); its prompt is
uniform in [prompt_min, prompt_max] random token ids, its output uniform in [out_min, out_max] tokens (EOS
ignored). The engine is stepped in a loop, new arrivals added before each step as the clock passes them; a token
counts as produced when the step that returned it returns (with overlapped steps, one step after it was computed:
what a client sees). TTFT = first token - arrival; ITL = the gaps between a request's tokens. benchmarks/gpu.py runs
it for its models; `benchmarks/serve_throughput.py --arrivals` is the same workload over HTTP.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass

from model.engine import Engine
from model.engine.sampling_params import SamplingParams


@dataclass
class ArrivalWorkload:
    rate: float = 2.0  # requests a second
    duration: float = 30.0  # seconds of arrivals (the run then finishes what arrived)
    prompt_min: int = 16
    prompt_max: int = 512
    out_min: int = 8
    out_max: int = 256
    seed: int = 0


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile of xs, linear between the two nearest ranks (numpy's default); nan for none."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def run_arrivals(engine: Engine, w: ArrivalWorkload, vocab_size: int) -> dict:
    """Drive `engine` through workload `w`; a token counts when the step that returns it to the host returns."""
    rng = random.Random(w.seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(w.rate)
        if t >= w.duration:
            break
        prompt = [rng.randrange(10, vocab_size) for _ in range(rng.randint(w.prompt_min, w.prompt_max))]
        arrivals.append((t, prompt, rng.randint(w.out_min, w.out_max)))
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    itl: list[float] = []
    tokens = 0
    i, start = 0, time.perf_counter()
    while i < len(arrivals) or engine.has_unfinished():
        now = time.perf_counter() - start
        while i < len(arrivals) and arrivals[i][0] <= now:
            at, prompt, n = arrivals[i]
            rid = f"a{i}"
            engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            arrived[rid] = at
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[i][0] - (time.perf_counter() - start)))
            continue
        outs = engine.step()
        now = time.perf_counter() - start
        for out in outs:
            if not out.token_ids:
                continue
            tokens += len(out.token_ids)
            rid = out.request_id
            if rid not in first:
                first[rid] = now
            else:
                itl.append((now - last[rid]) / len(out.token_ids))
            last[rid] = now
    wall = time.perf_counter() - start
    ttft = [first[r] - arrived[r] for r in first]
    return {"requests": len(arrivals), "output_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "ttft_ms": {f"p{q}": percentile(ttft, q) * 1e3 for q in (50, 90, 99)},
            "itl_ms": {f"p{q}": percentile(itl, q) * 1e3 for q in (50, 90, 99)},
            "workload": vars(w)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.arrivals", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    p.add_argument("--shape", default=None, help="a KNOWN_SHAPES entry with random weights instead of --model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--rate", type=float, default=ArrivalWorkload.rate)
    p.add_argument("--duration", type=float, default=ArrivalWorkload.duration)
    p.add_argument("--prompt-max", type=int, default=ArrivalWorkload.prompt_max)
    p.add_argument("--out-max", type=int, default=ArrivalWorkload.out_max)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import torch

    from model.engine import EngineConfig
    from model.loaders.checkpoint import load_model

    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if a.shape:
        from model.config import KNOWN_SHAPES
        from model.loaders.checkpoint import default_model_path
        from model.text.tokenizer import Tokenizer
        from model.transformer import Transformer

        with torch.device(device):
            model = Transformer(KNOWN_SHAPES[a.shape]).to(dtype).eval().requires_grad_(False)
        for prm in model.parameters():
            prm.data.normal_(0, 0.02)
        tokenizer = Tokenizer.from_gguf(default_model_path())
    else:
        loaded = load_model(a.model, dtype, device, a.quantization if device.type == "cpu" else "none")
        model, tokenizer = loaded.model, loaded.tokenizer
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=2048))
    w = ArrivalWorkload(rate=a.rate, duration=a.duration, prompt_max=a.prompt_max, out_max=a.out_max)
    result = run_arrivals(engine, w, min(model.config.vocab_size, tokenizer.vocab_size))
    text = json.dumps(result, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
