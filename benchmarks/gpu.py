"""One prepared GPU run (a few minutes on an H200): decode speed against the HBM ceiling, concurrency, HF peer.

    .venv/bin/python -m benchmarks.gpu                 # on the CUDA machine (install torch's CUDA build first)
    .venv/bin/python -m benchmarks.gpu --dry-run       # tiny random models on CPU: every code path but graph capture

Prints, for the default model (SmolLM2-135M-Instruct Q4_1 GGUF, bfloat16) and a Llama-2-7B-shaped model with
random bfloat16 weights (no checkpoint needed; HF transformers gets the very same tensors):
- single-stream decode tok/s: the engine as it serves (paged KV, decode steps as CUDA graphs per batch-size
  bucket with the Triton paged-attention kernel), and a static decoder over the same
  `Transformer` modules with a static KV slab and the whole step (forward + greedy argmax + cache write) captured
  in one CUDA graph per batch size, so decode makes no host round trip; HF `generate` as the peer;
- percent of the HBM ceiling: weight bytes per token / 4.8 TB/s (H200 spec) and / the copy bandwidth measured
  in the same run;
- output tok/s at 1, 8, 32 and 128 concurrent requests (128-token prompts, equal lengths): engine (continuous
  batching), CUDA-graph static decode (lock-step batch), HF batched `generate`; and the growth from 1 to 128.
Writes `benchmarks/results/gpu.json`. Targets (issue 8): 7B single stream >= 70% of the HBM ceiling, SmolLM2
>= 1000 tok/s, throughput x20 from 1 to 128 concurrent.
"""

from __future__ import annotations

import os

for _var, _value in (("TQDM_DISABLE", "1"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "error")):
    os.environ.setdefault(_var, _value)

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks import hf_peer, ours
from benchmarks.ceilings import weight_bytes_per_token
from benchmarks.machine import machine_info
from benchmarks.measure import Clock
from model.attention import sdpa
from model.kernels import triton_attention
from model.config import KNOWN_SHAPES, ModelConfig
from model.transformer import Transformer

H200_HBM_TB_S = 4.8
RESULTS = Path(__file__).resolve().parent / "results" / "gpu.json"


def _progress(msg: str) -> None:
    print(f"[gpu] {msg}", file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class StaticKV:
    """A KV slab of fixed shape (L, B, S_max, K, E) whose every per-step input is a device tensor: no host sync
    (unlike `KVCache.begin_forward`'s `int(positions.max())`), so a whole decode step can be graph-captured.
    Attention runs over all S_max slots with a mask (slots > position masked out)."""

    def __init__(self, model: Transformer, batch: int, max_len: int) -> None:
        c, dev = model.config, model.device
        shape = (c.n_layers, batch, max_len, c.n_kv_heads, c.head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype, device=dev)
        self.v = torch.zeros(shape, dtype=model.dtype, device=dev)
        self.slots = torch.arange(max_len, device=dev)  # (S,)
        self.rows = torch.arange(batch, device=dev).unsqueeze(1)  # (B, 1)

    def begin_forward(self, positions: torch.Tensor) -> None:  # (B, T)
        self.positions = positions
        self.mask = (self.slots <= positions.unsqueeze(-1)).unsqueeze(1)  # (B, 1, T, S)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k[layer][self.rows, self.positions] = k  # (B, T, K, E) at their positions
        self.v[layer][self.rows, self.positions] = v
        return sdpa(q, self.k[layer], self.v[layer], self.mask)


class StaticDecoder:
    """Greedy lock-step decode of `batch` equal-length prompts; on CUDA one graph replays the whole step."""

    def __init__(self, model: Transformer, batch: int, max_len: int, use_graph: bool) -> None:
        self.model, dev = model, model.device
        self.cache = StaticKV(model, batch, max_len)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=dev)  # (B, 1) the step's input token
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=dev)  # (B, 1)
        self.graph = None
        if use_graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.inference_mode():
                for _ in range(2):  # warm-up outside the graph (kernel selection, allocator pools)
                    self._step()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), torch.inference_mode():
                self._step()

    def _step(self) -> None:
        logits = self.model(self.tokens, self.positions, self.cache)  # (B, 1, V)
        self.tokens.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.positions.add_(1)

    @torch.inference_mode()
    def run(self, prompts: torch.Tensor, new_tokens: int) -> tuple[list[list[int]], float]:
        """prompts (B, P) -> (tokens per row, decode seconds for new_tokens - 1 steps after the first token)."""
        B, P = prompts.shape
        pos = torch.arange(P, device=prompts.device).expand(B, P)
        logits = self.model(prompts, pos, self.cache, logits_indices=torch.tensor([P - 1], device=prompts.device))
        self.tokens.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.positions.fill_(P)
        out = [self.tokens.clone()]
        _sync(prompts.device)
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.graph.replay() if self.graph is not None else self._step()
            out.append(self.tokens.clone())  # a device copy: no host round trip
        _sync(prompts.device)
        seconds = time.perf_counter() - t0
        return torch.cat(out, dim=1).tolist(), seconds


def copy_bandwidth_gb_s(device: torch.device, mb: int) -> float:
    """Device memory bandwidth measured in this run: a large copy reads and writes every byte (2x its size)."""
    a = torch.empty(mb * 2**20, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(device)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best / 1e9


def hf_twin(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A random-weight HF LlamaForCausalLM of `config`'s shape and our Transformer over the same tensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from model.loaders.assemble import ModelAssembler
    from model.loaders.hf import hf_to_ours

    hf_cfg = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len, rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_embeddings,
    )
    with torch.device("meta"):
        hf = LlamaForCausalLM(hf_cfg).to(dtype)
    hf = hf.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.fill_(1.0) if p.ndim == 1 else p.normal_(0, 0.02, generator=g)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_cfg).to(device)  # to_empty left its inv_freq buffer empty
    hf.tie_weights()  # to_empty gave the tied head its own (separately initialized) storage
    hf = hf.eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    asm = ModelAssembler(config, "random weights", dtype, device, "assemble")
    for name, t in hf.state_dict().items():
        ours_name = hf_to_ours(name)
        if ours_name is not None and ours_name in asm.expected:
            asm.add(ours_name, t, name)
    return hf, asm.finish()


def _engine(model: Transformer, tokenizer, device: torch.device, max_seqs: int, kv_bytes: int, graphs: bool):
    from model.engine import Engine, EngineConfig

    # on CPU (--dry-run) "eager": the static-buffer decode step without capture, so the dry run covers that path too
    mode = ("auto" if device.type == "cuda" else "eager") if graphs else "off"
    return Engine(model, tokenizer, EngineConfig(kv_cache_bytes=kv_bytes, max_num_seqs=max_seqs,
                                                 max_num_batched_tokens=4096, decode_graphs=mode))


def bench_model(name: str, model: Transformer, tokenizer, hf, args: argparse.Namespace, device: torch.device) -> dict:
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (max(args.concurrency), args.prompt_len), generator=g).to(device)  # (Bmax, P)
    wbytes = weight_bytes_per_token(model)
    r: dict = {"weight_bytes_per_token": wbytes, "parameters": model.config.num_parameters()}
    max_len = args.prompt_len + args.new_tokens + 8
    use_graph = device.type == "cuda" and not args.no_graphs
    # ---- engine, as it serves: on CUDA its decode steps replay CUDA graphs per batch-size bucket ---------------
    kv_bytes = min(args.kv_gb << 30, max(64 << 20, 2 * max(args.concurrency) * max_len * _kv_bytes_per_token(model)))
    engine = _engine(model, tokenizer, device, max(args.concurrency), kv_bytes, not args.no_graphs)
    r["engine_decode_graphs"] = engine.decode_graphs is not None
    ours.warm_up(engine, vocab)
    clock = Clock(device)
    single = ours.run_single(engine, prompts[0].tolist(), args.new_tokens, clock)
    r["engine_single_tok_s"] = single.decode_tok_s
    r["engine_concurrent_tok_s"] = {}
    for b in args.concurrency:
        res = ours.run_concurrent(engine, prompts[:b].tolist(), args.new_tokens, clock, tag=f"c{b}")
        r["engine_concurrent_tok_s"][b] = res.summary()["throughput_tok_s"]
    if engine.decode_graphs is not None:
        r["engine_graph_buckets"] = sorted(engine.decode_graphs.graphs)
        r["engine_graph_buckets_failed"] = sorted(engine.decode_graphs.failed)
        # the same request without graphs (and without the Triton kernel's replay): the tokens should agree
        eager = _engine(model, tokenizer, device, 1, 64 << 20, graphs=False)
        ours.warm_up(eager, vocab)
        eager_single = ours.run_single(eager, prompts[0].tolist(), args.new_tokens, clock)
        r["engine_eager_single_tok_s"] = eager_single.decode_tok_s
        r["engine_graph_tokens_equal_eager"] = eager_single.token_ids == single.token_ids
        del eager
    del engine
    # ---- static decode, one CUDA graph per batch size ---------------------------------------------------------
    r["graph_tok_s"] = {}
    graph_tokens = None
    for b in args.concurrency:
        dec = StaticDecoder(model, b, max_len, use_graph)
        toks, seconds = dec.run(prompts[:b], args.new_tokens)
        r["graph_tok_s"][b] = b * (args.new_tokens - 1) / seconds
        graph_tokens = graph_tokens or toks[0]
        del dec
        gc.collect()
    r["graph_single_tok_s"] = r["graph_tok_s"][args.concurrency[0]]
    r["graph_tokens_equal_engine_single"] = graph_tokens == single.token_ids
    # ---- the peer ---------------------------------------------------------------------------------------------
    if hf is not None:
        with torch.inference_mode():  # the same function: last-position logits of one prompt, both sides
            ref = hf(prompts[:1]).logits[0, -1].float()
            r["last_logits_max_abs_diff_vs_hf"] = (model(prompts[:1])[0, -1].float() - ref).abs().max().item()
            r["last_logits_max_abs_hf"] = ref.abs().max().item()
        hf_peer.warm_up(hf)
        r["hf_single_tok_s"] = hf_peer.generate_single(hf, prompts[0].tolist(), args.new_tokens, clock).decode_tok_s
        r["hf_batched_tok_s"] = {}
        for b in args.concurrency:
            res = hf_peer.run_batched(hf, prompts[:b].tolist(), args.new_tokens, clock)
            r["hf_batched_tok_s"][b] = res.summary()["throughput_tok_s"]
    # ---- against the ceiling ----------------------------------------------------------------------------------
    ceiling_spec = H200_HBM_TB_S * 1e12 / wbytes
    ceiling_measured = args.bandwidth_gb_s * 1e9 / wbytes
    for side in ("engine_single_tok_s", "graph_single_tok_s", "hf_single_tok_s"):
        if side in r:
            r[side.replace("tok_s", "pct_hbm_spec")] = 100 * r[side] / ceiling_spec
            r[side.replace("tok_s", "pct_measured_bw")] = 100 * r[side] / ceiling_measured
    r["ceiling_tok_s_hbm_spec"], r["ceiling_tok_s_measured_bw"] = ceiling_spec, ceiling_measured
    lo, hi = args.concurrency[0], args.concurrency[-1]
    for key in ("engine_concurrent_tok_s", "graph_tok_s", "hf_batched_tok_s"):
        if key in r:
            r[key.replace("tok_s", "growth")] = r[key][hi] / r[key][lo]
    _progress(f"{name}: " + json.dumps({k: v for k, v in r.items() if not isinstance(v, dict)}, default=float))
    return r


def _kv_bytes_per_token(model: Transformer) -> int:
    c = model.config
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * model.tok_embeddings.weight.element_size()


def _byte_tokenizer_for(vocab: int):
    """A stand-in tokenizer for random models (the engine detokenizes every token): bytes, ids wrapped."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    from model.text.tokenizer import Tokenizer

    backend = Backend(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    return Tokenizer(backend, bos_id=None, eos_id=0, stop_ids=set(), add_bos=False)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    args.bandwidth_gb_s = copy_bandwidth_gb_s(device, 64 if args.dry_run else 4096)
    _progress(f"{device}: copy bandwidth {args.bandwidth_gb_s:.0f} GB/s")
    out: dict = {"machine": machine_info(device, torch.get_num_threads()), "dtype": str(dtype),
                 "measured_copy_bandwidth_gb_s": args.bandwidth_gb_s, "hbm_spec_tb_s": H200_HBM_TB_S,
                 "workload": {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                              "concurrency": args.concurrency, "decoding": "greedy, EOS ignored, random prompt ids"},
                 "models": {},
                 # how the engine's decode rows attend over the paged pool (model/kernels/triton_attention.py)
                 "engine_decode_attention": ("triton paged kernel" if triton_attention.available(torch.empty(0, device=device), 16)
                                             else "gather + SDPA")}
    shapes = {"smollm2-135m": None, "llama-2-7b": KNOWN_SHAPES["llama-2-7b"]}
    if args.dry_run:  # tiny stand-ins with each shape's structure (GQA + tied head; MHA + untied head)
        tiny = dict(dim=64, n_layers=2, vocab_size=300, n_heads=4, head_dim=16, rope_dim=16)
        shapes = {"smollm2-135m (tiny stand-in)": KNOWN_SHAPES["smollm2-135m"].replace(hidden_dim=128, n_kv_heads=2, **tiny),
                  "llama-2-7b (tiny stand-in)": KNOWN_SHAPES["llama-2-7b"].replace(hidden_dim=160, n_kv_heads=4, **tiny)}
    for name, config in shapes.items():
        _progress(f"{name}: loading")
        if config is None:  # the default model's GGUF, both sides from the same file
            from model.loaders.checkpoint import load_model

            lm = load_model(None, dtype, device)
            model, tokenizer = lm.model, lm.tokenizer
            hf = None if args.skip_hf else hf_peer.load_hf(lm.path, dtype, device)
        else:
            hf, model = hf_twin(config, dtype, device)
            tokenizer = _byte_tokenizer_for(config.vocab_size)
            hf = None if args.skip_hf else hf
        out["models"][name] = bench_model(name, model, tokenizer, hf, args, device)
        del model, hf
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def print_report(r: dict) -> None:
    print(f"\n{r['machine'].get('gpu_name') or r['machine'].get('cpu_model')}, {r['dtype']}; copy bandwidth "
          f"{r['measured_copy_bandwidth_gb_s']:.0f} GB/s measured, {r['hbm_spec_tb_s']} TB/s HBM spec; engine decode "
          f"attention: {r.get('engine_decode_attention')}")
    for name, m in r["models"].items():
        print(f"\n{name}: {m['weight_bytes_per_token'] / 1e9:.2f} GB of weights per token; ceiling "
              f"{m['ceiling_tok_s_hbm_spec']:.0f} tok/s (spec), {m['ceiling_tok_s_measured_bw']:.0f} (measured)")
        for side in ("engine_single", "graph_single", "hf_single"):
            if f"{side}_tok_s" in m:
                print(f"  {side:<14} {m[f'{side}_tok_s']:>9.1f} tok/s  {m[f'{side}_pct_hbm_spec']:>5.1f}% of HBM spec"
                      f"  {m[f'{side}_pct_measured_bw']:>5.1f}% of measured")
        print(f"  {'concurrent':<14} " + " ".join(f"{b:>9}" for b in m["graph_tok_s"]) + "   growth")
        for key in ("engine_concurrent", "graph", "hf_batched"):
            if f"{key}_tok_s" in m:
                vals = m[f"{key}_tok_s"]
                print(f"  {key:<14} " + " ".join(f"{v:>9.1f}" for v in vals.values()) + f"   x{m[f'{key}_growth']:.1f}")
        print(f"  graph decode tokens equal the engine's (single stream): {m['graph_tokens_equal_engine_single']}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dry-run", action="store_true", help="tiny random models, few tokens (CPU: a smoke test)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--kv-gb", type=int, default=24, help="engine KV pool cap in GiB")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--no-graphs", action="store_true", help="static decode without CUDA graph capture")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.dry_run:
        args.prompt_len, args.new_tokens, args.concurrency = 8, 4, [1, 2]
    elif args.device == "cpu":
        p.error("this script is for a CUDA machine; on CPU run it with --dry-run (or use benchmarks.bench_decode)")
    results = run(args)
    results["tensor_parallel"] = tensor_parallel_line(args)
    results["command"] = " ".join(["python -m benchmarks.gpu", *(sys.argv[1:] if argv is None else argv)])
    results["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    out = args.out or RESULTS.with_name("gpu-dry-run.json" if args.dry_run else "gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=float) + "\n")
    print_report(results)
    tp = results["tensor_parallel"]
    if "skipped" in tp:
        print(f"\ntensor parallelism: skipped, {tp['skipped']}")
    else:
        tpn = tp[f"tp{tp['tp']}"]
        same = "equal" if tp["greedy_tokens_equal"] else "DIFFER"
        print(f"\ntensor parallelism (benchmarks.tp_gpu): TP=1 {tp['tp1']['decode_tok_s']:.1f} tok/s, TP={tp['tp']} "
              f"{tpn['decode_tok_s']:.1f} tok/s ({tp['speedup']:.2f}x), greedy tokens {same}")
    print(f"\nresults: {out}")
    return results


def tensor_parallel_line(args: argparse.Namespace) -> dict:
    """TP=1 vs TP=N (benchmarks/tp_gpu.py) with N the largest power of two up to 8 GPUs, where there are two or more."""
    n = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    if args.dry_run or n < 2:
        return {"skipped": f"needs 2+ GPUs ({n} here)" if not args.dry_run else "dry run"}
    from benchmarks import tp_gpu

    size = 1 << (min(n, 8).bit_length() - 1)
    return tp_gpu.main(["--tp", str(size)])


if __name__ == "__main__":
    main()
