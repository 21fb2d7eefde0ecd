"""Where a decode step's GPU time goes: torch.profiler over the static decoder's step (benchmarks/static_decode.py)
and over the engine's, for the default model's shape and the 7B's, random bfloat16 weights.

    python -m benchmarks.gpu_profile                 # on a CUDA machine: a table per model and path, ~1 minute
    .venv/bin/python -m benchmarks.gpu_profile --dry-run   # tiny stand-ins on CPU: the script's paths

The first H200 run (docs/performance.md, "GPU") left the 7B's graphed static decoder at 46% of the HBM ceiling and
the engine at 40%, and at 128 streams the engine at a third of the static decoder: these tables say which kernels
(the static decoder, eager so that each kernel is seen) and which host-side work (the engine's step, CPU time beside
CUDA time) take the rest; then the engine's decode steps by the wall clock, and under cProfile (its own Python per
step, which torch.profiler does not see). Printed, and written to --out as text.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import hf_peer
from benchmarks.gpu_sizing import stand_in_tokenizer
from benchmarks.static_decode import StaticDecoder
from model.config import KNOWN_SHAPES

SHAPES = ("llama-2-7b", "smollm2-135m")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tables(name, model, device: torch.device, args) -> str:
    """The static decoder's eager step at batch 1 and the engine's steps at `args.batch` streams, profiled: kernels
    (torch.profiler), the wall clock, and the host's Python (cProfile)."""
    from model.engine import Engine, EngineConfig
    from model.engine.sampling_params import SamplingParams

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len), device=device)
    out = []
    dec = StaticDecoder(model, 1, args.prompt_len + args.tokens + 8, False)
    dec.run(prompts[:1], 4)  # warm
    with profile(activities=acts) as prof:
        _, sec = dec.run(prompts[:1], args.tokens)
    out.append(f"== {name}: static decoder, eager, 1 stream: {(args.tokens - 1) / sec:.1f} tok/s\n"
               + prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=60))
    del dec
    blocks = args.batch * (-(-(args.prompt_len + args.tokens + 16) // 16)) + 8
    engine = Engine(model, stand_in_tokenizer(model.config.vocab_size),
                    EngineConfig(num_blocks=blocks, block_size=16, max_num_seqs=args.batch,
                                 max_num_batched_tokens=max(512, args.prompt_len), enable_prefix_caching=False))
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)

    def admit(tag: str) -> None:
        """Every stream's request added and prefilled, unprofiled: what follows are decode steps of every stream."""
        for i in range(args.batch):
            engine.add_request(f"{tag}{i}", prompts[i].tolist(), params)
        sched = engine.scheduler
        while engine.has_unfinished() and (sched.waiting or any(not s.output_token_ids for s in sched.running)):
            engine.step()

    admit("p")
    with profile(activities=acts) as prof:
        while engine.has_unfinished():
            engine.step()
    out.append(f"== {name}: engine, {args.batch} streams, decode steps\n"
               + prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=60))
    # The same decode steps by the wall clock (what the kernels' time above leaves to the host), then under cProfile:
    # the engine's own Python per step, which torch.profiler does not see.
    for tag, profiler in (("w", None), ("c", cProfile.Profile())):
        admit(tag)
        _sync(device)
        t0, steps = time.perf_counter(), 0
        if profiler is not None:
            profiler.enable()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        if profiler is not None:
            profiler.disable()
        _sync(device)
        ms = (time.perf_counter() - t0) / max(1, steps) * 1e3
        if profiler is None:
            out.append(f"== {name}: engine, {args.batch} streams: {steps} decode steps, {ms:.2f} ms a step (wall clock)")
        else:
            table = io.StringIO()
            pstats.Stats(profiler, stream=table).sort_stats("tottime").print_stats(args.rows)
            out.append(f"== {name}: engine, {args.batch} streams, the host's Python (cProfile, by own time; "
                       f"{ms:.2f} ms a step with cProfile on)\n" + table.getvalue())
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_profile", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dry-run", action="store_true", help="tiny stand-ins of each shape (CPU: a smoke test)")
    p.add_argument("--batch", type=int, default=128, help="streams in the engine's profile")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32, help="tokens each profiled run decodes")
    p.add_argument("--rows", type=int, default=20, help="rows of each table")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu-profile.txt"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and not args.dry_run:
        p.error("this script is for a CUDA machine; on CPU run it with --dry-run")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = {n: KNOWN_SHAPES[n] for n in SHAPES}
    if args.dry_run:
        args.batch, args.prompt_len, args.tokens = 4, 8, 6
        tiny = dict(dim=64, n_layers=2, vocab_size=300, n_heads=4, n_kv_heads=2, head_dim=16, rope_dim=16, hidden_dim=128)
        shapes = {n: c.replace(**tiny) for n, c in shapes.items()}
    text = []
    for name, config in shapes.items():
        hf, model = hf_peer.random_twin(config, dtype, device)
        del hf
        text.append(tables(name, model, device, args))
        print(text[-1], flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n\n".join(text) + "\n")
    print(f"results: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
