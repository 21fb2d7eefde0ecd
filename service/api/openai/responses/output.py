"""One /v1/responses response: its output items built from the engine's outputs, as the typed server-sent events
the openai package parses (openai/types/responses/*_event.py) and as the whole `Response` object.

The reply is parsed as a chat reply is (service/api/openai/tool_calls.py `ChoiceMessage`), then spoken in items: a `message`
with one `output_text` part, and a `function_call` item per call (`call_id` is what the client answers with a
`function_call_output`). A plain reply streams its text as it comes, a forced call (named `tool_choice`) its
arguments; `required` and `auto` send their items when the reply ends, since only the whole reply says which it is
(as on /v1/chat/completions). Events, in OpenAI's order (and vLLM's, serving_responses.py): `response.created`,
`response.in_progress`; per item `response.output_item.added`, for a message `response.content_part.added`,
`response.output_text.delta`..., `response.output_text.done`, `response.content_part.done`, for a call
`response.function_call_arguments.delta`..., `response.function_call_arguments.done`; `response.output_item.done`;
then `response.completed` (`response.incomplete` when `max_output_tokens` ended it, `response.failed` when
generation failed). Each carries `sequence_number`, counting from 0.
"""

from __future__ import annotations

import copy
import uuid

from model.engine import RequestOutput
from model.text import Tokenizer
from service.api.openai.feature_output import ChoiceFeatures, chunk_features, token_value
from service.api.openai.format import chat_logprob, now, sse
from service.api.openai.responses.schemas import ResponsesRequest
from service.api.openai.tool_calls import ChoiceMessage, ToolPlan


def response_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def event_text(event: dict) -> str:
    """One event as SSE, named by its type as OpenAI's stream names it (`event: response.created`)."""
    return f"event: {event['type']}\n" + sse(event)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponseOutput:
    def __init__(self, tok: Tokenizer, plan: ToolPlan, req: ResponsesRequest, request_id: str, model: str) -> None:
        self.tok, self.plan, self.req, self.model = tok, plan, req, model
        self.id, self.created_at = f"resp_{request_id}", now()
        self.reply = ChoiceMessage(plan)
        self.items: list[dict] = []  # the output, the item being streamed last
        self._logprobs: list[dict] = []
        self._open: dict | None = None  # the item being streamed
        self._sequence = 0
        self.features = ChoiceFeatures(req.features.sae) if req.features is not None else None

    # ---- events ---------------------------------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def head(self) -> list[dict]:
        snapshot = self.response("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def tail(self, reason: str | None, usage: dict, error: str | None = None) -> dict:
        """The last event: the whole response, completed, incomplete (max_output_tokens) or failed."""
        status = self.status(reason, error)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        return self._event(kind, response=self.response(status, usage, error))

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _add_item(self, item: dict) -> list[dict]:
        self.items.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item))]

    def _open_message(self) -> list[dict]:
        events = self._add_item({"id": _new_id("msg"), "type": "message", "role": "assistant",
                                 "status": "in_progress", "content": []})
        part = {"type": "output_text", "text": "", "annotations": []}
        if self.req.logprobs:
            part["logprobs"] = []
        self._open["content"].append(part)
        events.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def _text(self, text: str, logprobs: list[dict]) -> list[dict]:
        events = self._open_message() if self._open is None or self._open["type"] != "message" else []
        part = self._open["content"][0]
        part["text"] += text
        if "logprobs" in part:
            part["logprobs"] += logprobs
        return events + [self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                     logprobs=[_delta_logprob(l) for l in logprobs])]

    def _open_call(self, call_id: str, name: str) -> list[dict]:
        return self._add_item({"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
                               "call_id": call_id, "name": name, "arguments": ""})

    def _arguments(self, text: str) -> list[dict]:
        self._open["arguments"] += text
        return [self._event("response.function_call_arguments.delta", **self._where(), delta=text)]

    def _close(self, status: str) -> list[dict]:
        item, events = self._open, []
        if item["type"] == "message":
            part = item["content"][0]
            events += [self._event("response.output_text.done", **self._where(), content_index=0, text=part["text"],
                                   logprobs=[_delta_logprob(l) for l in part.get("logprobs", [])]),
                       self._event("response.content_part.done", **self._where(), content_index=0,
                                   part=copy.deepcopy(part))]
        else:
            events.append(self._event("response.function_call_arguments.done", **self._where(),
                                      arguments=item["arguments"], name=item["name"]))
        item["status"] = status
        events.append(self._event("response.output_item.done", output_index=len(self.items) - 1,
                                  item=copy.deepcopy(item)))
        self._open = None
        return events

    # ---- the engine's outputs -------------------------------------------------------------------------------

    def add(self, out: RequestOutput) -> list[dict]:
        """One engine output of the reply -> the events it makes (collected responses ignore them)."""
        logprobs = [chat_logprob(self.tok, l) for l in out.logprobs or []] if self.req.logprobs else []
        self._logprobs += logprobs
        delta = self.reply.delta(out.text, out.finished)
        mode, events = self.plan.mode, []
        features = token_value(out)
        if self.features is not None and features is not None:  # llamascope's event: one a token, before its text
            self.features.add(features)
            events.append(self._event("response.features.delta", **chunk_features(features)))
        if mode == "none" and (delta or logprobs):
            events += self._text(delta["content"] if delta else "", logprobs)
        elif mode == "named" and delta:
            call = delta["tool_calls"][0]
            if "id" in call:
                events += self._open_call(call["id"], call["function"]["name"])
            events += self._arguments(call["function"]["arguments"])
        if out.finished:
            events += self._finish(out.finish_reason)
        return events

    def _finish(self, reason: str | None) -> list[dict]:
        """Close what streamed; send whole what could only be parsed at the end (`required`, `auto`)."""
        status = "completed" if reason in ("stop", "tool_calls") else "incomplete"
        message = self.reply.message()
        content, calls = message["content"], message.get("tool_calls", [])
        events = []
        if self.plan.mode == "none" or (self.plan.mode != "named" and not calls):
            if self._open is None:  # a reply with no text is still a message
                # logprobs belong to the text only where it is the tokens' own (not a parsed {"response": ...})
                aligned = content == self.reply.text and self.plan.mode != "none"
                events += self._text(content or "", self._logprobs if aligned else [])
            events += self._close(status)
        elif self.plan.mode == "named":
            if self._open is None:  # nothing was generated
                events += self._open_call(calls[0]["id"], calls[0]["function"]["name"])
            events += self._close(status)
        else:
            if content:
                events += self._text(content, []) + self._close(status)
            for call in calls:
                fn = call["function"]
                events += self._open_call(call["id"], fn["name"]) + self._arguments(fn["arguments"])
                events += self._close(status)
        return events

    # ---- the response object --------------------------------------------------------------------------------

    @staticmethod
    def status(reason: str | None, error: str | None = None) -> str:
        if error is not None or reason not in ("stop", "length", "tool_calls"):
            return "failed"
        return "incomplete" if reason == "length" else "completed"

    def response(self, status: str, usage: dict | None = None, error: str | None = None) -> dict:
        """The `Response` object, its fields as the request set them (OpenAI echoes them)."""
        r = self.req
        fmt = {"type": "text"}
        if r.text is not None and r.text.format is not None:
            fmt = r.text.format.model_dump(by_alias=True, exclude_none=True)
        tool_choice = r.tool_choice or "auto"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": self.model,
            "output": copy.deepcopy(self.items) if status != "in_progress" else [],
            "error": {"code": "server_error", "message": error} if error is not None else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "previous_response_id": r.previous_response_id,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "parallel_tool_calls": r.parallel_tool_calls, "text": {"format": fmt},
            "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []], "top_logprobs": r.top_logprobs,
            "truncation": r.truncation, "store": r.store, "metadata": r.metadata or {}, "user": r.user,
            "background": False, "reasoning": None, "usage": usage,
            **({"features": self.features.as_dict()} if self.features is not None else {}),
        }


def _delta_logprob(lp: dict) -> dict:
    """A token's logprob as the text events carry it (openai response_text_delta_event.Logprob: no bytes)."""
    return {"token": lp["token"], "logprob": lp["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in lp["top_logprobs"]]}
