"""POST /inspect/compare across models: one sequence inspected by each model's own process (an ordinary /inspect
with its block outputs in float32), and the differences taken here, as model/probes/compare.py takes them between a
base and its LoRA adapters: per selected block and position, the norm of the block output's difference (other minus
reference), that norm over the reference's, the cosine, and the attention maps' difference in /inspect's layout.
They are the differences of the two /inspect answers by construction; the models must share a tokenizer (the same
token ids for the input) and a shape (layers, width, heads).

The logit lens is the one difference that cannot be taken here: KL(reference || other) needs both models' whole
next-token distributions at every block and position, and /inspect returns each lens's top tokens only (at most
100). Across models `logit_lens.kl` is null and `logit_lens.same_top1` says, per position, whether both models' lens
reads the same most likely token there.
"""

from __future__ import annotations

import base64
import logging
import time
import uuid

import numpy as np
import torch
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from model.probes import DEFAULT_INCLUDES
from service.microscope import inspect_format as fmt
from service.common.errors import APIError
from service.api.openai.format import now
from service.router.pool import ModelPool
from service.microscope.schemas import CompareRequest

log = logging.getLogger("llamascope.router")
_DTYPES = {"float16": "<f2", "float32": "<f4", "int32": "<i4"}


def decode_array(encoded: dict) -> np.ndarray:
    """An array as /inspect encodes it (service/inspect_format.py `encode_array`), back to numpy."""
    if encoded["encoding"] == "base64":
        raw = base64.b64decode(encoded["data"])
        return np.frombuffer(raw, dtype=_DTYPES[encoded["dtype"]]).reshape(encoded["shape"])
    return np.asarray(encoded["data"], dtype=np.float64).reshape(encoded["shape"])


def inspect_body(req: CompareRequest, model: str) -> dict:
    """The /inspect request each side answers: the compare request's options, its block outputs in float32, and its
    lens's top token at the lens positions (`lens_positions`, the last token by default)."""
    body = req.model_dump(exclude={"compare"}, exclude_none=True)
    include = set(req.include) if req.include is not None else set(DEFAULT_INCLUDES)
    body.update(model=model, include=sorted(include | {"hidden_states"}), hidden_dtype="float32")
    if "logit_lens" in include:
        body["lens_top_k"] = 1
    return body


async def _inspect(pool: ModelPool, name: str, body: dict) -> dict | Response:
    """One side's /inspect through its own process (loaded first if need be); its refusal, if any, as it is."""
    child = await pool.acquire(name)
    try:
        r = await pool.client.post(child.url + "/inspect", json=body, headers=pool.headers)
    finally:
        child.release()
    if r.status_code != 200:
        return Response(r.content, status_code=r.status_code, media_type="application/json")
    return r.json()


def _same_shape(ref: dict, other: dict, name: str, ref_name: str) -> None:
    ids_a, ids_b = [t["id"] for t in ref["tokens"]], [t["id"] for t in other["tokens"]]
    if ids_a != ids_b:
        raise APIError(400, f"{ref_name} and {name} read this input as different tokens ({len(ids_a)} and "
                            f"{len(ids_b)}): compare models that share a tokenizer", param="compare",
                       code="tokenizers_differ")
    for key in ("n_layers", "dim", "n_heads"):
        if ref["config"][key] != other["config"][key]:
            raise APIError(400, f"{ref_name} and {name} differ in {key} ({ref['config'][key]} and "
                                f"{other['config'][key]}): compare models of one shape", param="compare",
                           code="shapes_differ")


def layer_differences(a: dict, b: dict, fmt_name: str) -> dict:
    """One block: the reference's /inspect layer `a` against the other's `b` (model/probes/compare.py's quantities)."""
    ha = torch.from_numpy(decode_array(a["hidden_states"]["values"]).astype(np.float32))  # (P, D)
    hb = torch.from_numpy(decode_array(b["hidden_states"]["values"]).astype(np.float32))  # (P, D)
    delta = (hb - ha).norm(dim=-1)
    out = {"layer": a["layer"],
           "residual": {"delta_norm": delta.tolist(), "relative": (delta / ha.norm(dim=-1).clamp_min(1e-30)).tolist(),
                        "cosine": torch.nn.functional.cosine_similarity(ha, hb, dim=-1).tolist()},
           "logit_lens": None, "attention": None}
    if "logit_lens" in a and "logit_lens" in b:
        tops = [(x["top"][0]["id"], y["top"][0]["id"]) for x, y in zip(a["logit_lens"], b["logit_lens"])]
        out["logit_lens"] = {"kl": None, "positions": [x["position"] for x in a["logit_lens"]],
                             "same_top1": [i == j for i, j in tops]}
    maps_a, maps_b = (a.get("attention") or {}).get("maps"), (b.get("attention") or {}).get("maps")
    if maps_a is not None and maps_b is not None:
        diff = decode_array(maps_b["values"]).astype(np.float32) - decode_array(maps_a["values"]).astype(np.float32)
        out["attention"] = {**{k: v for k, v in maps_a.items() if k != "values"},
                            "values": fmt.encode_array(diff, fmt_name)}
    return out


async def compare_models(pool: ModelPool, req: CompareRequest) -> Response:
    ref_name = req.model or pool.default
    if req.max_tokens or req.interventions:
        raise APIError(400, "compare inspects the given sequence as it is: no max_tokens, no interventions",
                       param="max_tokens" if req.max_tokens else "interventions", code="invalid_value")
    if req.mode == "topk":
        raise APIError(400, "top-k maps hold each side's own keys: compare maps in full, rows or pooled mode (or none)",
                       param="mode", code="invalid_value")
    started = time.perf_counter()
    answers = []
    for name in [ref_name, *req.compare]:  # one at a time: with --models-max 1 each side evicts the other
        answer = await _inspect(pool, name, inspect_body(req, name))
        if isinstance(answer, Response):
            return answer
        answers.append(answer)
    ref = answers[0]
    for name, other in zip(req.compare, answers[1:]):
        _same_shape(ref, other, name, ref_name)
    modes = {((layer.get("attention") or {}).get("maps") or {}).get("mode") for a in answers for layer in a["layers"]}
    if len(modes) > 1:
        raise APIError(400, "the models' inspections chose different map modes: name the mode", param="mode",
                       code="invalid_value")
    comparisons = [{"model": name, "layers": [layer_differences(a, b, req.format)
                                              for a, b in zip(ref["layers"], other["layers"])]}
                   for name, other in zip(req.compare, answers[1:])]
    T = len(ref["tokens"])
    positions = ref["layers"][0]["hidden_states"]["positions"] if ref["layers"] else []
    body = {"id": f"cmp-{uuid.uuid4().hex[:24]}", "object": "inspection.compare", "created": now(),
            "model": ref_name, "format": req.format, "tokens": ref["tokens"], "positions": positions,
            "layers_selected": ref["layers_selected"], "heads_selected": ref["heads_selected"],
            "comparisons": comparisons,
            "usage": {"prompt_tokens": T, "total_tokens": T * len(answers),
                      "compute_ms": round(sum(a["usage"]["compute_ms"] for a in answers), 1), "response_bytes": 0}}
    data = await run_in_threadpool(fmt.dumps_with_size, body)
    log.info("inspect/compare across models tokens=%d sides=%d latency_ms=%.0f bytes=%d", T, len(answers),
             (time.perf_counter() - started) * 1e3, len(data))
    return Response(data, media_type="application/json")
