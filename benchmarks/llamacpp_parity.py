"""llama.cpp as the reference for the quantized formats: the default GGUF in llama.cpp (llama-cpp-python) and in
our float32 / int8 / int4 paths, on the same token ids.

    python -m benchmarks.llamacpp_parity [--model PATH] [--new-tokens 64] [--threads 2] [--out FILE]

Not part of CI: llama-cpp-python is optional (benchmarks/README.md says how to build it). For each prompt:

- greedy: every side generates `--new-tokens` tokens from the same prompt ids (EOS ignored: llama.cpp's
  `Llama.generate` never checks it, our `generate` is given no stop ids); reported per pair of sides: how many
  prompts gave identical tokens, and the tokens in common before the first difference;
- logits: every side is run teacher-forced over the same sequence (the prompt + llama.cpp's greedy tokens), so the
  positions align whatever the greedy runs did; at each of the `--new-tokens` positions that predict a generated
  token: the largest and the mean |logit difference| over the vocabulary, top-1 agreement, and KL(ref || side).
  Our quantized sides compute every row with their few-row (decode) kernels, as a generated token is computed.

Two ablations, not serving modes, tell where the int4 path's distance to llama.cpp comes from, by writing
llama.cpp's arithmetic out in PyTorch over the int4 model's weights:
- `int4-q8_1`: the matmuls as ggml-cpu does them: Q4_1 blocks against activations quantized to Q8_1 with float16
  `d` and `s = d * sum(q)` (`ggml_vec_dot_q4_1_q8_1`), the file's Q8_0 head (not our per-channel int8 one) against
  Q8_0 activations (`ggml_vec_dot_q8_0_q8_0`);
- `int4-ggml`: that, plus attention as llama-cpp-python runs it by default (no flash attention, float16 K/V
  cache): K and V stored as float16 after RoPE, q converted to float16 for q k^T (ggml's mul_mat converts its
  second operand to the first's `vec_dot_type`), scale and softmax in float32 (`soft_max_ext`), the
  probabilities converted to float16 for the product with V. Greedy by recomputing the whole sequence each step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.machine import machine_info
from model.generate import generate
from model.loaders.checkpoint import LoadedModel, load_model
from model.quantize import GROUP_SIZE, Int4Linear

CHATS = ["What is the capital of France?", "What is 2+2?"]
PLAIN = ["The history of the Roman Empire begins", "def fibonacci(n):\n    ",
         "Once upon a time, in a small village by the sea,"]
SETTINGS = ("float32", "int8", "int4", "int4-q8_1", "int4-ggml")


def _progress(msg: str) -> None:
    print(f"[llamacpp_parity] {msg}", file=sys.stderr, flush=True)


# ---- llama.cpp's arithmetic in PyTorch (the int4-ggml ablation) ---------------------------------------------

def _q8_blocks(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x (M, K) -> llama.cpp's int8 blocks of 32 (`quantize_row_q8_1`, AVX2): q (M, K) integral floats, q = round(x *
    127 / amax), ties to even; d (M, K/32) = amax / 127 stored as float16; s (M, K/32) = d * sum(q) stored as float16."""
    M, K = x.shape
    b = x.float().reshape(M, K // GROUP_SIZE, GROUP_SIZE)
    amax = b.abs().amax(-1)  # (M, K/32)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(b * inv[..., None])  # torch.round: ties to even, as _mm256_round_ps(_MM_ROUND_NEAREST)
    d = amax / 127.0
    s = (d * q.sum(-1)).half().float()
    return q.reshape(M, K), d.half().float(), s


class GgmlQ41Linear(nn.Module):
    """An Int4Linear (the file's Q4_1 blocks) multiplied as `ggml_vec_dot_q4_1_q8_1`:
    y = sum_b d_w d_x sum_j q_w q_x + m_w s_x, with the activation's d_x and s_x rounded to float16."""

    def __init__(self, layer: Int4Linear) -> None:
        super().__init__()
        q, d, m = layer.unpacked()  # (N, K), (N, K/32), (N, K/32)
        N, K = q.shape
        self.wd = (q.float().reshape(N, K // GROUP_SIZE, GROUP_SIZE) * d[..., None]).reshape(N, K)  # (N, K) q d
        self.m = m  # (N, K/32)
        self.out_features = N

    def forward(self, x: Tensor) -> Tensor:  # (..., K) -> (..., N)
        x2 = x.reshape(-1, x.shape[-1])
        q, d, s = _q8_blocks(x2)
        qd = (q.reshape(x2.shape[0], -1, GROUP_SIZE) * d[..., None]).reshape(x2.shape)  # (M, K)
        return (F.linear(qd, self.wd) + F.linear(s, self.m)).view(*x.shape[:-1], self.out_features)


class GgmlQ80Head(nn.Module):
    """The tied Q8_0 embedding as the LM head, as `ggml_vec_dot_q8_0_q8_0`: the file's weights (dequantized exactly:
    q_w d_w is exact in float32) against activations quantized to Q8_0 (d in float16)."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = weight.detach().float()  # (V, D)

    def forward(self, x: Tensor) -> Tensor:  # (..., D) -> (..., V)
        x2 = x.reshape(-1, x.shape[-1])
        q, d, _ = _q8_blocks(x2)
        qd = (q.reshape(x2.shape[0], -1, GROUP_SIZE) * d[..., None]).reshape(x2.shape)
        return F.linear(qd, self.weight).view(*x.shape[:-1], self.weight.shape[0])


class GgmlAttention:
    """Causal attention over the call's tokens as llama.cpp's default CPU graph computes it (see the module doc):
    a `KVCacheContext` for `Transformer.forward`, which calls `begin_forward` and then `attend` per layer."""

    def begin_forward(self, positions: Tensor) -> None:
        pass

    def edit(self, layer: int, site: str, x: Tensor) -> Tensor:
        return x  # no interventions here

    def adapt(self, layer: int, site: str, x: Tensor, y: Tensor) -> Tensor:
        return y  # no adapters here

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # (B, T, H|K, E) -> (B, T, H, E)
        B, T, H, E = q.shape
        rep = H // k.shape[2]
        q16 = q.half().float()
        k16 = k.half().float().repeat_interleave(rep, dim=2)  # (B, T, H, E): the float16 cache, per query head
        v16 = v.half().float().repeat_interleave(rep, dim=2)
        scores = torch.einsum("bthe,bshe->bhts", q16, k16) * E ** -0.5  # (B, H, T, T) float32
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1).half().float()
        return torch.einsum("bhts,bshe->bthe", probs, v16)


def ggml_arithmetic(lm: LoadedModel) -> LoadedModel:
    """The int4 model, in place, with every quantized layer and the head computed as llama.cpp computes them."""
    model = lm.model
    for layer in model.layers:
        att, ffn = layer.attention, layer.feed_forward
        att.wqkv, att.wo = GgmlQ41Linear(att.wqkv), GgmlQ41Linear(att.wo)
        ffn.w13, ffn.w2 = GgmlQ41Linear(ffn.w13), GgmlQ41Linear(ffn.w2)
    model.output = GgmlQ80Head(model.tok_embeddings.weight)  # tied: the embedding table is the file's Q8_0 head
    return lm


# ---- the sides -------------------------------------------------------------------------------------------------

class Ours:
    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        mode = "int4" if name.startswith("int4") else ("none" if name == "float32" else name)
        self.lm = load_model(path, torch.float32, "cpu", quantization=mode)
        if name in ("int4-q8_1", "int4-ggml"):
            ggml_arithmetic(self.lm)
        self.attention = GgmlAttention() if name == "int4-ggml" else None

    @torch.inference_mode()
    def greedy(self, prompt: list[int], n: int) -> list[int]:
        if self.attention is None:
            return list(generate(self.lm.model, prompt, n))  # no stop ids: all n, as llama.cpp's generate
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(self.logits(seq)[-1].argmax()))
        return seq[len(prompt):]

    @torch.inference_mode()
    def logits(self, seq: list[int]) -> Tensor:  # (T, V) float32
        tokens = torch.tensor([seq])
        if self.attention is not None:
            return self.lm.model(tokens, torch.arange(len(seq)).unsqueeze(0), self.attention)[0].float()
        return self.lm.model(tokens)[0].float()  # every row through the quantized kernels, as in a decode step


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, path: Path, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        # logits_all: keep every position's logits (Llama.scores). Defaults otherwise, as a user gets them:
        # float16 K/V cache, no flash attention (llama-cpp-python's default), n_batch 512.
        self.llm = Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, logits_all=True,
                         verbose=False)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        self.llm.reset()
        out = []
        for tok in self.llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True):
            out.append(int(tok))
            if len(out) == n:
                break
        return out

    def logits(self, seq: list[int]) -> Tensor:
        self.llm.reset()
        self.llm.eval(seq)
        return torch.from_numpy(self.llm.scores[: len(seq)].copy()).float()


# ---- comparison ----------------------------------------------------------------------------------------------

def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(greedy: dict[str, list[list[int]]], logits: dict[str, list[Tensor]], pairs: list[tuple[str, str]]) -> list[dict]:
    rows = []
    for side, ref in pairs:
        prefixes = [_common_prefix(a, b) for a, b in zip(greedy[side], greedy[ref])]
        dmax, dmean, kls, top1 = [], [], [], []
        for a, b in zip(logits[side], logits[ref]):  # (n, V) each: the positions that predict generated tokens
            diff = (a - b).abs()
            dmax.append(diff.amax(-1))
            dmean.append(diff.mean(-1))
            lb, la = b.log_softmax(-1), a.log_softmax(-1)
            kls.append((lb.exp() * (lb - la)).sum(-1))
            top1.append(a.argmax(-1) == b.argmax(-1))
        dmax, dmean, kl, same = torch.cat(dmax), torch.cat(dmean), torch.cat(kls), torch.cat(top1)
        rows.append({
            "side": side, "reference": ref,
            "greedy_identical": sum(p == len(g) for p, g in zip(prefixes, greedy[side])), "prompts": len(prefixes),
            "greedy_common_prefix": prefixes,
            "top1_agreement": float(same.float().mean()),
            "max_abs_logit_diff": float(dmax.max()), "mean_abs_logit_diff": float(dmean.mean()),
            "median_max_abs_logit_diff": float(dmax.median()),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
        })
    return rows


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    _progress("float32: loading")
    sides: dict[str, object] = {"float32": Ours("float32", args.model)}
    tok, path = sides["float32"].lm.tokenizer, sides["float32"].lm.path
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}]), add_bos=False) for c in CHATS]
    prompts += [tok.encode(p) for p in PLAIN]
    n_ctx = max(len(p) for p in prompts) + args.new_tokens + 8
    _progress("llama.cpp: loading")
    sides["llama.cpp"] = LlamaCpp(path, args.threads, n_ctx)
    ref = sides["llama.cpp"]
    greedy: dict[str, list[list[int]]] = {"llama.cpp": [ref.greedy(p, args.new_tokens) for p in prompts]}
    seqs = [p + g for p, g in zip(prompts, greedy["llama.cpp"])]  # the sequences every side is teacher-forced on

    def positions(x: Tensor, prompt: list[int]) -> Tensor:  # (T, V) -> (n, V): positions predicting the new tokens
        return x[len(prompt) - 1: len(prompt) - 1 + args.new_tokens]

    logits = {"llama.cpp": [positions(ref.logits(s), p) for s, p in zip(seqs, prompts)]}
    for name in ["float32"] + [s for s in args.settings if s != "float32"]:
        if name not in sides:
            _progress(f"{name}: loading")
            sides[name] = Ours(name, path)
        _progress(f"{name}: greedy and teacher-forced logits")
        t = time.perf_counter()
        greedy[name] = [sides[name].greedy(p, args.new_tokens) for p in prompts]
        logits[name] = [positions(sides[name].logits(s), p) for s, p in zip(seqs, prompts)]
        _progress(f"{name}: {time.perf_counter() - t:.0f} s")
        if name != "float32":
            del sides[name]  # one quantized model at a time
    ours = [s for s in args.settings if s in greedy]
    pairs = [(s, "llama.cpp") for s in ours] + [(s, "float32") for s in ours if s != "float32"] + [("llama.cpp", "float32")]
    # the ablations against our own int4: how far the same scheme moves when only roundings and sum order change
    pairs += [(s, "int4") for s in ours if s in ("int4-q8_1", "int4-ggml") and "int4" in ours]
    import llama_cpp

    return {
        "machine": machine_info("cpu", args.threads) | {"llama_cpp_python_version": llama_cpp.__version__},
        "load_avg_before": load_before, "load_avg_after": os.getloadavg()[0],
        "model": str(path), "new_tokens": args.new_tokens, "threads": args.threads,
        "prompts": CHATS + PLAIN, "prompt_tokens": [len(p) for p in prompts],
        "greedy_text": {s: [tok.decode(g[:16]) for g in greedy[s]] for s in greedy},
        "comparisons": compare(greedy, logits, pairs),
    }


def print_table(r: dict) -> None:
    n = r["comparisons"][0]["prompts"]
    print(f"\n{n} prompts, {r['new_tokens']} greedy tokens each; logits teacher-forced on llama.cpp's greedy sequence "
          f"({r['threads']} threads, load avg {r['load_avg_before']:.1f} -> {r['load_avg_after']:.1f})\n")
    print("| side | vs | identical greedy runs | tokens before the first difference | top-1 agreement | max abs logit diff "
          "| mean abs logit diff | mean KL |")
    print("|---|---|---|---|---|---|---|---|")
    for c in r["comparisons"]:
        print(f"| {c['side']} | {c['reference']} | {c['greedy_identical']}/{c['prompts']} | "
              f"{', '.join(map(str, c['greedy_common_prefix']))} | {c['top1_agreement']:.3f} | "
              f"{c['max_abs_logit_diff']:.3f} | {c['mean_abs_logit_diff']:.4f} | {c['mean_kl']:.5f} |")
    print()
    for side, texts in r["greedy_text"].items():
        print(f"{side:>10}: {texts[0]!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llamacpp_parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: the default model)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/llamacpp-parity.json"))
    args = p.parse_args(argv)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("error: llama-cpp-python is not installed (benchmarks/README.md, \"llama.cpp peers\")", file=sys.stderr)
        return 2
    result = run(args)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    _progress(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
