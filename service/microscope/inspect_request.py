"""What /inspect and /inspect/compare read from a request: its one sequence (a prompt, token ids or chat messages),
and the ProbeOptions its selectors ask for, positions made absolute, within the inspect byte budget (413 over it)."""

from __future__ import annotations

from model.probes import DEFAULT_INCLUDES, ProbeOptions
from service.api.openai.prepare import check_token_ids, render_chat
from service.common.errors import APIError
from service.common.serving import Serving
from service.microscope import inspect_format as fmt
from service.microscope.schemas import InspectRequest


def request_tokens(serving: Serving, req: InspectRequest) -> list[int]:
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


def probe_options(serving: Serving, req: InspectRequest, T: int) -> ProbeOptions:
    """Options for a sequence of (at most) T tokens; 400 for out-of-range selectors, 413 over the byte budget."""
    c = serving.config
    opts = ProbeOptions(
        layers=req.layers, heads=req.heads,
        include=frozenset(req.include) if req.include is not None else DEFAULT_INCLUDES,
        massive_threshold=req.massive_threshold, massive_ratio=req.massive_ratio, massive_top_k=req.massive_top_k,
        massive_max_entries=req.massive_max_entries, mode=req.mode, rows=absolute(req.rows, T, "rows"),
        attention_top_k=req.attention_top_k, pool_size=req.pool_size, pool_reduce=req.pool_reduce,
        lens_top_k=req.lens_top_k, lens_positions=req.lens_positions,
        hidden_positions=absolute(req.hidden_positions, T, "hidden_positions"),
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


def absolute(positions: list[int] | None, T: int, param: str) -> list[int] | None:
    if positions is None:
        return None
    out = [p + T if p < 0 else p for p in positions]
    if any(not 0 <= p < T for p in out):
        raise APIError(400, f"{param} must be in [-{T}, {T}) for this {T}-token sequence", param=param, code="invalid_value")
    return out
