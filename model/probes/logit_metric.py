"""The metric attribution reads at the last position, and its gradient there, through the served LM head.

    logit_diff   logit(answer) - logit(contrast)     d/dn = W[answer] - W[contrast]
    logprob      log softmax(logits)[answer]         d/dn = W[answer] - sum_v p_v W[v]

with n = final_norm(x) the normed last residual stream and W the head's weight (V, D): the metrics of
/inspect/patch (model/probes/patching.py). The head's rows are read one block of the vocabulary at a time, each
dequantized as it is gathered for a quantized head (model/quantize/'s `QuantEmbedding`), so neither metric holds a
float copy of a quantized head.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model.quantize import QuantEmbedding, QuantLinear
from model.transformer import Transformer

VOCAB_CHUNK = 4096  # head rows gathered at once for the logprob gradient


def head_rows(model: Transformer, ids: Tensor) -> Tensor:
    """Rows `ids` (n,) of the LM head's weight -> (n, D) float32."""
    out = model.output
    if isinstance(out, nn.Linear):
        return out.weight.detach()[ids].float()
    if isinstance(out, QuantLinear):
        return QuantEmbedding(out, torch.float32, model.config.vocab_size)(ids)
    raise TypeError(f"no rows of an LM head of type {type(out).__name__}")


def scored(model: Transformer, x_last: Tensor, ids: tuple[int, ...]) -> list[float]:
    """x_last (D,) the last block's output at the last position -> the log-probabilities of `ids` there, as the
    engine scores them (the served head, log-softmax in float64)."""
    with torch.no_grad():
        logp = model.head(x_last.view(1, 1, -1))[0, 0].double().log_softmax(-1)  # (V,)
    return [float(logp[i]) for i in ids]


def metric_gradient(model: Transformer, x_last: Tensor, metric: str, answer: int, contrast: int | None) -> Tensor:
    """d metric / d x_last (D,) float32 for x_last (D,) the last block's output at the last position: the head's
    direction above, then back through the final RMSNorm (its scale depends on x too) by autograd."""
    if metric == "logit_diff":
        d_n = (head_rows(model, torch.tensor([answer, contrast], device=x_last.device)) * torch.tensor([[1.0], [-1.0]],
               device=x_last.device)).sum(0)  # (D,)
    else:
        with torch.no_grad():
            p = model.head(x_last.view(1, 1, -1))[0, 0].double().softmax(-1)  # (V,)
        d_n = head_rows(model, torch.tensor([answer], device=x_last.device))[0].double()
        for a in range(0, p.shape[0], VOCAB_CHUNK):
            ids = torch.arange(a, min(a + VOCAB_CHUNK, p.shape[0]), device=x_last.device)
            d_n -= p[ids] @ head_rows(model, ids).double()
        d_n = d_n.float()
    x = x_last.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        n = model.norm(x)  # (D,): the reference RMSNorm (the kernels have no backward)
        (grad,) = torch.autograd.grad(n, x, d_n.to(n.dtype))
    return grad.float()
