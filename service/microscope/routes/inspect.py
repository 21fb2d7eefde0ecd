"""POST /inspect: attention maps and sinks, massive activations, residual norms, the logit lens and a dictionary's
feature x token grid of a prompt (optionally after generating a completion).

The probe runs on the engine thread as a job stepped in bounded slices between serving steps (`AsyncEngine.run_job`),
on the same weights and kernels that serve completions, and so does the building and encoding of its response
(`ThenRespond`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Generator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from model.engine import RequestOptions, SamplingParams
from model.features.sae import DictionaryError
from model.interventions import Intervention
from model.probes import FeatureGridTooLarge, FeatureRequest, ProbeRun
from service.microscope import inspect_format as fmt
from service.common.errors import APIError
from service.microscope.edit_fields import to_interventions
from service.microscope.inspect_request import absolute, probe_options, request_tokens
from service.microscope.json_pieces import dumps_with_size_steps
from service.microscope.probing import ThenRespond, check_inspect_length, run_job
from service.api.openai.format import now
from service.common.runner import RunStats, start, until_disconnect
from service.microscope.schemas import InspectRequest
from service.common.serving import Serving, get_serving

router = APIRouter()
log = logging.getLogger("llamascope.service")


async def _generate(serving: Serving, request: Request, ids: list[int], req: InspectRequest,
                    interventions: list[Intervention] | None, adapter: str | None) -> dict:
    """The completion to inspect with the prompt (generated under the same interventions and LoRA adapter): its
    tokens, text and finish reason."""
    params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed)
    stats = RunStats("inspect")
    outputs = await start(serving, [ids], params, stats, RequestOptions(interventions=interventions, lora=adapter))

    async def collect():
        tokens, text, reason, error = [], "", None, None
        try:
            async for _, out in outputs:
                tokens += out.token_ids
                text += out.text
                reason, error = out.finish_reason or reason, out.error or error
        finally:
            await outputs.aclose()
        return {"token_ids": tokens, "text": text, "finish_reason": reason, "error": error}

    result = await until_disconnect(request, collect())
    if result.pop("error"):
        raise APIError(500, "generation failed", code="generation_failed")
    return result


def feature_request(serving: Serving, req: InspectRequest) -> FeatureRequest | None:
    """The dictionary `features.sae` names in the server's store, with the grid's options; 400 naming the field for
    an unknown name or ids out of its range (a site the inspection does not read: `new_probe`'s 400)."""
    f = req.features
    if f is None:
        return None
    try:
        d = serving.saes.get(f.sae) if serving.saes is not None else None
    except DictionaryError as e:
        raise APIError(400, f"features.sae: {str(e).removeprefix('sae: ')}", param="features.sae",
                       code="invalid_value") from None
    if d is None:
        raise APIError(400, "features.sae: this server serves no dictionaries", param="features.sae", code="invalid_value")
    # the grid's nonzero activations, a position and a float32 decimal each (at most about 16 bytes of JSON), within
    # the inspect budget: a grid over it stops as soon as it is known to be (a 413), not after the whole run
    out = FeatureRequest(f.sae, d, f.top_k, f.ids, max_entries=serving.settings.max_inspect_response_bytes // 16)
    try:
        out.validate()
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split(":", 1)[0], code="invalid_value") from None
    return out


def _respond(serving: Serving, req: InspectRequest, probe: ProbeRun, ids: list[int], sequence: list[int],
             completion: dict | None, num_interventions: int, adapter: str | None) -> Generator[None, None, bytes]:
    """The body of a finished probe, built on the engine thread in the probe's slices (`ThenRespond`): yields
    between units of work, returns the JSON."""
    c, opts = serving.config, probe.opts
    result = probe.result()
    body = {"id": f"insp-{uuid.uuid4().hex[:24]}", "object": "inspection", "created": now(),
            "model": adapter or serving.model_name,
            "mode": opts.mode, "format": req.format,
            "config": {"n_layers": c.n_layers, "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads,
                       "head_dim": c.head_dim, "dim": c.dim, "vocab_size": c.vocab_size},
            "layers_selected": opts.selected_layers(c.n_layers), "heads_selected": result.heads,
            "kv_groups": result.kv_groups, "num_prompt_tokens": len(ids), "completion": completion,
            "interventions": num_interventions}
    body.update((yield from fmt.render_steps(result, opts, req.format, serving.tokenizer, c.n_layers,
                                             req.hidden_dtype)))
    if result.features is not None:
        body["features"] = yield from fmt.feature_grid_steps(result.features, serving.tokenizer)
    body["usage"] = {"prompt_tokens": len(ids), "completion_tokens": len(sequence) - len(ids),
                     "total_tokens": len(sequence), "compute_ms": round(result.compute_ms, 1), "response_bytes": 0}
    return (yield from dumps_with_size_steps(body))


@router.post("/inspect")
async def inspect(req: InspectRequest, request: Request, serving: Serving = Depends(get_serving)):
    adapter = serving.check_model(req.model, adapters=True)  # the whole inspection under a LoRA adapter, or the base
    c = serving.config
    started = time.perf_counter()
    ids = request_tokens(serving, req)
    max_len = serving.max_model_len
    if len(ids) + req.max_tokens > max_len:
        raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the context of {max_len}",
                       param="max_tokens", code="context_length_exceeded")
    check_inspect_length(serving, len(ids) + req.max_tokens, "max_tokens" if req.max_tokens else "prompt")
    opts = probe_options(serving, req, len(ids) + req.max_tokens)
    features = feature_request(serving, req)
    interventions = to_interventions(req.interventions, serving.vectors, c.n_layers, c.dim, serving.saes, c)
    completion = None
    if req.max_tokens:
        completion = await _generate(serving, request, ids, req, interventions, adapter)
        T = len(ids) + len(completion["token_ids"])
        opts.rows = absolute(req.rows, T, "rows")
        opts.hidden_positions = absolute(req.hidden_positions, T, "hidden_positions")
    sequence = ids + (completion["token_ids"] if completion else [])
    probe = serving.new_probe(sequence, opts, interventions, len(ids), adapter, features)
    job = ThenRespond(probe, lambda: _respond(serving, req, probe, ids, sequence, completion, len(interventions or []),
                                              adapter))
    try:
        await run_job(serving, request, job, len(sequence))
    except FeatureGridTooLarge as e:
        raise APIError(413, str(e), param="features.top_k", code="inspect_too_large") from None
    result = probe.result()
    log.info("inspect tokens=%d mode=%s layers=%d compute_ms=%.0f latency_ms=%.0f bytes=%d", len(sequence), opts.mode,
             len(result.layers), result.compute_ms, (time.perf_counter() - started) * 1e3, len(job.data))
    return Response(job.data, media_type="application/json")
