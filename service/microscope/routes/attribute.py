"""POST /inspect/attribute: direct logit attribution of one prompt, or attribution patching of a prompt pair, on the
served model (model/probes/direct_logit.py, attribution_patching.py say what is computed); with `features`, both
over a served dictionary's features at its own site (model/probes/feature_attribution.py).

Both run as a job on the engine thread, a block of a forward or a backward at a time between serving steps, under
/inspect's queue limit and share of the engine thread; `verify` then patches the cells with the largest estimates
exactly (or, with `features`, the feature nodes: each feature's activation patched from the corrupted run into the
clean one), as rows of the engine's batches (service/microscope/patching.py). Cost is bounded before anything runs: the sequence
by --max-inspect-tokens and what a run holds by --max-inspect-response-bytes (413), the verified cells by
--max-patch-cells (413).
"""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import APIRouter, Depends, Request

from model.probes import AttributionPatchingRun, PatchSweep, cell_interventions, grid, normalise
from service.microscope import inspect_format as fmt
from service.common.errors import APIError
from service.api.openai.format import now
from service.microscope.feature_attribution import feature_direct_logit_body, feature_patching, resolve_dictionary
from service.microscope.patching import (RESPONSE_BYTES_PER_CELL, build_sweep, one_token, pearson, prompt_tokens,
                                        run_cells, sweep_fields, token_field)
from service.microscope.probing import check_inspect_length, run_job
from service.common.runner import until_disconnect
from service.microscope.schemas import AttributeRequest
from service.common.serving import Serving, get_serving

router = APIRouter()
log = logging.getLogger("llamascope.service")

# the fields only one method takes
ONLY = {"direct_logit": ("prompt", "messages"),
        "attribution_patching": ("clean", "corrupted", "metric", "direction", "sites", "layers", "positions", "heads",
                                 "verify", "qk_fix", "hook")}
# what `features` fixes itself: the site and layer are the dictionary's, the direction Marks et al.'s (corrupted
# into clean), and no head site is swept
NOT_WITH_FEATURES = ("sites", "layers", "heads", "hook", "direction", "qk_fix")


def _check_fields(req: AttributeRequest) -> None:
    """400 naming a field the method does not take, or one it needs."""
    other = "attribution_patching" if req.method == "direct_logit" else "direct_logit"
    for name in ONLY[other]:
        if name in req.model_fields_set:
            raise APIError(400, f"{name}: not a field of method {req.method!r}", param=name, code="invalid_value")
    if req.method == "direct_logit":
        given = [n for n in ("prompt", "messages") if getattr(req, n) is not None]
        if len(given) != 1:
            raise APIError(400, "direct_logit: give exactly one of prompt or messages", param="prompt",
                           code="invalid_value")
        if req.contrast is None:
            raise APIError(400, "contrast: direct_logit attributes logit(answer) - logit(contrast); give a contrast",
                           param="contrast", code="invalid_value")
    else:
        for name in ("clean", "corrupted"):
            if getattr(req, name) is None:
                raise APIError(400, f"{name}: attribution_patching needs a clean and a corrupted prompt", param=name,
                               code="invalid_value")
    if req.features is not None:
        for name in NOT_WITH_FEATURES:
            if name in req.model_fields_set:
                raise APIError(400, f"{name}: not a field of attribution over features (the dictionary's hook fixes the "
                                    "site and layer; a feature is patched from the corrupted run into the clean one)",
                               param=name, code="invalid_value")


async def _direct_logit(serving: Serving, req: AttributeRequest, request: Request, started: float,
                        adapter: str | None) -> dict:
    ids = prompt_tokens(serving, req.prompt if req.prompt is not None else req.messages, req.add_generation_prompt,
                        "prompt" if req.prompt is not None else "messages")
    check_inspect_length(serving, len(ids), "prompt" if req.prompt is not None else "messages")
    answer, contrast = one_token(serving, req.answer, "answer"), one_token(serving, req.contrast, "contrast")
    if req.features is not None:
        job = serving.new_feature_direct_logit(ids, answer, contrast, resolve_dictionary(serving, req), adapter)
    else:
        job = serving.new_direct_logit(ids, answer, contrast, adapter)
    await run_job(serving, request, job, len(ids))
    r = job.result
    contributions = {"embed": r.embedding}
    for layer, heads in enumerate(r.heads):
        contributions.update({f"L{layer}H{h}": v for h, v in enumerate(heads)})
        contributions[f"L{layer}"] = r.mlp[layer]
    contributions["remainder"] = sum(r.remainder)
    tok = serving.tokenizer
    return {
        "answer": token_field(tok, answer), "contrast": token_field(tok, contrast), "position": r.position,
        "tokens": fmt.token_list(tok, ids), "logit_diff": r.logit_diff, "sum": r.total,
        "final_norm_scale": r.final_norm_scale, "contributions": contributions,
        "embedding": r.embedding, "heads": r.heads, "mlp": r.mlp, "attention": r.attention, "remainder": r.remainder,
        **({"features": feature_direct_logit_body(req, job)} if req.features is not None else {}),
        "usage": {"prompt_tokens": len(ids), "seconds": round(time.perf_counter() - started, 3)},
    }


def _check_budget(serving: Serving, req: AttributeRequest, sweep: PatchSweep) -> None:
    budget = serving.settings.max_inspect_response_bytes
    held = AttributionPatchingRun.held_bytes(sweep, serving.config, req.qk_fix)
    size = max(held, sweep.num_cells * RESPONSE_BYTES_PER_CELL)
    if size > budget:
        raise APIError(413, f"the attribution would hold about {size / 1e6:.0f} MB ({sweep.num_cells} cells over "
                            f"{sweep.num_tokens} tokens), over the {budget / 1e6:.0f} MB inspect budget "
                            "(max_inspect_response_bytes); ask for fewer sites, layers or positions, shorter prompts, "
                            "or qk_fix false", param="positions", code="attribute_too_large")
    limit = serving.settings.max_patch_cells
    if req.verify > limit:
        raise APIError(413, f"verify: {req.verify} exact cells, over this server's limit of {limit} (max_patch_cells)",
                       param="verify", code="attribute_too_large")
    if req.verify > sweep.num_cells:
        raise APIError(400, f"verify: {req.verify} cells asked, the sweep has {sweep.num_cells}", param="verify",
                       code="invalid_value")


async def _attribution_patching(serving: Serving, req: AttributeRequest, request: Request, started: float,
                                adapter: str | None) -> dict:
    clean = prompt_tokens(serving, req.clean, req.add_generation_prompt, "clean")
    corrupted = prompt_tokens(serving, req.corrupted, req.add_generation_prompt, "corrupted")
    check_inspect_length(serving, len(clean), "clean")
    if req.features is not None:
        return await feature_patching(serving, req, request, started, adapter, clean, corrupted)
    sweep = build_sweep(serving, req, clean, corrupted)
    _check_budget(serving, req, sweep)
    source, target = (clean, corrupted) if sweep.direction == "denoise" else (corrupted, clean)
    job = serving.new_attribution_patching(sweep, source, target, req.qk_fix, adapter)
    await run_job(serving, request, job, 2 * len(clean))
    attributed = time.perf_counter()
    m_source, m_target = job.baselines
    m_clean, m_corrupted = (m_source, m_target) if sweep.direction == "denoise" else (m_target, m_source)
    raw = job.values()
    try:
        normalised = normalise(raw, m_clean, m_corrupted)
    except ValueError as e:
        raise APIError(400, str(e), param="corrupted", code="invalid_value") from None
    tok = serving.tokenizer
    body = {
        "metric": sweep.metric, "direction": sweep.direction, "qk_fix": req.qk_fix,
        "answer": token_field(tok, sweep.answer), "contrast": token_field(tok, sweep.contrast), **sweep_fields(serving, sweep),
        "clean_tokens": fmt.token_list(tok, clean), "corrupted_tokens": fmt.token_list(tok, corrupted),
        "baselines": {"clean": m_clean, "corrupted": m_corrupted},
        "normalized": grid(sweep, normalised), "raw": grid(sweep, raw),
    }
    if req.verify:
        cells = sweep.cells()
        order = sorted(range(len(cells)), key=lambda i: -abs(raw[i] - m_target))[: req.verify]
        chosen = [cells[i] for i in order]
        each = cell_interventions(sweep, None, sorted(sweep.positions), job.source.capture.values, chosen)
        rid = f"attribute-{uuid.uuid4().hex[:16]}"
        exact = await until_disconnect(request, run_cells(serving, rid, sweep, target, each, adapter))
        exact_n = normalise(exact, m_clean, m_corrupted)
        body["verified"] = {
            "cells": [{"site": c.site, "layer": c.layer, "head": c.head, "position": c.position,
                       "estimated": normalised[i], "exact": e, "estimated_raw": raw[i], "exact_raw": x}
                      for c, i, e, x in zip(chosen, order, exact_n, exact)],
            "correlation": pearson([normalised[i] for i in order], exact_n),
        }
    body["usage"] = {"cells": sweep.num_cells, "prompt_tokens": len(clean), "verified_rows": req.verify,
                     "attribution_seconds": round(attributed - started, 3),
                     "seconds": round(time.perf_counter() - started, 3)}
    body["gradient_precision"] = job.gradient_precision
    return body


@router.post("/inspect/attribute")
async def attribute(req: AttributeRequest, request: Request, serving: Serving = Depends(get_serving)):
    adapter = serving.check_model(req.model, adapters=True)  # the runs under a LoRA adapter, or the base
    started = time.perf_counter()
    _check_fields(req)
    if req.method == "direct_logit":
        result = await _direct_logit(serving, req, request, started, adapter)
    else:
        result = await _attribution_patching(serving, req, request, started, adapter)
    log.info("attribute method=%s seconds=%.2f", req.method, time.perf_counter() - started)
    return {"id": f"attribute-{uuid.uuid4().hex[:24]}", "object": "inspection.attribution", "created": now(),
            "model": adapter or serving.model_name, "method": req.method, "precision": serving.precision, **result}
