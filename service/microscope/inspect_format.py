"""The /inspect response: JSON layout of a `model.probes.ProbeResult` (with its feature grid), attention-map encoding,
and the byte budget.

Maps travel as little-endian float16 in base64 with their shape (`format: "base64"`, about 2.7 bytes a value) or
as nested JSON lists (`format: "list"`, about 8 bytes a value). The budget is checked on an estimate made before
any compute, so a request that would be too large costs nothing but its 413.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Generator
from dataclasses import replace

import numpy as np

from model.features import TokenTelemetry
from model.probes import (ActivationEntry, AttentionMaps, FeatureGridResult, ProbeOptions, ProbeResult,
                          estimate_map_elements)
from model.text import IncrementalDetokenizer
from model.text import Tokenizer
from service.microscope.json_pieces import drain, dumps_with_size_steps

BYTES_PER_VALUE = {"base64": 8 / 3, "list": 8.0}  # float16 in base64 (2 bytes x 4/3); a rounded decimal in JSON
BYTES_PER_TOKEN = 80  # the token list entry
BYTES_PER_NORM = 10  # one residual norm per token per layer
# tokens (or features) per unit of a `*_steps` generator: each unit a few milliseconds of the engine thread's job
ROWS_PER_UNIT = 64


def estimate_bytes(opts: ProbeOptions, fmt: str, T: int, n_layers: int, n_heads: int, dim: int = 0,
                   hidden_dtype: str = "float16") -> int:
    L = len(opts.selected_layers(n_layers))
    maps = estimate_map_elements(opts, T, n_layers, n_heads) * BYTES_PER_VALUE[fmt]
    norms = L * T * BYTES_PER_NORM if "norms" in opts.include else 0
    hidden = 0
    if "hidden_states" in opts.include:
        per_value = BYTES_PER_VALUE[fmt] * (2 if hidden_dtype == "float32" else 1)
        hidden = L * len(opts.hidden_positions or range(T)) * dim * per_value
    return int(maps + norms + hidden + T * BYTES_PER_TOKEN + L * 4096)


POOL_SIZES = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _first_fitting(candidates, fmt: str, T: int, n_layers: int, n_heads: int, budget: int) -> ProbeOptions | None:
    """The first of `candidates` (ProbeOptions, cheapest last) whose estimated response fits the budget."""
    return next((c for c in candidates if estimate_bytes(c, fmt, T, n_layers, n_heads) <= budget), None)


def cheaper_modes(opts: ProbeOptions, fmt: str, T: int, n_layers: int, n_heads: int, budget: int) -> str:
    """A sentence naming modes that fit the budget for the same layers and heads."""
    hints = []
    pooled = _first_fitting((replace(opts, mode="pooled", pool_size=b) for b in POOL_SIZES), fmt, T, n_layers, n_heads, budget)
    if pooled is not None:
        hints.append(f"mode 'pooled' with pool_size >= {pooled.pool_size}")
    topk = _first_fitting((replace(opts, mode="topk", attention_top_k=k) for k in (32, 8, 1)), fmt, T, n_layers, n_heads, budget)
    if topk is not None:
        hints.append(f"mode 'topk' with attention_top_k <= {topk.attention_top_k}")
    hints.append("mode 'rows' for chosen query positions")
    hints.append("fewer layers or heads")
    return "; use " + ", or ".join(hints)


def resolve_auto(opts: ProbeOptions, fmt: str, T: int, n_layers: int, n_heads: int, budget: int, dim: int = 0,
                 hidden_dtype: str = "float16") -> ProbeOptions:
    """mode "auto": full maps when they fit the budget (beside any hidden states asked for), else the finest
    pooling that does, else none."""
    if opts.mode != "auto":
        return opts
    if "attention" not in opts.include:
        return replace(opts, mode="none")
    candidates = [replace(opts, mode="full")] + [replace(opts, mode="pooled", pool_size=b) for b in POOL_SIZES[:8]]
    fitting = next((o for o in candidates if estimate_bytes(o, fmt, T, n_layers, n_heads, dim, hidden_dtype) <= budget), None)
    return fitting or replace(opts, mode="none")


def encode_array(a, fmt: str, dtype: str = "float16") -> dict:
    """float16 / float32 values or int32 indices as base64 (little-endian) or nested lists (float16: 5 decimals;
    float32: every digit a float32 carries)."""
    arr = np.ascontiguousarray(a.numpy() if hasattr(a, "numpy") else a)
    if fmt == "list":
        if dtype == "float16":
            data = np.round(arr.astype(np.float64), 5).tolist()
        elif dtype == "float32":
            data = arr.astype(np.float32).astype(np.float64).tolist()
        else:
            data = arr.astype(np.int64).tolist()
        return {"shape": list(arr.shape), "dtype": dtype, "encoding": "list", "data": data}
    raw = arr.astype({"float16": "<f2", "float32": "<f4"}.get(dtype, "<i4")).tobytes()
    return {"shape": list(arr.shape), "dtype": dtype, "encoding": "base64", "data": base64.b64encode(raw).decode("ascii")}


def encode_maps(maps: AttentionMaps, opts: ProbeOptions, fmt: str) -> dict:
    out = {"mode": maps.mode, "values": encode_array(maps.values, fmt)}
    if maps.mode == "topk":
        out["indices"] = encode_array(maps.indices, fmt, "int32")
    elif maps.mode == "rows":
        out["rows"] = maps.rows
    elif maps.mode == "pooled":
        out["pool_size"], out["reduce"] = opts.pool_size, opts.pool_reduce
    return out


def token_list(tok: Tokenizer, ids: list[int]) -> list[dict]:
    """Each token: id, its own text, its vocabulary piece, and its [start, end) span in the decoded sequence
    (a token that ends inside a UTF-8 character gets an empty span; the token completing it spans the character)."""
    return drain(token_list_steps(tok, ids))


def token_list_steps(tok: Tokenizer, ids: list[int]) -> Generator[None, None, list[dict]]:
    """`token_list`, yielding every `ROWS_PER_UNIT` tokens."""
    detok = IncrementalDetokenizer(tok)
    out, pos = [], 0
    for i, t in enumerate(ids):
        delta = detok.feed(t)
        out.append({"index": i, "id": t, "text": tok.decode([t]), "piece": tok.id_to_token(t), "offset": [pos, pos + len(delta)]})
        pos += len(delta)
        if i % ROWS_PER_UNIT == ROWS_PER_UNIT - 1:
            yield
    return out


def _finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


def _entry(e: ActivationEntry, tokens: list[dict]) -> dict:
    return {"token": e.token, "token_text": tokens[e.token]["text"], "dim": e.dim, "value": e.value,
            "ratio": _finite(e.ratio), "massive": e.massive}


def summary(result: ProbeResult, tokens: list[dict], n_layers: int) -> dict:
    sinks = result.sink_mass_by_layer
    return {
        "first_massive_layer": result.massive_layers[0] if result.massive_layers else None,
        "last_massive_layer": result.massive_layers[-1] if result.massive_layers else None,
        "massive_layers": result.massive_layers,
        "massive_dims": result.massive_dims,
        "massive_tokens": [{"index": t, "text": tokens[t]["text"]} for t in result.massive_tokens],
        "sink_mass_by_layer": [sinks.get(i) for i in range(n_layers)] if sinks else None,
    }


def render(result: ProbeResult, opts: ProbeOptions, fmt: str, tok: Tokenizer, n_layers: int,
           hidden_dtype: str = "float16") -> dict:
    """The response's tokens, layers, summary and prediction."""
    return drain(render_steps(result, opts, fmt, tok, n_layers, hidden_dtype))


def render_steps(result: ProbeResult, opts: ProbeOptions, fmt: str, tok: Tokenizer, n_layers: int,
                 hidden_dtype: str = "float16") -> Generator[None, None, dict]:
    """`render`, yielding between blocks of tokens and after each layer."""
    tokens = yield from token_list_steps(tok, result.token_ids)
    layers = []
    for p in result.layers:
        layer = {"layer": p.layer, "max_abs": p.max_abs, "median_abs": p.median_abs,
                 "num_massive": p.num_massive, "massive": [_entry(e, tokens) for e in p.massive],
                 "top": [_entry(e, tokens) for e in p.top]}
        if p.residual_norm is not None:
            layer["residual_norm"] = [round(x, 4) for x in p.residual_norm.tolist()]
        if p.heads is not None:
            layer["attention"] = {
                "heads": [{"head": h.head, "kv_group": h.kv_group, "sink_mass": h.sink_mass,
                           "massive_mass": h.massive_mass, "entropy": h.entropy} for h in p.heads],
                "maps": encode_maps(p.maps, opts, fmt) if p.maps is not None else None,
            }
        if p.lens is not None:
            layer["logit_lens"] = [{"position": e.position, "top": [{"id": i, "text": tok.decode([i]), "prob": pr}
                                                                     for i, pr in zip(e.token_ids, e.probs)]}
                                   for e in p.lens]
        if p.hidden is not None:
            layer["hidden_states"] = {"positions": result.hidden_positions, "values": encode_array(p.hidden, fmt, hidden_dtype)}
        layers.append(layer)
        yield
    out = {"tokens": tokens, "layers": layers, "summary": summary(result, tokens, n_layers)}
    if result.prediction is not None:
        pr = result.prediction
        out["prediction"] = {"perplexity": pr.perplexity, "num_predicted": pr.num_predicted,
                             "next_tokens": [{"id": i, "text": tok.decode([i]), "prob": p_}
                                             for i, p_ in zip(pr.next_token_ids, pr.next_token_probs)]}
    return out


def dumps_with_size(body: dict) -> bytes:
    """Compact JSON with `usage.response_bytes` set to the length of the body that carries it; a model that
    overflows (float16 inf, NaN) still gets a valid JSON answer: null there (service/microscope/json_pieces.py)."""
    return drain(dumps_with_size_steps(body))


def token_telemetry(t: TokenTelemetry) -> dict:
    """One streamed token's `inspect` (model/features/telemetry/): per layer, the query's attention mass on the sink
    tokens (mean over heads and per head), each head's top-k attended positions and weights, and the largest entries
    of the token's hidden state with the massive-activation flags."""
    sink = t.sink_mass.tolist()
    pos, weights = t.top_positions.tolist(), t.top_probs.tolist()
    dims, values, flags = t.top_dims.tolist(), t.top_values.tolist(), t.top_massive.tolist()
    max_abs, median, num = t.max_abs.tolist(), t.median_abs.tolist(), t.num_massive.tolist()
    layers = []
    for i, heads in enumerate(sink):
        layers.append({
            "layer": i, "sink_mass": round(sum(heads) / len(heads), 6), "sink_mass_heads": [round(x, 6) for x in heads],
            "top_positions": pos[i], "top_weights": [[round(x, 6) for x in h] for h in weights[i]],
            "max_abs": round(max_abs[i], 3), "median_abs": round(median[i], 6), "num_massive": num[i],
            "top_activations": [{"dim": d, "value": round(v, 3), "massive": f}
                                for d, v, f in zip(dims[i], values[i], flags[i])],
        })
    return {"position": t.position, "sink_tokens": t.sink_tokens, "layers": layers}


def _f32(t) -> list[float]:
    """float32 values as the shortest decimals that read back as the same float32 (a JSON number each)."""
    return [float(str(v)) for v in np.asarray(t, dtype=np.float32).ravel()]


def _hook_name(hook) -> str:
    try:
        return hook.transformer_lens_name()
    except ValueError:
        return ".".join(hook.hf_module())


def feature_grid(g: FeatureGridResult, tok: Tokenizer) -> dict:
    """/inspect's `features` (model/probes/feature_grid.py): each token's top features as [id, activation] pairs,
    and each reported feature's activations as sparse parallel lists (`positions`, `activations`: the nonzero ones),
    its max and mean over the tokens, and the tokens its decoder direction promotes and suppresses."""
    return drain(feature_grid_steps(g, tok))


def feature_grid_steps(g: FeatureGridResult, tok: Tokenizer) -> Generator[None, None, dict]:
    """`feature_grid`, yielding every `ROWS_PER_UNIT` tokens, entries or features."""
    d = g.dictionary
    by_token = []
    top_ids, top_values = g.top_ids.tolist(), g.top_values.numpy()
    for r, (ids, values) in enumerate(zip(top_ids, top_values)):
        vals = _f32(values)
        by_token.append([[i, v] for i, v in zip(ids, vals) if i >= 0])
        if r % ROWS_PER_UNIT == ROWS_PER_UNIT - 1:
            yield
    # entries are sorted by feature: each feature's slice of them
    counts = np.bincount(g.entry_feature.numpy(), minlength=len(g.ids)) if len(g.ids) else np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    positions, entry_values, values = g.entry_position.tolist(), g.entry_value.numpy(), []
    for a in range(0, len(entry_values), ROWS_PER_UNIT * 16):
        values += _f32(entry_values[a : a + ROWS_PER_UNIT * 16])
        yield
    texts: dict[int, str] = {}

    def listed(ids, logits) -> list[dict]:
        return [{"id": i, "text": texts.setdefault(i, tok.decode([i])), "logit": v} for i, v in zip(ids, _f32(logits))]

    features = []
    maxs, means = _f32(g.max.numpy()), _f32(g.mean.numpy())
    for u, fid in enumerate(g.ids.tolist()):
        a, b = int(ends[u] - counts[u]), int(ends[u])
        features.append({"id": fid, "max": maxs[u], "mean": means[u], "positions": positions[a:b],
                         "activations": values[a:b],
                         "promotes": listed(g.promote_ids[u].tolist(), g.promote_logits[u].numpy()),
                         "suppresses": listed(g.suppress_ids[u].tolist(), g.suppress_logits[u].numpy())})
        if u % ROWS_PER_UNIT == ROWS_PER_UNIT - 1:
            yield
    return {"sae": g.name, "hook_name": _hook_name(d.hook_in), "layer": d.hook_in.layer, "site": d.hook_in.site,
            "d_sae": d.d_sae, "top_k": g.top_k, "num_tokens": len(by_token), "by_token": by_token,
            "features": features}
