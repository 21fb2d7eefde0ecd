"""Request preparation every route shares: prompts to token ids (a completions prompt in any of its four forms, chat
messages through the checkpoint's template) and the inspection length limit, each refusal a 400 / 413 naming the
field. Routes import these from here, never from one another."""

from __future__ import annotations

from service.errors import APIError
from service.schemas import ChatMessage
from service.serving import Serving
from service.tool_calls import ToolPlan, template_messages, template_tools


def tokenize_prompts(serving: Serving, prompt) -> list[list[int]]:
    """A completions `prompt` (a string, a list of strings, token ids, or lists of token ids) -> one id list each."""
    tok = serving.tokenizer
    if isinstance(prompt, str):
        prompts = [tok.encode(prompt)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = [tok.encode(p) for p in prompt]
    else:
        prompts = [list(p) for p in prompt]
    if not prompts or any(not p for p in prompts):
        raise APIError(400, "prompt must not be empty", param="prompt", code="empty_prompt")
    if len(prompts) > serving.settings.max_prompts:
        raise APIError(400, f"at most {serving.settings.max_prompts} prompts per request, got {len(prompts)}",
                       param="prompt")
    check_token_ids([t for p in prompts for t in p], serving, "prompt")
    return prompts


def check_token_ids(ids: list[int], serving: Serving, param: str) -> None:
    V = serving.config.vocab_size
    if any(t >= V for t in ids):
        raise APIError(400, f"{param}: token ids must be below the vocabulary size {V}", param=param, code="invalid_token")


def render_chat(serving: Serving, messages: list[ChatMessage], add_generation_prompt: bool = True,
                plan: ToolPlan | None = None) -> list[int]:
    """Chat messages (and the tools of `plan`) through the checkpoint's chat template -> token ids."""
    tok = serving.tokenizer
    plan = plan or ToolPlan("none")
    try:
        text = tok.apply_chat_template(template_messages(messages, plan), add_generation_prompt=add_generation_prompt,
                                       tools=template_tools(plan))
    except Exception as e:  # no template, or the template's own raise_exception (e.g. roles out of order)
        raise APIError(400, f"cannot render the chat template: {e}", param="messages", code="chat_template") from None
    ids = tok.encode(text, add_bos=False)  # the template writes any BOS itself (transformers: add_special_tokens=False)
    if not ids:
        raise APIError(400, "the rendered conversation is empty", param="messages", code="empty_prompt")
    return ids


def check_inspect_length(serving: Serving, T: int, param: str = "prompt") -> None:
    """413 for an inspection (or a probe run for a vector or a summary) of more than --max-inspect-tokens."""
    limit = serving.settings.max_inspect_tokens
    if T > limit:
        raise APIError(413, f"inspecting {T} tokens exceeds the limit of {limit} (max_inspect_tokens)",
                       param=param, code="inspect_too_long")
