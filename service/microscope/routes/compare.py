"""POST /inspect/compare: one sequence under two weight sets or more (the base, LoRA adapters): per selected block,
how far each moved the residual stream, its heads' attention maps and the logit lens (model/probes/compare.py)."""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from model.probes import CompareRun
from service.api.openai.format import now
from service.common.errors import APIError
from service.common.serving import Serving, get_serving
from service.microscope import inspect_format as fmt
from service.microscope.inspect_request import probe_options, request_tokens
from service.microscope.probing import check_inspect_length, run_job, run_probe
from service.microscope.schemas import CompareRequest

router = APIRouter()
log = logging.getLogger("llamascope.service")


@router.post("/inspect/compare")
async def compare(req: CompareRequest, request: Request, serving: Serving = Depends(get_serving)):
    """One sequence under `model` (the reference) and under each of `compare`: per selected block, how far each moved
    the residual stream, its heads' attention maps and the logit lens (model/probes/compare.py)."""
    ref = serving.check_model(req.model, adapters=True)
    others = [serving.check_model(name, adapters=True) for name in req.compare]
    if req.max_tokens or req.interventions or req.features:
        raise APIError(400, "compare inspects the given sequence as it is: no max_tokens, no interventions, no features",
                       param="max_tokens" if req.max_tokens else "interventions" if req.interventions else "features",
                       code="invalid_value")
    started = time.perf_counter()
    ids = request_tokens(serving, req)
    check_inspect_length(serving, len(ids), "prompt")
    opts = probe_options(serving, req, len(ids))
    if opts.mode == "topk":  # (asked, or what "auto" fits in the byte budget)
        raise APIError(400, "top-k maps hold each side's own keys: compare maps in full, rows or pooled mode (or none)",
                       param="mode", code="invalid_value")
    opts.include = opts.include | {"hidden_states"}  # the block outputs both sides are compared on
    model = serving.local_model("/inspect/compare")
    runs = [(await run_probe(serving, request, ids, opts, None, len(ids), name)).result() for name in [ref, *others]]
    job = await run_job(serving, request, CompareRun(model, runs[0], runs[1:]), len(ids))
    comparisons = []
    for name, layers in zip(req.compare, job.comparisons):
        comparisons.append({"model": name, "layers": [{
            "layer": c.layer,
            "residual": {"delta_norm": c.delta_norm.tolist(), "relative": c.relative.tolist(), "cosine": c.cosine.tolist()},
            "logit_lens": {"kl": c.lens_kl.tolist()},
            "attention": fmt.encode_maps(c.maps, opts, req.format) if c.maps is not None else None,
        } for c in layers]})
    body = {"id": f"cmp-{uuid.uuid4().hex[:24]}", "object": "inspection.compare", "created": now(),
            "model": req.model or serving.model_name, "format": req.format,
            "tokens": fmt.token_list(serving.tokenizer, ids), "positions": runs[0].hidden_positions,
            "layers_selected": opts.selected_layers(serving.config.n_layers), "heads_selected": runs[0].heads,
            "comparisons": comparisons,
            "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids) * len(runs),
                      "compute_ms": round(sum(r.compute_ms for r in runs), 1), "response_bytes": 0}}
    data = await run_in_threadpool(fmt.dumps_with_size, body)
    log.info("inspect/compare tokens=%d sides=%d latency_ms=%.0f bytes=%d", len(ids), len(runs),
             (time.perf_counter() - started) * 1e3, len(data))
    return Response(data, media_type="application/json")
