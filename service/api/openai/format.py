"""OpenAI wire formats the generation routes share: SSE framing, legacy and chat logprobs, usage, error events, and
the `hidden_states` a choice returns (vLLM's extension, as llamascope encodes it)."""

from __future__ import annotations

import base64
import json
import time

import numpy as np
import torch

from model.engine import HiddenStates, TokenLogprobs
from model.text import Tokenizer
from service.common.errors import envelope

DONE = "data: [DONE]\n\n"


# Characters str.splitlines (and so httpx's iter_lines, a common way to read SSE) takes for line ends, though the SSE
# spec ends lines at \r and \n only; JSON escapes \r, \n and the other C0 ones itself. Escaped (RFC 8259 section 7
# allows \uXXXX for any character), a token that decodes to one of them cannot split an event for such a client.
_LINE_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def sse(payload: dict) -> str:
    text = json.dumps(payload, ensure_ascii=False, separators=(',', ':')).translate(_LINE_BREAKS)
    return f"data: {text}\n\n"


def sse_error(status: int, message: str) -> str:
    return sse(envelope(status, message))


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def token_text(tok: Tokenizer, token_id: int) -> str:
    """A token's own text as the legacy `logprobs.tokens` lists it (decoded alone; partial UTF-8 shows as U+FFFD)."""
    return tok.decode([token_id])


class LegacyLogprobs:
    """OpenAI completions `logprobs`: tokens, token_logprobs, top_logprobs ({text: logprob}), text_offset."""

    def __init__(self, tok: Tokenizer, offset: int = 0) -> None:
        self.tok, self.offset = tok, offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, lp: TokenLogprobs | None) -> None:
        text = token_text(self.tok, token_id)
        self.tokens.append(text)
        self.text_offset.append(self.offset)
        self.offset += len(text)
        self.token_logprobs.append(lp.logprob if lp else None)
        self.top_logprobs.append({token_text(self.tok, t): v for t, v in lp.top} if lp and lp.top else (None if lp is None else {}))

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


def chat_logprob(tok: Tokenizer, lp: TokenLogprobs) -> dict:
    """OpenAI chat `logprobs.content[i]`."""
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tok, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}


def encode_hidden(hs: HiddenStates | None, dtype: str) -> dict | None:
    """Hidden states as JSON: values (n_positions, n_layers, D), little-endian float32 (or float16) in base64."""
    if hs is None:
        return None
    arr = np.ascontiguousarray(hs.values.numpy().astype("<f4" if dtype == "float32" else "<f2"))
    return {"layers": hs.layers, "positions": hs.positions, "shape": list(arr.shape), "dtype": dtype,
            "encoding": "base64", "data": base64.b64encode(arr.tobytes()).decode("ascii")}


def merge_hidden(parts: list[HiddenStates]) -> HiddenStates | None:
    """A choice's hidden-state deltas, in order, as one."""
    if not parts:
        return None
    return HiddenStates(parts[0].layers, [p for h in parts for p in h.positions], torch.cat([h.values for h in parts]))
