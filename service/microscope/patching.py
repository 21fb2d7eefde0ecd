"""What /inspect/patch and /inspect/attribute share: their prompts and answer tokens, the sweep's shape and budgets,
and exact patching cells run as rows of the engine's own batches (model/probes/patching.py says what is computed).

Order of work for an exact sweep: the source run (with the hidden-state read the residual cells copy from; and where
the sweep has head sites, a capture forward of the source on the engine thread, model/probes/capture.py, for the
heads' values) and the target run (whose KV blocks the prefix cache then serves to every cell) first; then the
cells, submitted in waves so that the waiting queue is never filled by one sweep. Every row is a background request:
it yields to latency-sensitive traffic in the scheduler (model/engine/scheduler.py).
"""

from __future__ import annotations

import asyncio
import math
import uuid

from model.engine import RequestOptions, SamplingParams
from model.hook_names import parse_hook
from model.interventions import HEAD_SITES, HeadShape, HiddenStateRead, Intervention
from model.probes import PatchSweep, SiteCapture, cell_interventions, metric
from service.common.errors import APIError
from service.api.openai.prepare import render_chat
from service.microscope.probing import run_job
from service.microscope.schemas import PatchRequest
from service.common.serving import Serving

WAVE = 32  # cells a submission; two waves in flight keep the engine's batches full without filling its queue
RESPONSE_BYTES_PER_CELL = 48  # two numbers of the grids as JSON, with separators
RESIDUAL_SITES = ["attention_output", "mlp_output", "block_output"]  # what `sites: "all"` names
PATCH_HOOK_SITES = (*RESIDUAL_SITES, "resid_mid", "mlp_input", "head_output")  # what a hook name can reach here
# (model/hook_names.py; mlp_normalized is read, never set, so it is not patched)


def prompt_tokens(serving: Serving, value, add_generation_prompt: bool, field: str) -> list[int]:
    """A prompt string, or chat messages rendered with the model's template -> token ids (400 naming `field`)."""
    if isinstance(value, str):
        ids = serving.tokenizer.encode(value)
        if not ids:
            raise APIError(400, f"{field}: the prompt tokenizes to nothing", param=field, code="empty_prompt")
    else:
        try:
            ids = render_chat(serving, value, add_generation_prompt)
        except APIError as e:
            raise APIError(e.status, e.message, param=field, code=e.code) from None
    return ids


def one_token(serving: Serving, text: str, field: str) -> int:
    ids = serving.tokenizer.encode(text, add_bos=False)
    if len(ids) != 1:
        shown = [serving.tokenizer.decode([t]) for t in ids]
        raise APIError(400, f"{field}: {text!r} is {len(ids)} tokens {shown}; give a string that is exactly one token "
                            "(a leading space is usually part of the token)", param=field, code="invalid_value")
    return ids[0]


def build_sweep(serving: Serving, req: PatchRequest, clean: list[int], corrupted: list[int]) -> PatchSweep:
    """The sweep a request asks for (400 naming the field for anything out of range), budgets not yet checked."""
    c, T = serving.config, len(clean)
    if len(corrupted) != T:
        raise APIError(400, f"corrupted: {len(corrupted)} tokens, the clean prompt has {T}; activation patching copies "
                            "activations position by position, so the two prompts must have equal token counts "
                            "(POST /tokenize shows the tokens)", param="corrupted", code="invalid_value")
    if req.hook is not None:
        sites, layers = hook_grid(serving, req)
    else:
        sites = list(RESIDUAL_SITES) if req.sites == "all" else list(req.sites)
        layers = list(range(c.n_layers)) if req.layers == "all" else list(req.layers)
    if any(s in HEAD_SITES for s in sites) and serving.settings.tensor_parallel_size > 1:
        raise APIError(400, "sites: head sites are not available under tensor parallelism (each rank holds some of the "
                            "heads)", param="sites", code="invalid_value")
    positions = sweep_positions(req.positions, T)
    answer = one_token(serving, req.answer, "answer")
    contrast = one_token(serving, req.contrast, "contrast") if req.contrast is not None else None
    sweep = PatchSweep(sites, layers, positions, T, answer, contrast, req.metric, req.direction,
                       heads=None if req.heads == "all" else list(req.heads), head_shape=HeadShape.of(c))
    try:
        sweep.validate(c.n_layers)
    except ValueError as e:  # messages start with the field's name
        param = str(e).split(":", 1)[0]
        raise APIError(400, str(e), param=param, code="invalid_value") from None
    return sweep


def token_field(tok, i: int | None) -> dict | None:
    """A token id as a response gives it (`text`, `token_id`), or None."""
    return None if i is None else {"text": tok.decode([i]), "token_id": i}


def pearson(a: list[float], b: list[float]) -> float | None:
    """The Pearson correlation of two lists (None for fewer than two, or a constant one)."""
    n = len(a)
    if n < 2:
        return None
    ma, mb = sum(a) / n, sum(b) / n
    sa = math.sqrt(sum((x - ma) ** 2 for x in a))
    sb = math.sqrt(sum((y - mb) ** 2 for y in b))
    return None if sa == 0 or sb == 0 else sum((x - ma) * (y - mb) for x, y in zip(a, b)) / (sa * sb)


def sweep_positions(positions, T: int) -> list[int]:
    """A request's `positions` ("all", or indices, negative from the end) -> indices in [0, T) (400 otherwise)."""
    if positions == "all":
        return list(range(T))
    if any(not -T <= p < T for p in positions):
        raise APIError(400, f"positions: token indices must be in [-{T}, {T}) for these {T}-token prompts",
                       param="positions", code="invalid_value")
    return [p + T if p < 0 else p for p in positions]


def hook_grid(serving: Serving, req: PatchRequest) -> tuple[list[str], list[int]]:
    """`hook` (TransformerLens hook names or HF module paths, model/hook_names.py) -> the sweep's sites and layers.
    The grid is sites x layers, so several hooks must name every pair of their sites and layers; 400 naming `hook`
    for a name that is not a place patching serves."""
    for name in ("sites", "layers"):
        if name in req.model_fields_set:
            raise APIError(400, f"{name}: give either hook or sites + layers, not both", param=name,
                           code="invalid_value")
    names = [req.hook] if isinstance(req.hook, str) else list(req.hook)
    hooks = []
    for name in names:
        if len(name) > 256:
            raise APIError(400, f"hook: a hook name of {len(name)} characters; they are at most 256", param="hook",
                           code="invalid_value")
        try:
            hook = parse_hook(name, config=serving.config, where="hook")
        except ValueError as e:
            raise APIError(400, str(e), param="hook", code="invalid_value") from None
        if hook.site not in PATCH_HOOK_SITES:
            raise APIError(400, f"hook: {name!r} is {hook.site} of layer {hook.layer}, which patching does not serve; "
                                f"it patches {list(PATCH_HOOK_SITES)}", param="hook", code="invalid_value")
        hooks.append((hook.site, hook.layer))
    sites = list(dict.fromkeys(s for s, _ in hooks))
    layers = list(dict.fromkeys(l for _, l in hooks))
    if len(set(hooks)) != len(hooks) or len(hooks) != len(sites) * len(layers):
        raise APIError(400, f"hook: a sweep is a grid of sites x layers; these hooks name {len(set(hooks))} places of "
                            f"{len(sites)} sites x {len(layers)} layers (give every pair once, or sites + layers)",
                       param="hook", code="invalid_value")
    return sites, layers


def check_patch_budget(serving: Serving, sweep: PatchSweep) -> None:
    """An exact sweep's budgets, before anything runs: cells, and the values it holds (400, `patch_too_large`)."""
    c, limit = serving.config, serving.settings.max_patch_cells
    if sweep.num_cells > limit:
        raise APIError(400, f"positions: {sweep.num_cells} cells ({len(sweep.sites)} sites x {len(sweep.layers)} layers"
                            f"{' x heads' if sweep.head_sites else ''} x {len(sweep.positions)} positions), over this "
                            f"server's limit of {limit} (max_patch_cells); sweep fewer layers, positions, heads or "
                            "sites", param="positions", code="patch_too_large")
    budget = serving.settings.max_inspect_response_bytes
    size = max(sweep.source_bytes(c.dim), sweep.num_cells * RESPONSE_BYTES_PER_CELL)
    if size > budget:
        raise APIError(400, f"positions: the sweep would hold about {size / 1e6:.0f} MB ({sweep.num_cells} cells of "
                            f"{c.dim} float32 values), over the {budget / 1e6:.0f} MB inspect budget "
                            "(max_inspect_response_bytes); sweep fewer cells", param="positions", code="patch_too_large")


def scoring(sweep: PatchSweep) -> SamplingParams:
    """One step, the metric's tokens scored at the last position."""
    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, ignore_eos=True,
                          score_token_ids=sweep.score_token_ids())


async def run_rows(serving: Serving, rid: str, prompts: list[list[int]], params: SamplingParams,
                   each: list[list[Intervention] | None], read: HiddenStateRead | None = None,
                   adapter: str | None = None) -> list[tuple[list[float], object]]:
    """Submit prompts as background rows (under LoRA adapter `adapter`, or the base); -> per prompt (scored
    logprobs, hidden states or None)."""
    options = [RequestOptions(interventions=cell, hidden_states=read, background=True, lora=adapter) for cell in each]
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


async def run_cells(serving: Serving, rid: str, sweep: PatchSweep, target: list[int],
                    each: list[list[Intervention]], adapter: str | None = None) -> list[float]:
    """The target prompt once per cell, with that cell's edits (under `adapter`) -> the metric of each, in order."""
    values: list[float] = [0.0] * len(each)
    waves = [range(i, min(i + WAVE, len(each))) for i in range(0, len(each), WAVE)]
    limit = asyncio.Semaphore(2)
    params = scoring(sweep)

    async def wave(n: int, rows: range) -> None:
        async with limit:
            out = await run_rows(serving, f"{rid}-c{n}", [target] * len(rows), params, [each[i] for i in rows],
                                 adapter=adapter)
        for i, (scored, _) in zip(rows, out):
            values[i] = metric(sweep, scored)

    await asyncio.gather(*(wave(n, rows) for n, rows in enumerate(waves)))
    return values


async def capture_heads(serving: Serving, sweep: PatchSweep, source: list[int], adapter: str | None = None) -> dict | None:
    """The source's values at the sweep's head sites and positions (one capture forward on the engine thread)."""
    if not sweep.head_sites:
        return None
    capture = SiteCapture(tuple(sweep.head_sites), frozenset(sweep.layers), sorted(sweep.positions),
                          adapter=serving.adapter(adapter))
    await run_job(serving, None, serving.new_capture(source, capture))
    return capture.values


async def sweep_grid(serving: Serving, sweep: PatchSweep, source: list[int], target: list[int],
                     adapter: str | None = None) -> dict:
    """Run the sweep (every row under LoRA adapter `adapter`, or the base) -> the baselines and the metric of every
    cell (in `sweep.cells()` order)."""
    rid = f"patch-{uuid.uuid4().hex[:16]}"
    params = scoring(sweep)
    read = sweep.source_read()
    # the two baselines at once (and the heads' capture); the target's blocks are in the prefix cache before any cell
    [(src_scored, hidden)], [(tgt_scored, _)], heads = await asyncio.gather(
        run_rows(serving, f"{rid}-s", [source], params, [None], read, adapter),
        run_rows(serving, f"{rid}-t", [target], params, [None], adapter=adapter),
        capture_heads(serving, sweep, source, adapter))
    positions = sorted(sweep.positions)
    if read is not None and (hidden is None or hidden.positions != positions):
        raise APIError(500, "the source run's hidden states did not come back", code="generation_failed")
    each = cell_interventions(sweep, hidden.values if read is not None else None, positions, heads)
    values = await run_cells(serving, rid, sweep, target, each, adapter)
    return {"source": metric(sweep, src_scored), "target": metric(sweep, tgt_scored), "values": values}


def sweep_fields(serving: Serving, sweep: PatchSweep) -> dict:
    """The sweep's axes as a response gives them."""
    out = {"sites": sweep.sites, "layers": sweep.layers, "positions": sweep.positions}
    if sweep.head_sites:
        out["heads"] = sweep.heads_of("head_output")
        out["kv_heads"] = sweep.heads_of("head_k")
    return out
