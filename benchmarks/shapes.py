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

`--avx2`: both sides built for AVX2 alone on a host that has more (an AVX-512 one), so the AVX2 paths are what is
measured: ours with `LLAMASCOPE_NATIVE_KERNELS=portable` (the kernels' AVX2, FMA and F16C build), llama-server and
llama-quantize built from `--llama-cpp-src` (a llama.cpp tree) with `GGML_NATIVE=OFF` and AVX2, FMA, F16C and BMI2
alone, AVX-512, AVX-VNNI and AMX off (`AVX2_CMAKE`; into its build-avx2 folder, once). Either way the JSON records the
instruction set each side was built for: ours from /v1/models `execution.cpu_kernels`, llama-server's from the
`system_info` line of its log where it has one (ggml's compiled CPU features: `AVX2 = 1 | ... | AVX512 = 1`), else from
its build's CMakeCache.txt (`peer_built_for`).

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
    # HuggingFaceTB/SmolLM2-135M config.json (the default model's shape): a smoke run's file, seconds to make
    "smollm2-135m": Shape(30, 576, 9, 3, 1536, True, 100000.0),
}
# llama.cpp built for AVX2 alone (ggml/CMakeLists.txt's options; GGML_NATIVE=OFF, else -march=native turns on what the
# build host has): what a Zen 2 / Zen 3 or a client CPU without AVX-512 runs
AVX2_CMAKE = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
              "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF",
              "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
              "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_BUILD_TYPE=Release"]
CONTEXT = vs.CONCURRENT * vs.SLOT_CONTEXT  # 20,480 tokens, both sides
WEIGHT_STD = 0.02


def _tokenizer_fields(default_gguf: Path):
    from gguf import GGUFReader

    r = GGUFReader(default_gguf)
    return r, [f for name, f in r.fields.items() if name.startswith("tokenizer.")]


def write_random(path: Path, shape: Shape | tuple, default_gguf: Path, qtype: str = "Q8_0", seed: int = 0) -> None:
    """A random-weight GGUF of `shape` (a `SHAPES` entry, or its first seven fields as a tuple: a llama one) whose
    matrices are Q8_0, Q4_0 or (Q4_K_M: Q4_K and Q6_K, KQ_BLOCKS) blocks of random integers (weights of std ~0.02, norms 1, biases 0), the default
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
    w.add_file_type({"Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15}[qtype])  # llama_ftype MOSTLY_Q8_0 / _Q4_0 / _Q4_K_M
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
    for name, shp in tensors:
        if len(shp) == 1:
            w.add_tensor_info(name, shp, np.dtype(np.float32), shp[0] * 4)
        else:
            t = _tensor_type(name, qtype)
            size, per = KQ_BLOCKS[t][:2]
            nbytes = shp[0] * shp[1] // per * size
            w.add_tensor_info(name, (shp[0], shp[1] // per * size), np.dtype(np.uint8), nbytes, raw_dtype=Q[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shp in tensors:
        if len(shp) == 1:  # norms 1, biases 0
            w.write_tensor_data((np.zeros if name.endswith(".bias") else np.ones)(shp, dtype=np.float32))
            continue
        t = _tensor_type(name, qtype)
        size, per, scales = KQ_BLOCKS[t]
        blocks = np.empty((shp[0], shp[1] // per, size), dtype=np.uint8)
        for a in range(0, shp[0], 4096):  # (random bytes made in row chunks: rng temporaries stay small)
            blocks[a : a + 4096] = rng.integers(0, 256, size=blocks[a : a + 4096].shape, dtype=np.uint8)
        for at, value in scales:  # the float16 scales at their places, the rest random quants
            blocks[..., at : at + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
        if t == "Q8_0":
            blocks[..., 2:] = np.where(blocks[..., 2:] == 128, 129, blocks[..., 2:])  # int8 -128 is not a Q8_0 value
        w.write_tensor_data(blocks.reshape(shp[0], -1))
        del blocks
    w.close()


# GGUF block types write_random writes: (bytes a block, weights a block, (offset, value) of each float16 scale).
# Uniform quants: Q8_0's in [-127, 127] have std 73 d, Q4_0's d (q - 8) std 4.6 d; the K-quants' (ggml-common.h
# block_q4_K {d; dmin; scales[12]; qs[128]}, block_q6_K {ql[128]; qh[64]; scales[16]; d}) take random 6-bit and
# int8 sub-block scales from the random bytes, so only their order of magnitude is a model's: files for timing.
KQ_BLOCKS = {"Q8_0": (34, 32, ((0, WEIGHT_STD / 73.3),)), "Q4_0": (18, 32, ((0, WEIGHT_STD / 4.61),)),
             "Q4_K": (144, 256, ((0, WEIGHT_STD / 200), (2, WEIGHT_STD / 400))),
             "Q6_K": (210, 256, ((208, WEIGHT_STD / 2000),))}


def _tensor_type(name: str, qtype: str) -> str:
    """A matrix's block type in a file of `qtype`: Q4_K_M puts Q6_K in the head and the attn_v / ffn_down matrices
    (llama.cpp's llama-quant.cpp gives half of those Q6_K, the rest Q4_K: all of them here), Q4_K elsewhere."""
    if qtype != "Q4_K_M":
        return qtype
    return "Q6_K" if name == "output.weight" or "attn_v" in name or "ffn_down" in name else "Q4_K"


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


def build_llama_avx2(src: Path) -> tuple[Path, Path]:
    """llama-server and llama-quantize of the llama.cpp tree `src`, built for AVX2 alone (AVX2_CMAKE) into
    src/build-avx2 where not built yet, on every core."""
    build = src / "build-avx2"
    server, quantize = build / "bin" / "llama-server", build / "bin" / "llama-quantize"
    if not (server.is_file() and quantize.is_file()):
        print(f"building llama-server and llama-quantize AVX2-only in {build}", flush=True)
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), *AVX2_CMAKE], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "llama-quantize",
                        "-j", str(len(os.sched_getaffinity(0)))], check=True, stdout=subprocess.DEVNULL)
    return server, quantize


# ggml's CPU features (its CMake options, and the names llama.cpp's system_info line gives them: ggml-cpu.cpp
# ggml_backend_cpu_get_features), richest first -> the name kernels.instruction_set gives a build of ours
PEER_ISA = (("AMX_INT8", "avx512-vnni+amx"), ("AVX512_VNNI", "avx512-vnni"), ("AVX512", "avx512"),
            ("AVX_VNNI", "avx2+avx-vnni"), ("AVX2", "avx2"))


def peer_built_for(binary: Path, log_path: Path) -> dict:
    """What llama-server was built for: the `system_info: ... | CPU : SSE3 = 1 | ... |` line of its log where it has
    one (llama.cpp prints it at trace verbosity only, since common/common.cpp `common_init` logs it with COM_TRC),
    else its build's CMakeCache.txt (the binary in <build>/bin): the GGML_* options that are ON, or "native" where
    GGML_NATIVE is (-march=native: the build host's own). -> the source, the features, the instruction set."""
    try:
        line = next((ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if "system_info" in ln), "")
    except OSError:
        line = ""
    if line:  # "| CPU : SSE3 = 1 | SSSE3 = 1 | ..."
        have = {f.split("=")[0].split(":")[-1].strip() for f in line.split("|") if f.strip().endswith("= 1")}
        source = line
    else:
        cache = binary.resolve().parent.parent / "CMakeCache.txt"
        try:
            on = [ln.split(":", 1)[0] for ln in cache.read_text().splitlines() if ln.startswith("GGML_") and ln.endswith("=ON")]
        except OSError:
            return {"source": None, "features": [], "instruction_set": "unknown"}
        if "GGML_NATIVE" in on:
            return {"source": str(cache), "features": ["NATIVE"], "instruction_set": "native"}
        have, source = {o.removeprefix("GGML_") for o in on}, str(cache)
    return {"source": source, "features": sorted(have),
            "instruction_set": next((name for feature, name in PEER_ISA if feature in have), "unknown")}


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
    p.add_argument("--avx2", action="store_true", help="both sides built for AVX2 alone: ours with "
                   "LLAMASCOPE_NATIVE_KERNELS=portable, llama-server and llama-quantize built from --llama-cpp-src")
    p.add_argument("--llama-cpp-src", type=Path, default=None,
                   help="with --avx2: a llama.cpp source tree to build them from (AVX2_CMAKE, into its build-avx2)")
    p.add_argument("--load-only", action="store_true", help="load times alone: --starts starts of each server")
    p.add_argument("--starts", type=int, default=4, help="with --load-only: starts of each server, alternating")
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/results/shapes.json "
                   "(--load-only: shapes-load.json)")
    args = p.parse_args(argv)
    args.out = args.out or Path("benchmarks/results/shapes-load.json" if args.load_only else "benchmarks/results/shapes.json")
    if args.avx2:
        os.environ["LLAMASCOPE_NATIVE_KERNELS"] = "portable"  # our servers (started from this process) load it
        if args.llama_cpp_src is None:
            print("--avx2 needs --llama-cpp-src (a llama.cpp tree to build llama-server AVX2-only from)", file=sys.stderr)
            return 2
        args.llama_server, args.llama_quantize = build_llama_avx2(args.llama_cpp_src)
    for tool in (args.llama_server, args.llama_quantize):
        if not tool.is_file():
            print(f"{tool} not found (llama.cpp peer; see benchmarks/README.md)", file=sys.stderr)
            return 2
    torch.set_num_threads(1)
    from model.loaders.checkpoint import default_model_path

    logs = Path(tempfile.mkdtemp(prefix="shapes-"))
    result = {"machine": machine_info("cpu", args.threads), "context_tokens": CONTEXT, "avx2_only": args.avx2,
              "llama_server": str(args.llama_server), "runs": []}
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
            run["built_for"] = {"ours": run["ours"]["model_card"].get("execution", {}).get("cpu_kernels"),
                                "llama-server": peer_built_for(args.llama_server, logs / f"{path.stem}.peer.0.log")}
            print(f"  built for: ours {run['built_for']['ours']}, llama-server "
                  f"{run['built_for']['llama-server']['instruction_set']}", flush=True)
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
