"""POST /inspect/patch: an activation-patching sweep (causal tracing) of the served model, run as rows of the
engine's own batches beside other traffic (model/probes/patching.py says what is computed, service/microscope/patching.py how
it runs). Budgets (cells, bytes) are checked before anything runs.
"""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import APIRouter, Depends, Request

from model.probes import grid, normalise
from service.microscope import inspect_format as fmt
from service.common.errors import APIError
from service.api.openai.format import now
from service.microscope.patching import build_sweep, check_patch_budget, prompt_tokens, sweep_fields, sweep_grid
from service.microscope.probing import check_inspect_length
from service.common.runner import until_disconnect
from service.microscope.schemas import PatchRequest
from service.common.serving import Serving, get_serving

router = APIRouter()
log = logging.getLogger("llamascope.service")


@router.post("/inspect/patch")
async def patch(req: PatchRequest, request: Request, serving: Serving = Depends(get_serving)):
    adapter = serving.check_model(req.model, adapters=True)  # every row under a LoRA adapter, or the base
    started = time.perf_counter()
    clean = prompt_tokens(serving, req.clean, req.add_generation_prompt, "clean")
    corrupted = prompt_tokens(serving, req.corrupted, req.add_generation_prompt, "corrupted")
    check_inspect_length(serving, len(clean), "clean")
    sweep = build_sweep(serving, req, clean, corrupted)
    check_patch_budget(serving, sweep)
    source, target = (clean, corrupted) if sweep.direction == "denoise" else (corrupted, clean)
    result = await until_disconnect(request, sweep_grid(serving, sweep, source, target, adapter))
    m_clean, m_corrupted = (result["source"], result["target"]) if sweep.direction == "denoise" \
        else (result["target"], result["source"])
    try:
        normalised = normalise(result["values"], m_clean, m_corrupted)
    except ValueError as e:
        raise APIError(400, str(e), param="corrupted", code="invalid_value") from None
    elapsed = time.perf_counter() - started
    tok = serving.tokenizer
    body = {
        "id": f"patch-{uuid.uuid4().hex[:24]}", "object": "inspection.patch", "created": now(),
        "model": adapter or serving.model_name,
        "precision": serving.precision, "metric": sweep.metric, "direction": sweep.direction,
        "answer": {"text": tok.decode([sweep.answer]), "token_id": sweep.answer},
        "contrast": {"text": tok.decode([sweep.contrast]), "token_id": sweep.contrast} if sweep.contrast is not None else None,
        **sweep_fields(serving, sweep),
        "clean_tokens": fmt.token_list(tok, clean), "corrupted_tokens": fmt.token_list(tok, corrupted),
        "baselines": {"clean": m_clean, "corrupted": m_corrupted},
        "normalized": grid(sweep, normalised), "raw": grid(sweep, result["values"]),
        "usage": {"cells": sweep.num_cells, "rows": sweep.num_cells + 2, "prompt_tokens": len(clean),
                  "seconds": round(elapsed, 3)},
    }
    log.info("patch tokens=%d cells=%d seconds=%.2f", len(clean), sweep.num_cells, elapsed)
    return body
