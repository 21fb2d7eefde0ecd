"""Train a residual-stream TopK sparse autoencoder for the default model, write it in SAELens' format, and report
its fraction of variance explained and next-token loss recovered.

    apt-get install python3.11-doc fortunes        # the text (Debian packages: plain English prose)
    nice -n 10 .venv/bin/python -m benchmarks.train_sae [--layer 15] [--features 4096] [--k 32] [--tokens 150000]
        [--corpus DIR_OR_FILE ...] [--out model/features/sae/shipped/NAME] [--threads 2]

Text: every file under `--corpus` (default: the Python 3.11 documentation's reStructuredText sources from Debian's
python3.11-doc, /usr/share/doc/python3.11/html/_sources, and the fortune cookies of Debian's fortunes,
/usr/share/games/fortunes, without their .dat indexes and .u8 copies). Documents are shuffled (seeded), a fixed
share of them held out for the evaluation, and each set tokenized and cut into `--ctx`-token rows (no BOS: the
default model's tokenizer adds none).

Activations: block `--layer`'s output (TransformerLens' `blocks.L.hook_resid_post`, HF's `model.layers.L`) of the
default model as served (`--quantization auto`: its Q4_1 matrices as int4), the forward stopped after that block.
Each row's first position is left out of training and of the splice below: it is the attention sink, whose
activation is orders of magnitude larger than the rest (Sun et al. 2024, "Massive Activations"; docs/inspection.md),
as SAELens leaves BOS out (`exclude_special_tokens`).

Training, as Gao et al. 2024 ("Scaling and evaluating sparse autoencoders") and EleutherAI sparsify
(`sparsify/sparse_coder.py`, `trainer.py`) train TopK: x scaled so its mean norm is sqrt(D) (SAELens'
"expected_average_only_in", folded into the weights when saving, `fold_activation_norm_scaling_factor`), b_dec
initialised to the mean, W_enc = W_dec^T with unit-norm decoder rows kept unit after each step (the gradient's
component along each row removed first), Adam at 2e-4 / sqrt(F / 2^14), MSE plus the AuxK loss (1/32, the dead
latents' top k_aux = D/2 reconstructing the residual).

Evaluation on the held-out rows, as SAELens' evals.py computes them:
    explained variance   1 - E|x - x_hat|^2 / (E|x|^2 - |E x|^2)        (`ExplainedVarianceCalculator`)
    loss recovered       (CE_zero - CE_sae) / (CE_zero - CE_clean)        (`get_recons_loss`: "ce_loss_score"),
                         CE_sae with the SAE's reconstruction spliced in at every position but the first (SAELens'
                         `ignore_tokens` mask), CE_zero with the site zero-ablated at every position.
The figures, the run's settings and the host go to `training.json` beside the weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as Fn
from safetensors.torch import save_file

from benchmarks.machine import machine_info
from model.attention import CausalAttention
from model.loaders import load_model

DEFAULT_CORPUS = ["/usr/share/doc/python3.11/html/_sources", "/usr/share/games/fortunes"]
SOURCES = {"/usr/share/doc/python3.11/html/_sources": "Debian python3.11-doc (Python 3.11 documentation sources)",
           "/usr/share/games/fortunes": "Debian fortunes (fortune cookie files)"}


def documents(paths: list[str]) -> list[str]:
    files: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise SystemExit(f"{p}: not found (apt-get install python3.11-doc fortunes, or give --corpus)")
        files += sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    docs = []
    for f in files:
        if f.suffix in (".dat", ".u8") or f.is_symlink():
            continue
        text = f.read_text(errors="ignore")
        # a fortune file is many short documents separated by "%" lines
        docs += [d.strip() for d in text.split("\n%\n")] if "fortunes" in str(f) else [text]
    return [d for d in docs if len(d) > 40]


def rows(tok, docs: list[str], ctx: int, eos: int) -> torch.Tensor:
    stream: list[int] = []
    for d in docs:
        stream += tok.encode(d, add_bos=False) + [eos]
    n = len(stream) // ctx
    return torch.tensor(stream[: n * ctx]).view(n, ctx)  # (N, ctx)


@torch.no_grad()
def block_output(model, tokens: torch.Tensor, layer: int) -> torch.Tensor:
    """tokens (B, T) -> block `layer`'s output (B, T, D), the forward stopped there."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    h, cos, sin = model.embed(tokens, positions)
    ctx = CausalAttention(None, model.config.sliding_window, model.config.attention_multiplier)
    for blk in model.layers[: layer + 1]:
        h = blk(h, cos, sin, ctx)
    return h


@torch.no_grad()
def ce_with(model, tokens: torch.Tensor, layer: int, replace) -> torch.Tensor:
    """Mean next-token CE over (B, T) with block `layer`'s output replaced by `replace(h)` (None: clean)."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    h, cos, sin = model.embed(tokens, positions)
    ctx = CausalAttention(None, model.config.sliding_window, model.config.attention_multiplier)
    for i, blk in enumerate(model.layers):
        h = blk(h, cos, sin, ctx)
        if i == layer and replace is not None:
            h = replace(h)
    logits = model.head(h)[:, :-1].float()  # (B, T-1, V)
    return Fn.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class TopKSAE(torch.nn.Module):
    def __init__(self, d: int, f: int, k: int, mean: torch.Tensor):
        super().__init__()
        w = torch.randn(f, d)
        w /= w.norm(dim=-1, keepdim=True)
        self.W_dec = torch.nn.Parameter(w)  # (F, D)
        self.W_enc = torch.nn.Parameter(w.T.clone())  # (D, F)
        self.b_enc = torch.nn.Parameter(torch.zeros(f))
        self.b_dec = torch.nn.Parameter(mean.clone())
        self.k = k

    def pre(self, x):  # (B, D) -> (B, F)
        return (x - self.b_dec) @ self.W_enc + self.b_enc

    def decode_sparse(self, values, ids):  # (B, k), (B, k) -> (B, D), without the (B, F) dense product
        return Fn.embedding_bag(ids, self.W_dec, per_sample_weights=values, mode="sum")

    def loss(self, x, dead: torch.Tensor, aux_coef: float):
        pre = self.pre(x)
        values, ids = pre.topk(self.k, dim=-1)
        values = values.relu()
        x_hat = self.decode_sparse(values, ids) + self.b_dec
        e = x - x_hat
        mse = e.pow(2).sum(-1).mean()
        aux = x.new_zeros(())
        n_dead = int(dead.sum())
        if n_dead:
            k_aux = min(x.shape[-1] // 2, n_dead)
            dv, di = pre.masked_fill(~dead, -math.inf).topk(k_aux, dim=-1)
            e_hat = self.decode_sparse(dv.relu(), di)
            aux = min(n_dead / (x.shape[-1] // 2), 1.0) * (e_hat - e.detach()).pow(2).sum(-1).mean()
        return mse + aux_coef * aux, mse, ids

    @torch.no_grad()
    def constrain(self):
        self.W_dec /= self.W_dec.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def project_grad(self):  # remove the gradient's component along each decoder row (sparsify trainer.py)
        g, w = self.W_dec.grad, self.W_dec
        g -= (g * w).sum(-1, keepdim=True) * w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--features", type=int, default=4096)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=150_000, help="training tokens (activations kept)")
    ap.add_argument("--epochs", type=float, default=4.0)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2048, help="tokens per step")
    ap.add_argument("--eval-rows", type=int, default=32)
    ap.add_argument("--corpus", nargs="+", default=DEFAULT_CORPUS)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"], help="stored weights")
    ap.add_argument("--eval-only", action="store_true", help="evaluate the dictionary already at --out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()

    loaded = load_model(quantization=args.quantization)
    model, tok = loaded.model, loaded.tokenizer
    cfg = model.config
    D, F, L = cfg.dim, args.features, args.layer
    docs = documents(args.corpus)
    random.Random(args.seed).shuffle(docs)
    n_eval = max(1, len(docs) // 50)
    eos = tok.eos_id
    train_rows = rows(tok, docs[n_eval:], args.ctx, eos)
    eval_rows = rows(tok, docs[:n_eval], args.ctx, eos)[: args.eval_rows]
    need = math.ceil(args.tokens / (args.ctx - 1))
    train_rows = train_rows[torch.randperm(len(train_rows))[:need]]
    print(f"{len(docs)} documents; {len(train_rows)} training rows of {args.ctx} tokens "
          f"({len(train_rows) * (args.ctx - 1)} used), {len(eval_rows)} held-out rows", flush=True)
    out = Path(args.out or f"model/features/sae/shipped/smollm2-135m-instruct-l{L}-resid-post-topk{F // 1024}k")
    if args.eval_only:
        run = json.loads((out / "training.json").read_text()) if (out / "training.json").exists() else {}
        evaluate(model, cfg, out, eval_rows, L, {**run, "total_seconds": run.get("total_seconds")}, args)
        return

    # --- activations -------------------------------------------------------------------------------------------
    acts = torch.empty(len(train_rows) * (args.ctx - 1), D, dtype=torch.float16)
    t_act = time.perf_counter()
    mb = 16
    for i in range(0, len(train_rows), mb):
        h = block_output(model, train_rows[i: i + mb], L)[:, 1:]  # (b, ctx-1, D): the sink position left out
        acts[i * (args.ctx - 1): (i + len(h)) * (args.ctx - 1)] = h.reshape(-1, D).half()
        if (i // mb) % 50 == 0:
            done = i + len(h)
            print(f"activations {done}/{len(train_rows)} rows, {time.perf_counter() - t_act:.0f}s", flush=True)
    act_seconds = time.perf_counter() - t_act
    scale = D ** 0.5 / acts[:65536].float().norm(dim=-1).mean().item()  # SAELens' expected_average_only_in

    # --- training -----------------------------------------------------------------------------------------------
    sample = acts[torch.randperm(len(acts))[:65536]].float() * scale
    sae = TopKSAE(D, F, args.k, sample.mean(0))
    lr = 2e-4 / math.sqrt(F / 2 ** 14)
    opt = torch.optim.Adam(sae.parameters(), lr=lr, betas=(0.9, 0.999))
    steps = int(args.epochs * len(acts) / args.batch)
    last_fired = torch.zeros(F, dtype=torch.long)
    dead_after = min(len(acts) // 4, 2_000_000)  # tokens without firing before a latent counts as dead
    t_train = time.perf_counter()
    order = torch.randperm(len(acts))
    seen = 0
    for step in range(steps):
        j = (step * args.batch) % len(acts)
        if j + args.batch > len(acts):
            order, j = torch.randperm(len(acts)), 0
        x = acts[order[j: j + args.batch]].float() * scale
        dead = (seen - last_fired) > dead_after
        loss, mse, ids = sae.loss(x, dead, 1 / 32)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sae.project_grad()
        opt.step()
        sae.constrain()
        seen += len(x)
        last_fired[ids.unique()] = seen
        if step % 20 == 0 or step == steps - 1:
            fvu = (mse / (x - x.mean(0)).pow(2).sum(-1).mean()).item()
            print(f"step {step}/{steps}: mse {mse.item():.3f}, fvu {fvu:.4f}, dead {int(dead.sum())}, "
                  f"{time.perf_counter() - t_train:.0f}s", flush=True)
    train_seconds = time.perf_counter() - t_train
    del acts

    # --- fold the scale, save in SAELens' format ------------------------------------------------------------------
    with torch.no_grad():
        W_enc, b_enc = sae.W_enc * scale, sae.b_enc.clone()
        W_dec, b_dec = sae.W_dec / scale, sae.b_dec / scale
    store = getattr(torch, args.dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file({"W_enc": W_enc.to(store).contiguous(), "b_enc": b_enc.to(store), "W_dec": W_dec.to(store).contiguous(),
               "b_dec": b_dec.to(store)}, out / "sae_weights.safetensors")
    corpus = [SOURCES.get(c, c) for c in args.corpus]
    (out / "cfg.json").write_text(json.dumps({
        "architecture": "topk", "d_in": D, "d_sae": F, "k": args.k, "rescale_acts_by_decoder_norm": False,
        "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": True, "normalize_activations": "none",
        "reshape_activations": "none",
        "metadata": {"model_name": "HuggingFaceTB/SmolLM2-135M-Instruct", "hook_name": f"blocks.{L}.hook_resid_post",
                     "hf_hook_name": f"model.layers.{L}", "context_size": args.ctx, "prepend_bos": False,
                     "dataset_path": "; ".join(corpus), "sae_lens_version": "6.54.12",
                     "sae_lens_training_version": None},
    }, indent=1) + "\n")
    run = {
        "train_tokens": len(train_rows) * (args.ctx - 1), "steps": steps, "batch": args.batch, "lr": lr,
        "scale": scale, "layer": L, "hook_name": f"blocks.{L}.hook_resid_post", "d_sae": F, "k": args.k,
        "ctx": args.ctx, "epochs": args.epochs, "corpus": corpus, "documents": len(docs),
        "quantization": loaded.quantization, "stored_dtype": args.dtype,
        "activation_seconds": act_seconds, "train_seconds": train_seconds,
        "total_seconds": time.perf_counter() - t0, "machine": machine_info("cpu", args.threads),
    }
    (out / "training.json").write_text(json.dumps(run, indent=1) + "\n")
    evaluate(model, cfg, out, eval_rows, L, run, args)


def evaluate(model, cfg, out: Path, eval_rows: torch.Tensor, L: int, run: dict, args) -> None:
    """Explained variance and loss recovered on the held-out rows, through the file as saved (our loader)."""
    from model.features.sae import load_dictionary

    D = cfg.dim

    d = load_dictionary(out, config=cfg)
    ev_sum, ev_sq, ev_res, n, l0 = torch.zeros(D, dtype=torch.float64), 0.0, 0.0, 0, 0.0
    for i in range(0, len(eval_rows), 16):
        x = block_output(model, eval_rows[i: i + 16], L)[:, 1:].reshape(-1, D).float()
        x_hat, f = d.forward(x)
        ev_sum += x.sum(0).double()
        ev_sq += x.pow(2).sum().item()
        ev_res += (x - x_hat).pow(2).sum().item()
        n += len(x)
        l0 += (f != 0).sum().item()
    fve = 1 - (ev_res / n) / (ev_sq / n - (ev_sum / n).pow(2).sum().item())

    def splice(h):  # the reconstruction at every position but the first (the sink), as SAELens' masked hook
        x_hat, _ = d.forward(h[:, 1:].reshape(-1, D).float())
        return torch.cat([h[:, :1], x_hat.view(h.shape[0], -1, D).to(h.dtype)], dim=1)

    ce = {"clean": 0.0, "sae": 0.0, "zero": 0.0}
    for i in range(0, len(eval_rows), 16):
        r = eval_rows[i: i + 16]
        w = len(r) / len(eval_rows)
        ce["clean"] += w * ce_with(model, r, L, None).item()
        ce["sae"] += w * ce_with(model, r, L, splice).item()
        ce["zero"] += w * ce_with(model, r, L, torch.zeros_like).item()
    recovered = (ce["zero"] - ce["sae"]) / (ce["zero"] - ce["clean"])
    report = {
        **run, "explained_variance": fve, "ce_loss_score": recovered, "ce_loss_without_sae": ce["clean"],
        "ce_loss_with_sae": ce["sae"], "ce_loss_with_ablation": ce["zero"], "l0": l0 / n, "eval_tokens": n,
        "bytes": (out / "sae_weights.safetensors").stat().st_size,
    }
    (out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    main()
