"""Real model shapes against llama.cpp's `llama-server`, same file, same run, over HTTP: load time, peak memory,
single-stream decode, 32 concurrent, 512-token prefill.

    python -m benchmarks.shapes [--shapes 1b 8b] [--types Q4_0 Q4_K_M] [--rounds 1] [--cache DIR]

Random-weight GGUFs of the Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B shapes (layers, widths, heads, KV heads,
FFN width; the default model's tokenizer and so its 49,152-entry vocabulary, not Llama 3's 128k), and of the
Qwen2.5-1.5B, Qwen3-4B and Mistral-7B ones as llama.cpp's converter writes those families (`qwen2` with q/k/v biases,
`qwen3` with its head_dim of 128 and per-head q/k norms, Mistral as `llama`: conversion/qwen.py, conversion/llama.py),
written once as Q8_0 blocks of random int8 weights (std ~0.02; norms 1, biases 0), then `llama-quantize
--allow-requantize` to Q4_0 and Q4_K_M
(llama.cpp's own choice of per-tensor types: Q4_K_M puts Q6_K in the head and in some attn_v / ffn_down), cached in
`--cache`. Not part of CI: it needs llama.cpp's `llama-quantize` and `llama-server` (benchmarks/README.md).

Each file is served by both in turn, one server up at a time (an 8B file twice would not fit), both with the same
context: llama-server `-np 32 -c 20480` (640 tokens a slot), ours `--kv-cache-bytes` for 20,480 tokens in a float16
cache like llama-server's (or the `--kv-cache-dtype` that `--ours-args` name). Load time: process start to /health
200. Peak memory: the server process's VmHWM after the workloads. The workloads are benchmarks/vs_llama_server.py's (streamed /v1/completions, token-id prompts, greedy, EOS
ignored, 64 new tokens): single stream (median of 3), 32 concurrent, one 512-token prefill. `--rounds N`: N rounds,
the two servers alternating (ours, llama-server, ours, ...), each round a fresh start of each; every figure is the
median over a side's rounds (peak memory: the highest), so a slow spell of the shared host (figures here moved 20-40%
within an hour) falls on a round of each side instead of on all of one side's measurements.

`--load-only --starts N`: load times alone, N starts of each server alternating (ours, llama-server, ours, ...), each
stopped as soon as it is ready, medians; writes `--out` (default benchmarks/results/shapes-load.json).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import vs_llama_server as vs
from benchmarks.load import ServedProcess
from benchmarks.machine import machine_info

@dataclass(frozen=True)
class Shape:
    """A published config's shape, as the GGUF architecture its family converts to (model/loaders/families.py)."""

    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    tied: bool
    rope_theta: float
    arch: str = "llama"
    head_dim: int = 0  # 0: dim / n_heads
    qkv_bias: bool = False  # Qwen2's q/k/v biases
    qk_norm: bool = False  # Qwen3's per-head q/k norms

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads


SHAPES = {
    "1b": Shape(16, 2048, 32, 8, 8192, True, 500000.0),
    "3b": Shape(28, 3072, 24, 8, 8192, True, 500000.0),
    "8b": Shape(32, 4096, 32, 8, 14336, False, 500000.0),
    # Qwen/Qwen2.5-1.5B, Qwen/Qwen3-4B, mistralai/Mistral-7B-v0.3 config.json (v0.3: full attention, theta 1e6)
    "qwen2.5-1.5b": Shape(28, 1536, 12, 2, 8960, True, 1e6, "qwen2", qkv_bias=True),
    "qwen3-4b": Shape(36, 2560, 32, 8, 9728, True, 1e6, "qwen3", head_dim=128, qk_norm=True),
    "mistral-7b": Shape(32, 4096, 32, 8, 14336, False, 1e6, "llama"),
}
CONTEXT = vs.CONCURRENT * vs.SLOT_CONTEXT  # 20,480 tokens, both sides
WEIGHT_STD = 0.02


def _tokenizer_fields(default_gguf: Path):
    from gguf import GGUFReader

    r = GGUFReader(default_gguf)
    return r, [f for name, f in r.fields.items() if name.startswith("tokenizer.")]


def write_random(path: Path, shape: Shape | tuple, default_gguf: Path, qtype: str = "Q8_0", seed: int = 0) -> None:
    """A random-weight GGUF of `shape` (a `SHAPES` entry, or its first seven fields as a tuple: a llama one) whose
    matrices are Q8_0 or Q4_0 blocks of random integers (weights of std ~0.02, norms 1, biases 0), the default
    model's tokenizer; the family's tensors and keys as llama.cpp's converter names them; written tensor by tensor,
    never the whole model in memory."""
    from gguf import GGMLQuantizationType as Q, GGUFValueType, GGUFWriter

    shape = shape if isinstance(shape, Shape) else Shape(*shape)
    n_layers, dim, heads, kv, ffn, tied, theta = (shape.n_layers, shape.dim, shape.n_heads, shape.n_kv_heads,
                                                  shape.ffn, shape.tied, shape.rope_theta)
    reader, tok_fields = _tokenizer_fields(default_gguf)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    w = GGUFWriter(str(path), shape.arch)
    w.add_name(path.stem)
    w.add_block_count(n_layers)
    w.add_context_length(131072)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(theta)
    hd = shape.hd
    if shape.arch == "llama":
        w.add_rope_dimension_count(hd)
        w.add_vocab_size(vocab)
    if shape.head_dim:  # (conversion/base.py writes the key and value widths where the config names head_dim)
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_file_type({"Q8_0": 7, "Q4_0": 2}[qtype])  # llama_ftype MOSTLY_Q8_0 / MOSTLY_Q4_0
    for f in tok_fields:  # the default model's tokenizer, as it is
        if f.types[0] == GGUFValueType.ARRAY:
            w.add_key_value(f.name, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(f.name, f.contents(), f.types[0])
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, dim))]
    for i in range(n_layers):
        tensors += [(f"blk.{i}.attn_norm.weight", (dim,)), (f"blk.{i}.attn_q.weight", (heads * hd, dim)),
                    (f"blk.{i}.attn_k.weight", (kv * hd, dim)), (f"blk.{i}.attn_v.weight", (kv * hd, dim)),
                    (f"blk.{i}.attn_output.weight", (dim, heads * hd)), (f"blk.{i}.ffn_norm.weight", (dim,)),
                    (f"blk.{i}.ffn_gate.weight", (ffn, dim)), (f"blk.{i}.ffn_up.weight", (ffn, dim)),
                    (f"blk.{i}.ffn_down.weight", (dim, ffn))]
        if shape.qkv_bias:
            tensors += [(f"blk.{i}.attn_q.bias", (heads * hd,)), (f"blk.{i}.attn_k.bias", (kv * hd,)),
                        (f"blk.{i}.attn_v.bias", (kv * hd,))]
        if shape.qk_norm:
            tensors += [(f"blk.{i}.attn_q_norm.weight", (hd,)), (f"blk.{i}.attn_k_norm.weight", (hd,))]
    tensors.append(("output_norm.weight", (dim,)))
    if not tied:
        tensors.append(("output.weight", (vocab, dim)))
    block = {"Q8_0": 34, "Q4_0": 18}[qtype]
    for name, shp in tensors:
        if len(shp) == 1:
            w.add_tensor_info(name, shp, np.dtype(np.float32), shp[0] * 4)
        else:
            nbytes = shp[0] * shp[1] // 32 * block
            w.add_tensor_info(name, (shp[0], shp[1] // 32 * block), np.dtype(np.uint8), nbytes, raw_dtype=Q[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    # uniform q: Q8_0's in [-127, 127] has std 73 d; Q4_0's d (q - 8), q in [0, 15], std 4.6 d
    d = np.frombuffer(np.float16(WEIGHT_STD / (73.3 if qtype == "Q8_0" else 4.61)).tobytes(), dtype=np.uint8)
    for name, shp in tensors:
        if len(shp) == 1:  # norms 1, biases 0
            w.write_tensor_data((np.zeros if name.endswith(".bias") else np.ones)(shp, dtype=np.float32))
            continue
        blocks = np.empty((shp[0], shp[1] // 32, block), dtype=np.uint8)
        blocks[..., 0:2] = d
        for a in range(0, shp[0], 4096):  # (random bytes made in row chunks: rng temporaries stay small)
            blocks[a : a + 4096, :, 2:] = rng.integers(0, 256, size=blocks[a : a + 4096, :, 2:].shape, dtype=np.uint8)
        if qtype == "Q8_0":
            blocks[..., 2:] = np.where(blocks[..., 2:] == 128, 129, blocks[..., 2:])  # int8 -128 is not a Q8_0 value
        w.write_tensor_data(blocks.reshape(shp[0], -1))
        del blocks
    w.close()


def model_file(cache: Path, shape: str, qtype: str, quantize_bin: Path, default_gguf: Path) -> Path:
    """The cached file of `shape` in `qtype` ("Q8_0", "Q4_0", "Q4_K_M"), made (and its Q8_0 source) if missing."""
    cache.mkdir(parents=True, exist_ok=True)
    stem = shape if "-" in shape else f"llama-{shape}"  # (the LLaMA shapes' names: "1b" -> llama-1b)
    q8 = cache / f"{stem}-Q8_0.gguf"
    if not q8.is_file():
        print(f"writing {q8}", flush=True)
        write_random(q8.with_suffix(".part"), SHAPES[shape], default_gguf)
        q8.with_suffix(".part").rename(q8)
    if qtype == "Q8_0":
        return q8
    out = cache / f"{stem}-{qtype}.gguf"
    if not out.is_file():
        print(f"llama-quantize {q8.name} -> {qtype}", flush=True)
        subprocess.run([str(quantize_bin), "--allow-requantize", str(q8), str(out.with_suffix(".part")), qtype,
                        str(len(os.sched_getaffinity(0)))], check=True, stdout=subprocess.DEVNULL)
        out.with_suffix(".part").rename(out)
    return out


def _peak_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _kv_bytes_per_token(path: Path, dtype: str = "float32") -> int:
    """Our KV cache per token in a cache of `dtype`: K and V, every layer, the KV heads' rows (an int8 row with its
    scale: model/kernels/kv_int8.py)."""
    from model.kernels.kv_int8 import row_width
    from model.loaders.gguf_file import open_gguf, read_metadata
    from model.loaders.config_keys import config_from_gguf

    c = config_from_gguf(read_metadata(open_gguf(path)), source=str(path))
    t = torch.float16 if dtype == "auto" else getattr(torch, dtype)  # (auto: float16 under quantized weights)
    return 2 * c.n_layers * c.n_kv_heads * row_width(c.head_dim, t) * torch.empty((), dtype=t).element_size()


def kv_cache_args(path: Path, tokens: int, ours_args: list[str]) -> list[str]:
    """Our flags for a KV pool of `tokens` tokens (to go before `ours_args`): the cache dtype `ours_args` name, else
    float16 (llama-server's f16 default, and ours' `auto` under quantized weights, said here so the pool's size
    cannot depend on it)."""
    named = "--kv-cache-dtype" in ours_args
    dtype = ours_args[ours_args.index("--kv-cache-dtype") + 1] if named else "float16"
    pool = ["--kv-cache-bytes", str(tokens * _kv_bytes_per_token(path, dtype))]
    return pool if named else [*pool, "--kv-cache-dtype", dtype]


FIGURES = ("load_s", "decode_tok_s", "throughput_tok_s", "prefill_tok_s")


def measure(name: str, start, vocab_hint: int, r: int, client: str) -> dict:
    """Round `r` of one side: start its server, a warm-up, the workloads (seeds by round: both sides get the same
    prompts in a round), its peak memory, stop."""
    t0 = time.perf_counter()
    server = start()
    load_s = time.perf_counter() - t0
    out: dict = {"load_s": load_s}
    try:
        vocab = vs._vocab(server.url) if name == "ours" else vocab_hint
        vs.single_stream(server.url, vocab, seed=10_000, client=client)  # warm-up
        singles = [vs.single_stream(server.url, vocab, seed=3 * r + i, client=client)["decode_tok_s"] for i in range(3)]
        out.update(decode_tok_s=statistics.median(singles),
                   throughput_tok_s=vs.concurrent(server.url, vocab, seed=100 + r, client=client)["throughput_tok_s"],
                   prefill_tok_s=vs.prefill(server.url, vocab, seed=200 + r, client=client)["prefill_tok_s"],
                   peak_rss_bytes=_peak_bytes(server.proc.pid))
        if name == "ours":
            out["model_card"] = __import__("httpx").get(server.url + "/v1/models", timeout=10).json()["data"][0]
    finally:
        out["exit"] = server.stop(grace=0) if name != "ours" else server.stop()
    print(f"  {name:>12} (round {r + 1}): load {out['load_s']:5.1f} s  peak {out.get('peak_rss_bytes', 0) / 2**30:5.2f} GiB  "
          f"single {out.get('decode_tok_s', 0):6.1f}  32-concurrent {out.get('throughput_tok_s', 0):6.1f}  "
          f"prefill {out.get('prefill_tok_s', 0):6.1f} tok/s", flush=True)
    return out


def medians(rounds: list[dict]) -> dict:
    """One side's rounds -> each figure's median over them, the highest peak memory, and the rounds themselves."""
    out = {k: statistics.median(r[k] for r in rounds) for k in FIGURES}
    out["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in rounds)
    out["exit"] = [r["exit"] for r in rounds]
    if "model_card" in rounds[0]:
        out["model_card"] = rounds[0]["model_card"]
    out["rounds"] = [{k: r[k] for k in (*FIGURES, "peak_rss_bytes")} for r in rounds]
    return out


def load_times(path: Path, starts: int, ours_args: list[str], llama_server: Path, threads: int, logs: Path) -> dict:
    """`starts` starts of each server on `path`, alternating, each stopped once ready: their load times and medians."""
    ours_cmd = ["--model", str(path), *kv_cache_args(path, CONTEXT, ours_args), *ours_args]
    times: dict[str, list[float]] = {"ours": [], "llama-server": []}
    for i in range(starts):
        for name in times:
            t0 = time.perf_counter()
            server = ServedProcess(ours_cmd, logs / f"{path.stem}.ours.{i}.log") if name == "ours" else \
                vs.LlamaServer(llama_server, path, threads, logs / f"{path.stem}.peer.{i}.log")
            times[name].append(time.perf_counter() - t0)
            if name == "ours":
                server.stop()
            else:
                server.stop(grace=0)
    out = {name: {"load_s": t, "median_s": statistics.median(t)} for name, t in times.items()}
    out["ratio"] = out["ours"]["median_s"] / out["llama-server"]["median_s"]
    print(f"  load: ours {' '.join(f'{t:.2f}' for t in times['ours'])} s, llama-server "
          f"{' '.join(f'{t:.2f}' for t in times['llama-server'])} s; medians {out['ours']['median_s']:.2f} vs "
          f"{out['llama-server']['median_s']:.2f} s ({out['ratio']:.2f}x)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["1b", "8b"], choices=sorted(SHAPES))
    p.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K_M"])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--cache", type=Path, default=Path("/work/peers/shapes"))
    p.add_argument("--llama-server", type=Path, default=Path(shutil.which("llama-server") or "/work/peers/llama-server"))
    p.add_argument("--llama-quantize", type=Path, default=Path(shutil.which("llama-quantize") or "/work/peers/llama-quantize"))
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--ours-args", default="")
    p.add_argument("--client", choices=("raw", "httpx"), default="raw")
    p.add_argument("--load-only", action="store_true", help="load times alone: --starts starts of each server")
    p.add_argument("--starts", type=int, default=4, help="with --load-only: starts of each server, alternating")
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/results/shapes.json "
                   "(--load-only: shapes-load.json)")
    args = p.parse_args(argv)
    args.out = args.out or Path("benchmarks/results/shapes-load.json" if args.load_only else "benchmarks/results/shapes.json")
    for tool in (args.llama_server, args.llama_quantize):
        if not tool.is_file():
            print(f"{tool} not found (llama.cpp peer; see benchmarks/README.md)", file=sys.stderr)
            return 2
    torch.set_num_threads(1)
    from model.loaders.checkpoint import default_model_path

    logs = Path(tempfile.mkdtemp(prefix="shapes-"))
    result = {"machine": machine_info("cpu", args.threads), "context_tokens": CONTEXT, "runs": []}
    print(f"server logs in {logs}", flush=True)
    for shape in args.shapes:
        for qtype in args.types:
            path = model_file(args.cache, shape, qtype, args.llama_quantize, default_model_path())
            print(f"{path.name} ({path.stat().st_size / 2**20:.0f} MiB)", flush=True)
            if args.load_only:
                result["runs"].append({"shape": shape, "type": qtype, "file": str(path),
                                       **load_times(path, args.starts, args.ours_args.split(), args.llama_server,
                                                    args.threads, logs)})
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=2) + "\n")
                continue
            kv = kv_cache_args(path, CONTEXT, args.ours_args.split())
            run = {"shape": shape, "type": qtype, "file": str(path), "file_bytes": path.stat().st_size,
                   "ours_kv_cache_bytes": int(kv[1]), "ours_kv_cache_dtype": kv[3]}
            ours_cmd = ["--model", str(path), *kv, *args.ours_args.split()]
            sides: dict[str, list[dict]] = {"ours": [], "llama-server": []}
            for r in range(args.rounds):  # the sides alternate: a slow spell of the shared host hits a round of each
                sides["ours"].append(measure("ours", lambda: ServedProcess(ours_cmd, logs / f"{path.stem}.ours.{r}.log"),
                                             0, r, args.client))
                vocab = sides["ours"][0]["model_card"].get("vocab_size") or 49152
                sides["llama-server"].append(measure(
                    "llama-server", lambda: vs.LlamaServer(args.llama_server, path, args.threads, logs / f"{path.stem}.peer.{r}.log"),
                    vocab, r, args.client))
            run["ours"], run["llama-server"] = medians(sides["ours"]), medians(sides["llama-server"])
            o, pe = run["ours"], run["llama-server"]
            run["ratios"] = {k: o[k] / pe[k] for k in ("decode_tok_s", "throughput_tok_s", "prefill_tok_s")}
            run["ratios"]["peak_rss"] = o["peak_rss_bytes"] / pe["peak_rss_bytes"]
            run["ratios"]["load_s"] = o["load_s"] / pe["load_s"]
            print("  ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in run["ratios"].items()), flush=True)
            result["runs"].append(run)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
