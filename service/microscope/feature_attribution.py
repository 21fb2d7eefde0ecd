"""/inspect/attribute over a dictionary's features (`features`): the dictionary it names, the feature attribution
job's response, and `verify` by exact feature patching as rows of the engine's batches (model/probes/
feature_attribution.py says what is computed; service/microscope/routes/attribute.py dispatches here)."""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from model.features.sae import Dictionary, DictionaryError
from model.probes import (FeatureAttributionRun, FeatureDirectLogitRun, FeatureNode, PatchSweep, check_attributable,
                          feature_sweep, hook_name)
from service.common.errors import APIError
from service.common.runner import until_disconnect
from service.common.serving import Serving
from service.microscope import inspect_format as fmt
from service.microscope.patching import one_token, pearson, run_cells, sweep_positions, token_field
from service.microscope.probing import run_job
from service.microscope.schemas import AttributeRequest


def resolve_dictionary(serving: Serving, req: AttributeRequest) -> Dictionary:
    """The dictionary `features.sae` names, if attribution can split its site (400 naming the field)."""
    try:
        if serving.saes is None:
            raise DictionaryError("sae", "this server serves no dictionaries")
        d = serving.saes.get(req.features.sae)
        check_attributable(d)
    except ValueError as e:
        raise APIError(400, f"features.{e}", param="features.sae", code="invalid_value") from None
    return d


def feature_direct_logit_body(req: AttributeRequest, job: FeatureDirectLogitRun) -> dict:
    """`features` of a direct_logit response: the split of the site's contribution at the last position."""
    f, d = job.features, job.dictionary
    return {
        "sae": req.features.sae, "hook": hook_name(d), "layer": d.hook_in.layer, "site": d.hook_in.site,
        "position": f.position, "site_contribution": f.site_contribution, "active": len(f.features),
        "top": [{"feature": i, "activation": a, "contribution": c} for i, a, c in f.features[: req.features.top]],
        "features_sum": f.features_sum, "bias": f.bias, "error": f.error, "sum": f.total,
    }


def _feature_sweep(serving: Serving, req: AttributeRequest, d: Dictionary, clean: list[int],
                   corrupted: list[int]) -> PatchSweep:
    """The one-site sweep feature attribution runs (its gradient's), with its budgets checked (400 / 413 naming the
    field) before anything runs."""
    T = len(clean)
    if len(corrupted) != T:
        raise APIError(400, f"corrupted: {len(corrupted)} tokens, the clean prompt has {T}; attribution patching "
                            "compares the two position by position, so they must have equal token counts",
                       param="corrupted", code="invalid_value")
    answer = one_token(serving, req.answer, "answer")
    contrast = one_token(serving, req.contrast, "contrast") if req.contrast is not None else None
    positions = sweep_positions(req.positions, T)
    try:
        sweep = feature_sweep(serving.config, d, T, answer, contrast, req.metric, positions)
    except ValueError as e:  # messages start with the field's name
        raise APIError(400, str(e), param=str(e).split(":", 1)[0], code="invalid_value") from None
    budget, limit = serving.settings.max_inspect_response_bytes, serving.settings.max_patch_cells
    held = FeatureAttributionRun.held_bytes(sweep, serving.config, d.d_sae)
    if held > budget:
        raise APIError(413, f"the attribution would hold about {held / 1e6:.0f} MB ({len(positions)} positions x "
                            f"{d.d_sae} features), over the {budget / 1e6:.0f} MB inspect budget "
                            "(max_inspect_response_bytes); ask for fewer positions or shorter prompts",
                       param="positions", code="attribute_too_large")
    if req.verify > limit:
        raise APIError(413, f"verify: {req.verify} exact patches, over this server's limit of {limit} (max_patch_cells)",
                       param="verify", code="attribute_too_large")
    return sweep


async def feature_patching(serving: Serving, req: AttributeRequest, request: Request, started: float,
                           adapter: str | None, clean: list[int], corrupted: list[int]) -> dict:
    """Attribution patching over the features of `features.sae` (Marks et al. 2024), `verify` by exact feature
    patching."""
    d = resolve_dictionary(serving, req)
    sweep = _feature_sweep(serving, req, d, clean, corrupted)
    job = serving.new_feature_attribution(d, clean, corrupted, sweep.answer, sweep.contrast, sweep.metric,
                                          sweep.positions, adapter)
    await run_job(serving, request, job, 2 * len(clean))
    attributed = time.perf_counter()
    m_clean, m_corrupted = job.baselines
    tok = serving.tokenizer
    body = {
        "metric": sweep.metric, "direction": "noise", "answer": token_field(tok, sweep.answer),
        "contrast": token_field(tok, sweep.contrast), "positions": job.positions,
        "clean_tokens": fmt.token_list(tok, clean), "corrupted_tokens": fmt.token_list(tok, corrupted),
        "baselines": {"clean": m_clean, "corrupted": m_corrupted},
        "features": {
            "sae": req.features.sae, "hook": hook_name(d), "layer": d.hook_in.layer, "site": d.hook_in.site,
            "nodes": len(job.nodes),
            "top": [{"feature": n.feature, "position": n.position, "clean": n.clean, "corrupted": n.corrupted,
                     "estimate": n.estimate} for n in job.nodes[: req.features.top]],
            "site": job.site, "error": job.error, "rest": job.rest,
        },
    }
    chosen = job.nodes[: req.verify]
    if chosen:
        body["features"]["verified"] = await _verify(serving, request, job, sweep, clean, chosen, adapter)
    body["usage"] = {"nodes": len(job.nodes), "prompt_tokens": len(clean), "verified_rows": len(chosen),
                     "attribution_seconds": round(attributed - started, 3),
                     "seconds": round(time.perf_counter() - started, 3)}
    body["gradient_precision"] = job.gradient_precision
    return body


async def _verify(serving: Serving, request: Request, job: FeatureAttributionRun, sweep: PatchSweep,
                  clean: list[int], chosen: list[FeatureNode], adapter: str | None) -> dict:
    """Each chosen node patched exactly: the clean prompt with that feature moved to its corrupted value at its
    position (an `add` intervention), as background rows of the engine's batches -> the metric's change."""
    m_clean = job.baselines[0]
    rid = f"attribute-{uuid.uuid4().hex[:16]}"
    exact = await until_disconnect(request, run_cells(serving, rid, sweep, clean, [job.interventions(n) for n in chosen],
                                                      adapter))
    moved = [x - m_clean for x in exact]
    return {"nodes": [{"feature": n.feature, "position": n.position, "estimate": n.estimate, "exact": x}
                      for n, x in zip(chosen, moved)],
            "correlation": pearson([n.estimate for n in chosen], moved)}
