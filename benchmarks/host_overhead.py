"""The engine's host work per step, without a GPU: the real engine over a stand-in model.

    .venv/bin/python -m benchmarks.host_overhead                          # 7B shape; 1, 32, 128, 256 streams
    .venv/bin/python -m benchmarks.host_overhead --device-ms 10           # with 10 ms of simulated device time a step
    .venv/bin/python -m benchmarks.host_overhead --via async              # through AsyncEngine (its thread, streams)
    .venv/bin/python -m benchmarks.host_overhead --via http               # a server and streaming HTTP clients
    .venv/bin/python -m benchmarks.host_overhead --ab ../base --rounds 3  # against another checkout, same run
    .venv/bin/python -m benchmarks.host_overhead --device cuda            # on a GPU: the device time is real

The stand-in has a real model's configuration (its vocabulary, so the sampler and the logits are real-sized) but
no layers: its forward returns fixed logits. On CPU it simulates a device that takes `--device-ms` per forward and
runs beside the host: the forward returns at once and the step's event completes that long after the device is
free (`SimulatedStream`); an engine without such events (one whose step reads its results at once) gets a forward
that sleeps instead, as its first read of the logits would wait for a real GPU. On CUDA the forward occupies the GPU
for `--device-ms` (`torch.cuda._sleep`), so nothing is simulated.

Measured in steady decode (every stream past its prompt, greedy, EOS ignored), per step: wall time (with no device
time, all of it host work), its split by phase (schedule, prepare, forward launch, sample, update, output), the
blocking host reads of tensors (`tolist`, `item`, `bool`, `numpy`, `cpu` on a tensor that is not a host buffer: each
is a device sync on a GPU) and the dispatcher calls (ATen ops), counted in separate passes so that counting does not
change the timings.

The file imports nothing from `benchmarks`: `--root DIR` runs it against the engine of another checkout (a
worktree of an older commit), which is how `--ab` measures both in one run, alternating in fresh processes.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
STREAMS = (1, 32, 128, 256)
PROMPT_LEN = 128
PHASES = ("schedule", "prepare", "forward", "sample", "update", "output")


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-2-7b", help="a model.config.KNOWN_SHAPES entry (default llama-2-7b)")
    p.add_argument("--streams", type=int, nargs="+", default=list(STREAMS))
    p.add_argument("--device-ms", type=float, default=0.0, help="simulated (CPU) or real (CUDA) device time a step")
    p.add_argument("--steps", type=int, default=60, help="timed steps per stream count")
    p.add_argument("--via", choices=("engine", "async", "http"), default="engine")
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # (--via http's server: its port)
    p.add_argument("--device", default="cpu")
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose engine is measured")
    p.add_argument("--ab", type=Path, default=None, help="another checkout: measure both, alternating")
    p.add_argument("--rounds", type=int, default=3, help="with --ab: rounds of both")
    p.add_argument("--no-counts", action="store_true", help="skip the counting passes")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


# ---- the stand-in (built once the measured checkout's `model` is importable) --------------------------------------

def _simulated_stream():
    """benchmarks/simulated_device.py's stream, loaded from beside this file (the measured checkout may not have it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_simulated_device", HERE.parent / "simulated_device.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SimulatedStream


def _machine_info(args) -> dict:
    """benchmarks/machine.py's record of the host (commit, date, host class), loaded from beside this file."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("_machine", HERE.parent / "machine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.machine_info(args.device, torch.get_num_threads())


def _standin_classes():
    import torch

    SimulatedStream = _simulated_stream()

    class StandIn(torch.nn.Module):
        """A model's configuration and fixed logits: every row's argmax is `token`."""

        def __init__(self, config, device: str, device_s: float, simulated: bool, token: int) -> None:
            super().__init__()
            from model.config import ModelConfig

            self.config = config
            # the KV pool the engine allocates: one tiny layer (the stand-in never attends)
            self.kv_config = ModelConfig(vocab_size=config.vocab_size, dim=8, n_layers=1, n_heads=1, n_kv_heads=1,
                                         hidden_dim=8, max_seq_len=config.max_seq_len)
            self.quantization = "none"
            from model.transformer import RotaryEmbedding

            self.rope = RotaryEmbedding(self.kv_config)  # (what a kv_window's key re-rotation would use)
            self.norm = torch.nn.Module()
            self.norm.weight = torch.nn.Parameter(torch.ones(1, device=device), requires_grad=False)
            self.device_s, self.cuda = device_s, torch.device(device).type == "cuda"
            self.stream = SimulatedStream(device_s) if simulated and not self.cuda else None
            self.serial_s = device_s if not simulated and not self.cuda else 0.0
            self.logits = torch.zeros(1024, config.vocab_size, device=device)
            self.logits[:, token] = 10.0
            self.token = token
            self.forwards = 0

        @property
        def device(self):
            return self.norm.weight.device

        @property
        def dtype(self):
            return torch.float32

        def forward(self, tokens, positions=None, ctx=None, logits_indices=None):
            n = logits_indices.numel() if logits_indices is not None else tokens.shape[1]
            self.forwards += 1
            if self.cuda and self.device_s > 0:
                torch.cuda._sleep(int(self.device_s * _CYCLES_PER_S))
            elif self.stream is not None:
                self.stream.launch()
            elif self.serial_s > 0:
                time.sleep(self.serial_s)
            return self.logits[None, :n]

    return StandIn


_CYCLES_PER_S = 1.4e9  # torch.cuda._sleep spins this many clock cycles a second, about (a GPU's boost clock)


# ---- one measurement ------------------------------------------------------------------------------------------------

def _engine(args, n: int, token: int):
    import torch

    from model.config import KNOWN_SHAPES
    from model.engine import Engine, EngineConfig
    from model.loaders.checkpoint import default_model_path
    from model.text.tokenizer import Tokenizer

    simulated = _has_stream_module()  # an engine whose step waits on the model's events
    config = KNOWN_SHAPES[args.shape]
    model = _standin_classes()(config, args.device, args.device_ms / 1e3, simulated, token)
    tok = Tokenizer.from_gguf(default_model_path())
    bs = 16
    per_seq = -(-(PROMPT_LEN + _max_tokens(args, n) + 16) // bs)
    cfg = EngineConfig(block_size=bs, num_blocks=n * per_seq + 16, max_num_seqs=max(n, 1),
                       max_num_batched_tokens=max(512, n), max_waiting=max(256, n))
    engine = Engine(model, tok, cfg)
    return engine, model, torch


def _max_tokens(args, n: int) -> int:
    """Enough that no stream ends while measured: prefill steps (the first streams decode meanwhile), warm-up,
    the timed steps and the counting passes."""
    return -(-n * PROMPT_LEN // max(512, n)) + args.steps * 2 + 64


def _prompts(n: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(100, min(vocab, 49152)) for _ in range(PROMPT_LEN)] for _ in range(n)]


def _params(max_tokens: int):
    from model.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class _Phases:
    """Seconds per phase, by wrapping the engine's methods (those of either engine: the base one has no decode path
    and processes its outputs inside its step). `core` is the engine's step without the output processing: what the
    step's own thread does when outputs are processed elsewhere; `update` is what `core` spends outside the other
    phases (the sequences' bookkeeping)."""

    WRAPS = (("scheduler", ("schedule", "schedule_decode"), "schedule"),
             ("runner.buffers", ("prepare", "prepare_decode"), "prepare"),
             ("model", ("forward",), "forward"),
             ("runner", ("sampler",), "sample"),
             ("output", ("process", "append_all"), "output"),
             ("", ("core_step",), "core"))

    def __init__(self, engine, model) -> None:
        self.totals = dict.fromkeys((*PHASES, "core"), 0.0)
        self.has_core = hasattr(engine, "core_step")
        for path, names, phase in self.WRAPS:
            obj = model if path == "model" else engine
            for part in filter(None, path.split(".")) if path != "model" else ():
                obj = getattr(obj, part)
            for name in names:
                if hasattr(obj, name):
                    self._wrap(obj, name, phase)

    def _wrap(self, obj, name, phase):
        fn = getattr(obj, name)
        totals = self.totals

        def timed(call):
            def run(*a, **k):
                t0 = time.perf_counter()
                try:
                    return call(*a, **k)
                finally:
                    totals[phase] += time.perf_counter() - t0
            return run

        if inspect.ismethod(fn) or inspect.isfunction(fn):
            setattr(obj, name, timed(fn))
            return

        class Proxy:
            """A callable object (the sampler) whose other methods are called too: both timed."""

            def __call__(self, *a, **k):
                return timed(fn)(*a, **k)

            def __getattr__(self, attr):
                value = getattr(fn, attr)
                return timed(value) if callable(value) else value

        setattr(obj, name, Proxy())

    def reset(self) -> None:
        for k in self.totals:
            self.totals[k] = 0.0

    def per_step_us(self, steps: int, step_s: float) -> dict[str, float]:
        """`step_s`: the steps' total wall time (the base engine's core is that less its output processing)."""
        t = dict(self.totals)
        if not self.has_core:
            t["core"] = step_s - t["output"]
        t["update"] = t["core"] - sum(t[k] for k in ("schedule", "prepare", "forward", "sample"))
        return {k: v / steps * 1e6 for k, v in t.items()}


def _count_pass(engine, steps: int) -> dict[str, float]:
    """Dispatcher calls and host reads of non-host tensors per step, over `steps` steps."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = {"tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"}
    host = getattr(engine.runner, "host_buffers", lambda: [])()
    host_ptrs = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in host]

    def is_host(t) -> bool:
        p = t.data_ptr()
        return any(a <= p < b for a, b in host_ptrs)

    counts = {"dispatcher_calls": 0, "host_reads": 0}

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts["dispatcher_calls"] += 1
            return func(*args, **(kwargs or {}))

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in reads and args and isinstance(args[0], torch.Tensor) \
                    and not is_host(args[0]):
                counts["host_reads"] += 1
            return func(*args, **(kwargs or {}))

    with Ops(), Reads():
        for _ in range(steps):
            engine.step()
    return {k: v / steps for k, v in counts.items()}


def _steady(args, n: int):
    """An engine with `n` streams in steady decode."""
    engine, model, torch = _engine(args, n, token=1000)
    for i, p in enumerate(_prompts(n, model.config.vocab_size)):
        engine.add_request(f"r{i}", p, _params(_max_tokens(args, n)))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()  # prefill until every stream decodes
    for _ in range(8):  # warm-up
        engine.step()
    return engine, model, torch


def count_engine(args, n: int) -> dict:
    """The counting passes, on an engine of their own: run after every timing of the process, since a pass under
    PyTorch's dispatch and function modes slowed the timings measured after it in the same process."""
    engine, _, _ = _steady(args, n)
    return _count_pass(engine, 8)


def measure_engine(args, n: int) -> dict:
    engine, model, torch = _steady(args, n)
    phases = _Phases(engine, model)
    phases.reset()
    stream = model.stream
    if stream is not None:
        stream.reset_counts()
    times, cores = [], []
    tokens = 0
    for _ in range(args.steps):
        core0, out0 = phases.totals["core"], phases.totals["output"]
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        times.append(dt)
        cores.append(phases.totals["core"] - core0 if phases.has_core else dt - (phases.totals["output"] - out0))
        tokens += sum(len(o.token_ids) for o in outs)
    if args.device == "cuda":
        torch.cuda.synchronize()
    if tokens < (args.steps - 2) * n:  # (an overlapped step's tokens land a step later)
        raise SystemExit(f"{n} streams: {tokens} tokens in {args.steps} steps; the engine did not decode every "
                         "stream every step, so these timings are not of decode steps")
    core = statistics.median(cores)
    out = {
        "streams": n,
        "step_ms_median": core * 1e3,  # the step's own thread: the engine's step less its output processing
        "with_output_ms_median": statistics.median(times) * 1e3,
        "host_us_per_stream": core * 1e6 / n,
        "tokens_per_step": tokens / args.steps,
        "phases_us": phases.per_step_us(args.steps, sum(times)),
    }
    if stream is not None:
        out["event_waits_per_step"] = stream.waits / args.steps
        out["blocking_waits_per_step"] = stream.blocking_waits / args.steps
        out["waited_ms_per_step"] = stream.waited_s / args.steps * 1e3
    return out


def measure_async(args, n: int) -> dict:
    """N concurrent streams through AsyncEngine: the engine thread's step times (its step hook) and the consumers'
    token rate, once every stream is decoding."""
    import asyncio

    from model.engine import AsyncEngine

    engine, model, torch = _engine(args, n, token=1000)
    total = _max_tokens(args, n)
    aeng = AsyncEngine(engine)
    steps: list[tuple[float, float]] = []
    aeng.step_hooks.append(lambda stats, outs, s: steps.append((time.perf_counter(), s)))
    aeng.start()

    async def run() -> dict:
        counts = [0] * n
        start_decode = asyncio.Event()

        async def consume(i, prompt):
            async for out in aeng.generate(prompt, _params(total), request_id=f"r{i}"):
                counts[i] += len(out.token_ids)
                if all(c > 0 for c in counts):
                    start_decode.set()

        tasks = [asyncio.create_task(consume(i, p)) for i, p in enumerate(_prompts(n, model.config.vocab_size))]
        await start_decode.wait()
        await asyncio.sleep(0.2)
        t0, c0, k0 = time.perf_counter(), sum(counts), len(steps)
        while sum(counts) - c0 < n * args.steps // 2 and not all(t.done() for t in tasks):
            await asyncio.sleep(0.01)
        t1, c1, k1 = time.perf_counter(), sum(counts), len(steps)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        window = [s for _, s in steps[k0:k1]]
        return {"streams": n, "tok_s": (c1 - c0) / (t1 - t0), "steps_per_s": (k1 - k0) / (t1 - t0),
                "engine_step_ms_median": statistics.median(window) * 1e3 if window else float("nan"),
                "wall_ms_per_step": (t1 - t0) / max(1, k1 - k0) * 1e3}

    try:
        return asyncio.run(run())
    finally:
        aeng.stop()


def _known_argmax(token: int):
    """The stand-in's logits are fixed, so their argmax is known: the sampler's argmax kernel is replaced by a fill
    of that token, which costs the host what launching a GPU's argmax does (the kernel's own speed is measured by
    benchmarks/bench_decode.py, not here)."""
    import torch

    from model.kernels import ops

    def pick(logits):
        return torch.full((logits.shape[0],), token, dtype=torch.long, device=logits.device)

    ops.greedy_pick = pick


def _serve(args) -> None:
    """--via http's server process: the stand-in served by the measured checkout's app on port `args.serve`."""
    import uvicorn

    from model.loaders.checkpoint import LoadedModel, default_model_path
    from model.text.tokenizer import Tokenizer
    from service.config import Settings
    from service.main import create_app

    from model.config import KNOWN_SHAPES

    n = max(args.streams)
    model = _standin_classes()(KNOWN_SHAPES[args.shape], args.device, args.device_ms / 1e3,
                               _has_stream_module(), token=1000)
    settings = Settings(max_num_seqs=n, max_num_batched_tokens=max(512, n), max_waiting=max(256, n),
                        kv_cache_bytes=n * 2048 * 1024)
    loaded = LoadedModel(model, Tokenizer.from_gguf(default_model_path()), Path("standin"), "standin", 0.0)
    uvicorn.run(create_app(settings, loaded=loaded, wait_ready=True), host="127.0.0.1", port=args.serve,
                log_level="warning")


def _has_stream_module() -> bool:
    try:
        import model.engine.stream  # noqa: F401
        return True
    except ImportError:
        return False


def measure_http(args, n: int) -> dict:
    """N streaming clients against a server of the measured checkout (a subprocess): their token rate once all
    stream, and the server's mean step time over the same window (its /metrics)."""
    import asyncio
    import socket

    import httpx

    from model.config import KNOWN_SHAPES

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, str(HERE), "--root", str(args.root), "--serve", str(port), "--shape", args.shape,
           "--device-ms", str(args.device_ms), "--device", args.device, "--streams", str(n)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the stand-in server did not start")
            time.sleep(0.3)

        def step_metrics() -> tuple[float, float]:
            text = httpx.get(url + "/metrics", timeout=10).text
            vals = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                    if line.startswith("llamascope_engine_step_seconds_")}
            return vals.get("llamascope_engine_step_seconds_sum", 0.0), vals.get("llamascope_engine_step_seconds_count", 0.0)

        async def run() -> dict:
            counts = [0] * n
            prompts = _prompts(n, KNOWN_SHAPES[args.shape].vocab_size)
            limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
            async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
                async def one(i):
                    body = {"prompt": prompts[i], "max_tokens": _max_tokens(args, n), "temperature": 0,
                            "ignore_eos": True, "stream": True}
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        r.raise_for_status()
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                counts[i] += 1

                tasks = [asyncio.create_task(one(i)) for i in range(n)]
                while not all(counts) and not any(t.done() for t in tasks):
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)
                s0, k0 = step_metrics()
                t0, c0 = time.perf_counter(), sum(counts)
                while sum(counts) - c0 < n * args.steps // 2 and not all(t.done() for t in tasks):
                    await asyncio.sleep(0.05)
                t1, c1 = time.perf_counter(), sum(counts)
                s1, k1 = step_metrics()
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            return {"streams": n, "tok_s": (c1 - c0) / (t1 - t0), "steps_per_s": (k1 - k0) / (t1 - t0),
                    "engine_step_ms_mean": (s1 - s0) / max(1.0, k1 - k0) * 1e3}

        return asyncio.run(run())
    finally:
        server.terminate()
        server.wait(30)


def run_one(args) -> dict:
    sys.path.insert(0, str(args.root.resolve()))
    os.chdir(args.root)
    import torch

    _known_argmax(1000)

    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    if args.serve is not None:
        _serve(args)
        return {}
    fn = {"engine": measure_engine, "async": measure_async, "http": measure_http}[args.via]
    results = {"root": str(args.root), "shape": args.shape, "device": args.device, "device_ms": args.device_ms,
               "via": args.via, "by_streams": {}}
    for n in args.streams:
        print(f"[host_overhead] {args.root.name}: {n} streams", file=sys.stderr, flush=True)
        results["by_streams"][str(n)] = fn(args, n)
    if args.via == "engine" and not args.no_counts:
        for n in args.streams:
            results["by_streams"][str(n)].update(count_engine(args, n))
    return results


def run_ab(args, argv) -> dict:
    """Both checkouts in fresh processes, alternating; medians per figure and this / base ratios."""
    passthrough = [a for a in _strip(argv, ("--ab", "--rounds", "--out", "--root"))]
    sides = {"base": args.ab.resolve(), "this": ROOT}
    runs = {"base": [], "this": []}
    for r in range(args.rounds):
        for side in (("base", "this") if r % 2 == 0 else ("this", "base")):
            cmd = [sys.executable, str(HERE), "--root", str(sides[side]), *passthrough]
            res = subprocess.run(cmd, check=True, capture_output=True, text=True)
            runs[side].append(json.loads(res.stdout))
    summary = {}
    for n in args.streams:
        key = str(n)
        row = {}
        for fig in ("step_ms_median", "host_us_per_stream", "engine_step_ms_median", "engine_step_ms_mean", "tok_s"):
            vals = {s: [x["by_streams"][key][fig] for x in runs[s] if fig in x["by_streams"][key]] for s in sides}
            if all(vals.values()):
                b, t = statistics.median(vals["base"]), statistics.median(vals["this"])
                row[fig] = {"base": b, "this": t, "ratio": t / b}
        summary[key] = row
    return {"sides": {k: str(v) for k, v in sides.items()}, "summary": summary, "runs": runs}


def _strip(argv, flags):
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if any(a.startswith(f + "=") for f in flags):
            continue
        out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    results = run_ab(args, argv) if args.ab is not None else run_one(args)
    if results:  # (not --serve's server)
        results["machine"] = _machine_info(args)
    text = json.dumps(results, indent=1)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
