"""One /v1/messages reply: its content blocks built from the engine's outputs, as the stream's events (the
`anthropic` package's RawMessageStreamEvent types) and as the whole `Message`.

The text is parsed as a chat reply is (service/tool_calls.py `ChoiceMessage`: plain text, a forced call's
arguments, or calls read back when the reply ends), its reasoning split off first where the server has a
--reasoning-parser (model/text/reasoning.py). Then spoken in Anthropic's blocks: `thinking` (with a
`signature_delta` before it closes), `text`, and a `tool_use` per call, each opened by `content_block_start`, fed by
`thinking_delta` / `text_delta` / `input_json_delta` events and closed by `content_block_stop`, one block open at a
time, indices counting from 0 (Anthropic's "Streaming messages" page; vLLM's message_stream_converter). Plain text
and a forced call stream as they come; calls under tool_choice "any" or "auto" when the reply ends, since only the
whole reply says whether it is a call (as on /v1/chat/completions).

`stop_reason`: "tool_use" when the reply is calls, "max_tokens" when max_tokens (or the context) cut it,
"stop_sequence" (with `stop_sequence`) when one of stop_sequences ended it, else "end_turn". `usage` in
Anthropic's terms: `input_tokens` are the prompt tokens not read from the prefix cache, `cache_read_input_tokens`
those that were.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable

from model.engine import RequestOutput
from model.text.reasoning import ReasoningSplit
from service.api.openai.tool_calls import ChoiceMessage, ToolPlan


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def tool_use_id(call_id: str) -> str:
    """A chat call id (`call_...`, service/tool_parsers.py) in Anthropic's spelling (`toolu_...`)."""
    return "toolu_" + call_id.removeprefix("call_")


def signature(thinking: str) -> str:
    """A thinking block's `signature`: opaque to clients and not checked when given back; a digest of the text, so
    a streamed reply and a whole one carry the same."""
    return hashlib.sha256(thinking.encode()).hexdigest()


def _input(arguments: str) -> dict:
    """A call's arguments as the `input` object; a reply cut before its JSON closed has none to give."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageReply:
    def __init__(self, plan: ToolPlan, message_id: str, model: str, stop_sequences: list[str],
                 reasoning: Callable[[], ReasoningSplit] | None, show_thinking: bool, omit_thinking: bool) -> None:
        """`reasoning`: the split of --reasoning-parser (None: none, all text); `show_thinking` false: the reasoning
        is split off and dropped (thinking disabled); `omit_thinking`: thinking blocks without their text
        (`display: "omitted"`)."""
        self.plan, self.id, self.model, self.stop_sequences = plan, message_id, model, stop_sequences
        self.reply = ChoiceMessage(plan)
        self._split = reasoning() if reasoning is not None else None
        self._show_thinking, self._omit_thinking = show_thinking, omit_thinking
        self.content: list[dict] = []
        self._open: dict | None = None  # the block being streamed (the last of content)
        self._arguments = ""  # the open tool_use block's JSON so far
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    # ---- blocks ---------------------------------------------------------------------------------------------

    def _start(self, block: dict) -> list[dict]:
        events = self._stop()
        self.content.append(block)
        self._open = block
        return events + [{"type": "content_block_start", "index": len(self.content) - 1,
                          "content_block": copy.deepcopy(block)}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}

    def _stop(self) -> list[dict]:
        block, events = self._open, []
        if block is None:
            return events
        if block["type"] == "thinking":
            block["signature"] = signature(block.pop("_text"))
            events.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        elif block["type"] == "tool_use":
            block["input"] = _input(self._arguments)
        self._open = None
        return events + [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _thinking(self, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != "thinking":
            events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            self._open["_text"] = ""  # signed whole, also where display "omitted" sends none of it
        self._open["_text"] += text
        if self._omit_thinking:
            return events
        self._open["thinking"] += text
        return events + [self._delta({"type": "thinking_delta", "thinking": text})]

    def _text(self, text: str) -> list[dict]:
        events = self._start({"type": "text", "text": ""}) if self._open is None or self._open["type"] != "text" else []
        self._open["text"] += text
        return events + [self._delta({"type": "text_delta", "text": text})]

    def _tool_use(self, call_id: str, name: str) -> list[dict]:
        self._arguments = ""
        return self._start({"type": "tool_use", "id": tool_use_id(call_id), "name": name, "input": {}})

    def _json(self, text: str) -> list[dict]:
        self._arguments += text
        return [self._delta({"type": "input_json_delta", "partial_json": text})] if text else []

    # ---- the engine's outputs -------------------------------------------------------------------------------

    def add(self, out: RequestOutput) -> list[dict]:
        """One engine output of the reply -> the events it makes (a whole reply ignores them)."""
        reasoning, text = "", out.text
        if self._split is not None:
            reasoning, text = self._split.feed(out.text)
            if out.finished:
                r, t = self._split.finish()
                reasoning, text = reasoning + r, text + t
        events = self._thinking(reasoning) if reasoning and self._show_thinking else []
        delta = self.reply.delta(text, out.finished)
        if self.plan.mode == "none" and delta:
            events += self._text(delta["content"])
        elif self.plan.mode == "named" and delta:
            call = delta["tool_calls"][0]
            if "id" in call:
                events += self._tool_use(call["id"], call["function"]["name"])
            events += self._json(call["function"]["arguments"])
        if out.finished:
            events += self._finish(out)
        return events

    def _finish(self, out: RequestOutput) -> list[dict]:
        """Send whole what could only be parsed at the end (tool_choice "any" / "auto"), close what is open."""
        message = self.reply.message()
        content, calls = message["content"], message.get("tool_calls", [])
        events = []
        if self.plan.mode not in ("none", "named"):
            if content:
                events += self._text(content)
            for call in calls:
                events += self._tool_use(call["id"], call["function"]["name"]) + self._json(call["function"]["arguments"])
        events += self._stop()
        reason = out.finish_reason
        if reason == "length":
            self.stop_reason = "max_tokens"
        elif calls:
            self.stop_reason = "tool_use"
        elif isinstance(out.stop_reason, str) and out.stop_reason in self.stop_sequences:
            self.stop_reason, self.stop_sequence = "stop_sequence", out.stop_reason
        else:
            self.stop_reason = "end_turn"
        return events

    # ---- the message ----------------------------------------------------------------------------------------

    def message(self, usage: dict, content: bool = True) -> dict:
        """The `Message`: whole, or (content false) as message_start carries it."""
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": copy.deepcopy(self.content) if content else [],
                "stop_reason": self.stop_reason if content else None,
                "stop_sequence": self.stop_sequence if content else None, "usage": usage}

    def head(self, usage: dict) -> list[dict]:
        """message_start, then a ping, as Anthropic's stream opens."""
        return [{"type": "message_start", "message": self.message(usage, content=False)}, {"type": "ping"}]

    def tail(self, usage: dict) -> list[dict]:
        """message_delta (stop_reason, cumulative usage), then message_stop."""
        return [{"type": "message_delta", "delta": {"stop_reason": self.stop_reason,
                                                    "stop_sequence": self.stop_sequence}, "usage": usage},
                {"type": "message_stop"}]
