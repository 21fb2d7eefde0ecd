"""POST /inspect/patch: an activation-patching sweep (causal tracing) of the served model, run as rows of the
engine's own batches beside other traffic (model/probes/patching.py says what is computed and how).

Order of work: the source run (with the hidden-state read the cells copy from) and the target run (whose KV blocks
the prefix cache then serves to every cell) first; then the cells, submitted in waves so that the waiting queue
is never filled by one sweep. Every row is a background request: it yields to latency-sensitive traffic in the
scheduler (model/engine/scheduler.py). Budgets (cells, bytes) are checked before anything runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from fastapi import APIRouter, Depends, Request

from model.engine import RequestOptions, SamplingParams
from model.interventions import HiddenStateRead, Intervention
from model.probes.patching import PatchSweep, cell_interventions, grid, metric, normalise
from service import inspect_format as fmt
from service.errors import APIError
from service.prepare import check_inspect_length, render_chat
from service.openai_format import now
from service.runner import until_disconnect
from service.schemas import PatchRequest
from service.serving import Serving, get_serving

router = APIRouter()
log = logging.getLogger("llamascope.service")

WAVE = 32  # cells a submission; two waves in flight keep the engine's batches full without filling its queue
RESPONSE_BYTES_PER_CELL = 48  # two numbers of the grids as JSON, with separators


def _tokens(serving: Serving, value, req: PatchRequest, field: str) -> list[int]:
    if isinstance(value, str):
        ids = serving.tokenizer.encode(value)
        if not ids:
            raise APIError(400, f"{field}: the prompt tokenizes to nothing", param=field, code="empty_prompt")
    else:
        try:
            ids = render_chat(serving, value, req.add_generation_prompt)
        except APIError as e:
            raise APIError(e.status, e.message, param=field, code=e.code) from None
    return ids


def _one_token(serving: Serving, text: str, field: str) -> int:
    ids = serving.tokenizer.encode(text, add_bos=False)
    if len(ids) != 1:
        shown = [serving.tokenizer.decode([t]) for t in ids]
        raise APIError(400, f"{field}: {text!r} is {len(ids)} tokens {shown}; give a string that is exactly one token "
                            "(a leading space is usually part of the token)", param=field, code="invalid_value")
    return ids[0]


def _sweep(serving: Serving, req: PatchRequest, clean: list[int], corrupted: list[int]) -> PatchSweep:
    c, T = serving.config, len(clean)
    if len(corrupted) != T:
        raise APIError(400, f"corrupted: {len(corrupted)} tokens, the clean prompt has {T}; activation patching copies "
                            "activations position by position, so the two prompts must have equal token counts "
                            "(POST /tokenize shows the tokens)", param="corrupted", code="invalid_value")
    sites = ["attention_output", "mlp_output", "block_output"] if req.sites == "all" else list(req.sites)
    layers = list(range(c.n_layers)) if req.layers == "all" else list(req.layers)
    if req.positions == "all":
        positions = list(range(T))
    else:
        if any(not -T <= p < T for p in req.positions):
            raise APIError(400, f"positions: token indices must be in [-{T}, {T}) for these {T}-token prompts",
                           param="positions", code="invalid_value")
        positions = [p + T if p < 0 else p for p in req.positions]
    answer = _one_token(serving, req.answer, "answer")
    contrast = _one_token(serving, req.contrast, "contrast") if req.contrast is not None else None
    sweep = PatchSweep(sites, layers, positions, T, answer, contrast, req.metric, req.direction)
    try:
        sweep.validate(c.n_layers)
    except ValueError as e:  # messages start with the field's name
        param = str(e).split(":", 1)[0]
        raise APIError(400, str(e), param=param, code="invalid_value") from None
    limit = serving.settings.max_patch_cells
    if sweep.num_cells > limit:
        raise APIError(400, f"positions: {len(sites)} sites x {len(layers)} layers x {len(positions)} positions = "
                            f"{sweep.num_cells} cells, over this server's limit of {limit} (max_patch_cells); sweep "
                            "fewer layers, positions or sites", param="positions", code="patch_too_large")
    budget = serving.settings.max_inspect_response_bytes
    size = max(sweep.source_bytes(c.dim), sweep.num_cells * RESPONSE_BYTES_PER_CELL)
    if size > budget:
        raise APIError(400, f"positions: the sweep would hold about {size / 1e6:.0f} MB ({sweep.num_cells} cells of "
                            f"{c.dim} float32 values), over the {budget / 1e6:.0f} MB inspect budget "
                            "(max_inspect_response_bytes); sweep fewer cells", param="positions", code="patch_too_large")
    return sweep


async def _run(serving: Serving, rid: str, prompts: list[list[int]], params: SamplingParams,
               each: list[list[Intervention] | None], read: HiddenStateRead | None = None) -> list[tuple[list[float], object]]:
    """Submit prompts as background rows; -> per prompt (scored logprobs, hidden states or None)."""
    options = [RequestOptions(interventions=cell, hidden_states=read, background=True) for cell in each]
    streams = await serving.add_requests([(f"{rid}-{i}", p) for i, p in enumerate(prompts)], params, options)

    async def one(stream) -> tuple[list[float], object]:
        scored, hidden, error = None, None, None
        try:
            async for out in stream:
                if out.logprobs:
                    scored = out.logprobs[0].scored
                hidden = out.hidden_states if out.hidden_states is not None else hidden
                error = out.error or error
        finally:
            stream.close()
        if error or scored is None:
            raise APIError(500, f"a patching row failed: {error or 'no logits came back'}", code="generation_failed")
        return scored, hidden

    tasks = [asyncio.ensure_future(one(s)) for s in streams]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()  # a failure or a disconnect: every stream closes, which aborts its row


async def sweep_grid(serving: Serving, sweep: PatchSweep, source: list[int], target: list[int]) -> dict:
    """Run the sweep -> the baselines and the metric of every cell (in `sweep.cells()` order)."""
    rid = f"patch-{uuid.uuid4().hex[:16]}"
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, ignore_eos=True,
                            score_token_ids=sweep.score_token_ids())
    read = sweep.source_read()
    # the two baselines at once; the target's blocks are in the prefix cache before any cell is submitted
    [(src_scored, hidden)], [(tgt_scored, _)] = await asyncio.gather(
        _run(serving, f"{rid}-s", [source], params, [None], read), _run(serving, f"{rid}-t", [target], params, [None]))
    positions = sorted(sweep.positions)
    if hidden is None or hidden.positions != positions:
        raise APIError(500, "the source run's hidden states did not come back", code="generation_failed")
    each = cell_interventions(sweep, hidden.values, positions)  # (n_positions, n_layers x n_sites, D) in

    values: list[float] = [0.0] * len(each)
    waves = [range(i, min(i + WAVE, len(each))) for i in range(0, len(each), WAVE)]
    limit = asyncio.Semaphore(2)

    async def wave(n: int, rows: range) -> None:
        async with limit:
            out = await _run(serving, f"{rid}-c{n}", [target] * len(rows), params, [each[i] for i in rows])
        for i, (scored, _) in zip(rows, out):
            values[i] = metric(sweep, scored)

    await asyncio.gather(*(wave(n, rows) for n, rows in enumerate(waves)))
    return {"source": metric(sweep, src_scored), "target": metric(sweep, tgt_scored), "values": values}


@router.post("/inspect/patch")
async def patch(req: PatchRequest, request: Request, serving: Serving = Depends(get_serving)):
    serving.check_model(req.model)
    started = time.perf_counter()
    clean = _tokens(serving, req.clean, req, "clean")
    corrupted = _tokens(serving, req.corrupted, req, "corrupted")
    check_inspect_length(serving, len(clean), "clean")
    sweep = _sweep(serving, req, clean, corrupted)
    source, target = (clean, corrupted) if sweep.direction == "denoise" else (corrupted, clean)
    result = await until_disconnect(request, sweep_grid(serving, sweep, source, target))
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
        "model": serving.model_name,
        "precision": serving.precision, "metric": sweep.metric, "direction": sweep.direction,
        "answer": {"text": tok.decode([sweep.answer]), "token_id": sweep.answer},
        "contrast": {"text": tok.decode([sweep.contrast]), "token_id": sweep.contrast} if sweep.contrast is not None else None,
        "sites": sweep.sites, "layers": sweep.layers, "positions": sweep.positions,
        "clean_tokens": fmt.token_list(tok, clean), "corrupted_tokens": fmt.token_list(tok, corrupted),
        "baselines": {"clean": m_clean, "corrupted": m_corrupted},
        "normalized": grid(sweep, normalised), "raw": grid(sweep, result["values"]),
        "usage": {"cells": sweep.num_cells, "rows": sweep.num_cells + 2, "prompt_tokens": len(clean),
                  "seconds": round(elapsed, 3)},
    }
    log.info("patch tokens=%d cells=%d seconds=%.2f", len(clean), sweep.num_cells, elapsed)
    return body
