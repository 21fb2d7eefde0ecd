"""POST /inspect: attention maps and sinks, massive activations, residual norms and the logit lens of a prompt
(optionally after generating a completion); POST /inspect/compare: one sequence under two weight sets.

The probe runs on the engine thread as a job stepped one block at a time between serving steps
(`AsyncEngine.run_job`), on the same weights and kernels that serve completions.
"""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from model.engine import RequestOptions, SamplingParams
from model.interventions import Intervention
from model.probes import DEFAULT_INCLUDES, CompareRun, ProbeOptions
from service.microscope import inspect_format as fmt
from service.common.errors import APIError
from service.microscope.edit_fields import to_interventions
from service.api.openai.prepare import check_token_ids, render_chat
from service.microscope.probing import check_inspect_length, run_job, run_probe
from service.api.openai.format import now
from service.common.runner import RunStats, start, until_disconnect
from service.microscope.schemas import CompareRequest, InspectRequest
from service.common.serving import Serving, get_serving

router = APIRouter()
log = logging.getLogger("llamascope.service")


def _sequence(serving: Serving, req: InspectRequest) -> list[int]:
    given = [name for name in ("prompt", "input_ids", "messages") if getattr(req, name) is not None]
    if len(given) != 1:
        raise APIError(400, "give exactly one of prompt, input_ids or messages" + (f" (got {', '.join(given)})" if given else ""),
                       param="prompt", code="invalid_value")
    if req.messages is not None:
        return render_chat(serving, req.messages, req.add_generation_prompt)
    ids = serving.tokenizer.encode(req.prompt) if req.prompt is not None else list(req.input_ids)
    if not ids:
        raise APIError(400, "prompt must not be empty", param=given[0], code="empty_prompt")
    check_token_ids(ids, serving, "input_ids")
    return ids


def _options(serving: Serving, req: InspectRequest, T: int) -> ProbeOptions:
    """Options for a sequence of (at most) T tokens; 400 for out-of-range selectors, 413 over the byte budget."""
    c = serving.config
    opts = ProbeOptions(
        layers=req.layers, heads=req.heads,
        include=frozenset(req.include) if req.include is not None else DEFAULT_INCLUDES,
        massive_threshold=req.massive_threshold, massive_ratio=req.massive_ratio, massive_top_k=req.massive_top_k,
        massive_max_entries=req.massive_max_entries, mode=req.mode, rows=_absolute(req.rows, T, "rows"),
        attention_top_k=req.attention_top_k, pool_size=req.pool_size, pool_reduce=req.pool_reduce,
        lens_top_k=req.lens_top_k, lens_positions=req.lens_positions,
        hidden_positions=_absolute(req.hidden_positions, T, "hidden_positions"),
    )
    budget = serving.settings.max_inspect_response_bytes
    opts = fmt.resolve_auto(opts, req.format, T, c.n_layers, c.n_heads, budget, c.dim, req.hidden_dtype)
    try:
        opts.validate(c.n_layers, c.n_heads, T)
    except ValueError as e:  # messages start with the field's name
        param = str(e).split(":")[0].split(" ")[0]
        raise APIError(400, str(e), param=param if param in InspectRequest.model_fields else None, code="invalid_value") from None
    size = fmt.estimate_bytes(opts, req.format, T, c.n_layers, c.n_heads, c.dim, req.hidden_dtype)
    if size > budget and "hidden_states" in opts.include \
            and fmt.estimate_bytes(opts, req.format, T, c.n_layers, c.n_heads) <= budget:
        raise APIError(413, f"the response would be about {size / 1e6:.0f} MB, over the {budget / 1e6:.0f} MB inspect "
                            f"budget: hidden states of {len(opts.selected_layers(c.n_layers))} layers x "
                            f"{len(opts.hidden_positions or range(T))} positions x {c.dim} values; ask for fewer "
                            "layers or hidden_positions, or hidden_dtype float16",
                       param="hidden_positions", code="inspect_too_large")
    if size > budget:
        raise APIError(413, f"the response would be about {size / 1e6:.0f} MB ({opts.mode} attention maps of "
                            f"{len(opts.selected_layers(c.n_layers))} layers x {len(opts.selected_heads(c.n_heads))} heads "
                            f"over {T} tokens), over the {budget / 1e6:.0f} MB inspect budget"
                            + fmt.cheaper_modes(opts, req.format, T, c.n_layers, c.n_heads, budget),
                       param="mode", code="inspect_too_large")
    return opts


def _absolute(positions: list[int] | None, T: int, param: str) -> list[int] | None:
    if positions is None:
        return None
    out = [p + T if p < 0 else p for p in positions]
    if any(not 0 <= p < T for p in out):
        raise APIError(400, f"{param} must be in [-{T}, {T}) for this {T}-token sequence", param=param, code="invalid_value")
    return out


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


@router.post("/inspect")
async def inspect(req: InspectRequest, request: Request, serving: Serving = Depends(get_serving)):
    adapter = serving.check_model(req.model, adapters=True)  # the whole inspection under a LoRA adapter, or the base
    c = serving.config
    started = time.perf_counter()
    ids = _sequence(serving, req)
    max_len = serving.max_model_len
    if len(ids) + req.max_tokens > max_len:
        raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the context of {max_len}",
                       param="max_tokens", code="context_length_exceeded")
    check_inspect_length(serving, len(ids) + req.max_tokens, "max_tokens" if req.max_tokens else "prompt")
    opts = _options(serving, req, len(ids) + req.max_tokens)
    interventions = to_interventions(req.interventions, serving.vectors, c.n_layers, c.dim)
    completion = None
    if req.max_tokens:
        completion = await _generate(serving, request, ids, req, interventions, adapter)
        T = len(ids) + len(completion["token_ids"])
        opts.rows = _absolute(req.rows, T, "rows")
        opts.hidden_positions = _absolute(req.hidden_positions, T, "hidden_positions")
    sequence = ids + (completion["token_ids"] if completion else [])
    run = await run_probe(serving, request, sequence, opts, interventions, len(ids), adapter)
    result = run.result()
    body = {"id": f"insp-{uuid.uuid4().hex[:24]}", "object": "inspection", "created": now(),
            "model": adapter or serving.model_name,
            "mode": opts.mode, "format": req.format,
            "config": {"n_layers": c.n_layers, "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim,
                       "dim": c.dim, "vocab_size": c.vocab_size},
            "layers_selected": opts.selected_layers(c.n_layers), "heads_selected": result.heads,
            "kv_groups": result.kv_groups, "num_prompt_tokens": len(ids), "completion": completion,
            "interventions": len(interventions or [])}
    body.update(await run_in_threadpool(fmt.render, result, opts, req.format, serving.tokenizer, c.n_layers,
                                        req.hidden_dtype))
    body["usage"] = {"prompt_tokens": len(ids), "completion_tokens": len(sequence) - len(ids), "total_tokens": len(sequence),
                     "compute_ms": round(result.compute_ms, 1), "response_bytes": 0}
    data = await run_in_threadpool(fmt.dumps_with_size, body)
    log.info("inspect tokens=%d mode=%s layers=%d compute_ms=%.0f latency_ms=%.0f bytes=%d", len(sequence), opts.mode,
             len(result.layers), result.compute_ms, (time.perf_counter() - started) * 1e3, len(data))
    return Response(data, media_type="application/json")


@router.post("/inspect/compare")
async def compare(req: CompareRequest, request: Request, serving: Serving = Depends(get_serving)):
    """One sequence under `model` (the reference) and under each of `compare`: per selected block, how far each moved
    the residual stream, its heads' attention maps and the logit lens (model/probes/compare.py)."""
    ref = serving.check_model(req.model, adapters=True)
    others = [serving.check_model(name, adapters=True) for name in req.compare]
    if req.max_tokens or req.interventions:
        raise APIError(400, "compare inspects the given sequence as it is: no max_tokens, no interventions",
                       param="max_tokens" if req.max_tokens else "interventions", code="invalid_value")
    started = time.perf_counter()
    ids = _sequence(serving, req)
    check_inspect_length(serving, len(ids), "prompt")
    opts = _options(serving, req, len(ids))
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
