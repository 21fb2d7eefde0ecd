"""The choices of one /v1/chat/completions response, streamed chunk by chunk (a service/api/openai/sse_response.py
`StreamedChoices`) or collected whole: each choice's content or tool calls (parsed as they arrive,
service/api/openai/tool_calls.py), its reasoning apart (`--reasoning-parser`, model/text/reasoning.py), chat logprobs, hidden
states."""

from __future__ import annotations

from collections.abc import Callable

from model.engine import RequestOutput
from model.text import Tokenizer
from model.text.reasoning import ReasoningSplit
from service.api.openai.feature_output import ChoiceFeatures, chunk_features, token_value
from service.api.openai.format import chat_logprob, encode_hidden, merge_hidden, now, usage
from service.api.openai.tool_calls import ChoiceMessage, ToolPlan


class ChatChoices:
    def __init__(self, tok: Tokenizer, n: int, plan: ToolPlan, logprobs: bool, rid: str, model: str,
                 hidden_dtype: str | None, reasoning: Callable[[], ReasoningSplit] | None = None,
                 include_reasoning: bool = True, features: str | None = None) -> None:
        """`reasoning`: a new split for each choice (None: no reasoning parser, the reasoning stays content);
        `include_reasoning` false: the reasoning is split off and left out (vLLM's field); `features`: the dictionary
        the request reads features of (None: none)."""
        self.tok, self.n, self.plan, self.logprobs, self.hidden_dtype = tok, n, plan, logprobs, hidden_dtype
        self.rid, self.created, self.model = rid, now(), model
        self.count = n
        self._messages = {c: ChoiceMessage(plan) for c in range(n)}  # each choice's content or tool calls, parsed
        self._splits = {c: reasoning() for c in range(n)} if reasoning is not None else None
        self._include_reasoning = include_reasoning
        self._reasoning: dict[int, str] = {c: "" for c in range(n)}
        self._lps: dict[int, list] = {c: [] for c in range(n)}
        self._hidden: dict[int, list] = {c: [] for c in range(n)}
        self._features = {c: ChoiceFeatures(features) for c in range(n)} if features is not None else None

    def envelope(self, choices: list[dict], **extra) -> dict:
        return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": choices, **extra}

    # ---- streamed -------------------------------------------------------------------------------------------

    def head(self) -> list[dict]:
        """The role first, as OpenAI sends it: one chunk per choice."""
        content = "" if self.plan.mode == "none" else None
        return [self.envelope([{"index": c, "delta": {"role": "assistant", "content": content}, "logprobs": None,
                                "finish_reason": None}]) for c in range(self.n)]

    async def tail(self) -> None:
        return None

    def close(self) -> None:
        pass

    def chunk(self, choice: int, out: RequestOutput) -> dict | None:
        """One output's chunk choice, or None when it carries nothing to send."""
        lp = {"content": [chat_logprob(self.tok, l) for l in out.logprobs]} if out.logprobs else None
        reasoning, text = self._split(choice, out)
        delta = self._messages[choice].delta(text, out.finished)  # content, or tool-call deltas once parsed
        if reasoning:
            delta = {"reasoning_content": reasoning, **(delta or {})}
        features = token_value(out)
        if delta is None and not out.finished and lp is None and out.hidden_states is None and features is None:
            return None
        c = {"index": choice, "delta": delta or {}, "logprobs": lp,
             "finish_reason": self._messages[choice].finish_reason(out.finish_reason)}
        if self.hidden_dtype is not None:
            c["hidden_states"] = encode_hidden(out.hidden_states, self.hidden_dtype)
        if features is not None:  # one token a chunk, with its features
            c["features"] = chunk_features(features)
        return c

    # ---- collected ------------------------------------------------------------------------------------------

    def _split(self, choice: int, out: RequestOutput) -> tuple[str, str]:
        """This output's text as (reasoning, content); without a reasoning parser all content."""
        if self._splits is None:
            return "", out.text
        split = self._splits[choice]
        reasoning, content = split.feed(out.text)
        if out.finished:
            r, c = split.finish()
            reasoning, content = reasoning + r, content + c
        self._reasoning[choice] += reasoning
        return (reasoning if self._include_reasoning else ""), content

    def add(self, choice: int, out: RequestOutput) -> None:
        self._messages[choice].delta(self._split(choice, out)[1], out.finished)
        self._lps[choice] += [chat_logprob(self.tok, l) for l in out.logprobs or []]
        if out.hidden_states is not None:
            self._hidden[choice].append(out.hidden_states)
        if self._features is not None:
            self._features[choice].add(token_value(out))

    def response(self, reasons: dict[int, str | None], prompt_tokens: int, completion_tokens: int,
                 cached_tokens: int) -> dict:
        choices = []
        for c in range(self.n):
            message = self._messages[c].message()
            if self._splits is not None:  # vLLM's: no text is null, on either side of the split
                message["content"] = message["content"] or None
                if self._include_reasoning:
                    message["reasoning_content"] = self._reasoning[c] or None
            choice = {"index": c, "message": message,
                      "logprobs": {"content": self._lps[c]} if self.logprobs else None,
                      "finish_reason": self._messages[c].finish_reason(reasons.get(c))}
            if self.hidden_dtype is not None:
                choice["hidden_states"] = encode_hidden(merge_hidden(self._hidden[c]), self.hidden_dtype)
            if self._features is not None:
                choice["features"] = self._features[c].as_dict()
            choices.append(choice)
        return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
