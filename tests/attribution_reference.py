"""Attribution and head-level patching written from their definitions with HF transformers forward hooks on a
LlamaForCausalLM: the references tests/model/test_attribution.py and tests/service/test_attribution_api.py hold
ours to (float32, 1e-4).

Sites as TransformerLens and model/interventions.py name them: block_output (a decoder layer's output),
attention_output (self_attn's output), mlp_output (mlp's output); head_q / head_k / head_v (q_proj / k_proj / v_proj's
outputs per head, before RoPE: TransformerLens' hook_q / hook_k / hook_v) and head_output (o_proj's input per head:
hook_z)."""

from __future__ import annotations

import torch

RESIDUAL = ("attention_output", "mlp_output", "block_output")
HEADS = ("head_q", "head_k", "head_v", "head_output")


def _module(hf, layer: int, site: str):
    block = hf.model.layers[layer]
    a = block.self_attn
    return {"block_output": block, "attention_output": a, "mlp_output": block.mlp, "head_q": a.q_proj,
            "head_k": a.k_proj, "head_v": a.v_proj, "head_output": a.o_proj}[site]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _with(out, x):
    return (x,) + tuple(out[1:]) if isinstance(out, tuple) else x


def metric(logits: torch.Tensor, answer: int, contrast: int | None) -> torch.Tensor:
    """logits (V,) -> logit_diff (contrast given) or log p(answer)."""
    if contrast is not None:
        return logits[answer] - logits[contrast]
    return logits.log_softmax(-1)[answer]


def run(hf, ids: list[int], sites, layers, edit=None) -> dict:
    """One HF forward; `edit(layer, site, x)` may replace a site's activation x (1, T, width) (head sites: the
    projection's output, or o_proj's input). -> {"values": {(layer, site): (T, width)}, "logits": (V,) last position}."""
    values: dict = {}
    handles = []

    def hook_for(l, s):
        if s == "head_output":
            def pre(mod, args):
                x = args[0]
                if edit is not None:
                    x = edit(l, s, x)
                values[(l, s)] = x[0]
                return (x,) + tuple(args[1:])
            return _module(hf, l, s).register_forward_pre_hook(pre)

        def post(mod, args, out):
            x = _first(out)
            if edit is not None:
                x = edit(l, s, x)
            values[(l, s)] = x[0]
            return _with(out, x)
        return _module(hf, l, s).register_forward_hook(post)

    for l in layers:
        for s in sites:
            handles.append(hook_for(l, s))
    try:
        logits = hf(torch.tensor([ids])).logits[0, -1]
    finally:
        for h in handles:
            h.remove()
    return {"values": values, "logits": logits}


@torch.no_grad()
def direct_logit(hf, ids: list[int], answer: int, contrast: int) -> dict:
    """TransformerLens' logit_attrs of decompose_resid / stack_head_results with the final RMSNorm's scale frozen."""
    cfg = hf.config
    H, E = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    L = cfg.num_hidden_layers
    kept: dict = {}
    handles = [hf.model.embed_tokens.register_forward_hook(lambda m, a, o: kept.__setitem__("embed", o[0, -1])),
               hf.model.norm.register_forward_pre_hook(lambda m, a: kept.__setitem__("final", a[0][0, -1]))]
    out = run(hf, ids, ("head_output", "mlp_output"), range(L))
    for h in handles:
        h.remove()
    x = kept["final"].double()
    scale = torch.rsqrt(x.pow(2).mean() + cfg.rms_norm_eps)
    w_u = hf.lm_head.weight.double()
    u = hf.model.norm.weight.double() * scale * (w_u[answer] - w_u[contrast])  # (D,)
    heads, mlp = [], []
    for l in range(L):
        z = out["values"][(l, "head_output")][-1].double().view(H, E)  # (H, E)
        wo = _module(hf, l, "head_output").weight.double()  # (D, H E)
        heads.append([float(u @ (wo[:, h * E : (h + 1) * E] @ z[h])) for h in range(H)])
        mlp.append(float(u @ out["values"][(l, "mlp_output")][-1].double()))
    logits = out["logits"].double()
    return {"embed": float(u @ kept["embed"].double()), "heads": heads, "mlp": mlp,
            "logit_diff": float(logits[answer] - logits[contrast])}


def head_width(hf, site: str) -> tuple[int, int]:
    """(heads, head_dim) of a head site."""
    cfg = hf.config
    E = cfg.hidden_size // cfg.num_attention_heads
    n = cfg.num_key_value_heads if site in ("head_k", "head_v") else cfg.num_attention_heads
    return n, E


def attribution_patching(hf, source: list[int], target: list[int], answer: int, contrast: int | None, sites, layers,
                         positions) -> dict:
    """(a_source - a_target) . dm/da at the target, by HF autograd through the whole model -> ({(site, layer, head,
    position): estimate} (head None at the residual sites), {(layer, site): dm/da (T, width)})."""
    with torch.no_grad():
        src = run(hf, source, sites, layers)["values"]
    probes: dict = {}

    def add_probe(l, s, x):
        p = torch.zeros_like(x, requires_grad=True)
        probes[(l, s)] = p
        return x + p

    with torch.enable_grad():
        tgt = run(hf, target, sites, layers, add_probe)
        m = metric(tgt["logits"].float(), answer, contrast)
        keys = list(probes)
        grads = dict(zip(keys, torch.autograd.grad(m, [probes[k] for k in keys])))
    out = {}
    for (l, s), g in grads.items():
        delta = (src[(l, s)] - tgt["values"][(l, s)]).detach().double()  # (T, width)
        g = g[0].double()
        if s in HEADS:
            n, E = head_width(hf, s)
            est = (delta.view(-1, n, E) * g.view(-1, n, E)).sum(-1)  # (T, n)
            for h in range(n):
                for p in positions:
                    out[(s, l, h, p)] = float(est[p, h])
        else:
            est = (delta * g).sum(-1)
            for p in positions:
                out[(s, l, None, p)] = float(est[p])
    return out, {k: g[0].float() for k, g in grads.items()}


def patch_cell(hf, source_values: dict, target: list[int], answer: int, contrast: int | None, site: str, layer: int,
               head: int | None, position: int) -> float:
    """The target run with one activation (a head's slice at a head site) replaced by the source's -> the metric."""
    E = head_width(hf, site)[1] if head is not None else None
    cols = slice(None) if head is None else slice(head * E, (head + 1) * E)

    def edit(l, s, x):
        x = x.clone()
        x[0, position, cols] = source_values[(l, s)][position, cols]
        return x

    with torch.no_grad():
        out = run(hf, target, (site,), (layer,), edit)
    return float(metric(out["logits"].double(), answer, contrast))
