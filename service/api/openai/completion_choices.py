"""The choices of one /v1/completions response (OpenAI's legacy completions object), streamed chunk by chunk or
collected whole: echo of the prompt, legacy logprobs (the prompt's with the first chunk when echoed), hidden states,
per-token attention telemetry, and the `inspect` summary that follows them. Streamed, it is a
service/api/openai/sse_response.py `StreamedChoices`."""

from __future__ import annotations

import asyncio

from model.engine import RequestOutput
from model.text import Tokenizer
from service.microscope import inspect_format as fmt
from service.api.openai.feature_output import ChoiceFeatures, chunk_features, token_value
from service.api.openai.format import LegacyLogprobs, encode_hidden, merge_hidden, now
from service.api.openai.schemas import CompletionRequest


class CompletionChoices:
    def __init__(self, tok: Tokenizer, prompts: list[list[int]], n: int, req: CompletionRequest, rid: str, model: str,
                 hidden_dtype: str | None, inspection: asyncio.Future | None = None) -> None:
        self.tok, self.prompts, self.n = tok, prompts, n
        self.echo, self.logprobs, self.hidden_dtype = req.echo, req.logprobs, hidden_dtype
        self.rid, self.created, self.model = rid, now(), model
        self.count = len(prompts) * n  # choice index = prompt index * n + choice (OpenAI's order)
        self._started: set[int] = set()  # streamed choices whose first chunk went out
        self._texts: dict[int, str] = {}  # collected: each choice's text so far, its echoed prompt first
        self._lps: dict[int, LegacyLogprobs | None] = {}
        self._hidden: dict[int, list] = {c: [] for c in range(self.count)}
        self._features = ({c: ChoiceFeatures(req.features.sae) for c in range(self.count)}
                          if req.features is not None else None)
        self.inspection = inspection  # the `inspect` extension's summaries, computed meanwhile

    def envelope(self, choices: list[dict], **extra) -> dict:
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, **extra}

    # ---- streamed -------------------------------------------------------------------------------------------

    def head(self) -> list[dict]:
        return []

    async def tail(self) -> dict | None:
        """The inspection's summaries in a chunk of their own, after every choice."""
        return self.envelope([], inspect=await self.inspection) if self.inspection is not None else None

    def close(self) -> None:
        if self.inspection is not None:
            self.inspection.cancel()

    def chunk(self, choice: int, out: RequestOutput) -> dict | None:
        """One output's chunk choice, or None when it carries nothing to send."""
        if choice in self._started:  # a chunk's logprobs are its own tokens' (the prompt's came with the first)
            text, lp = out.text, LegacyLogprobs(self.tok) if self.logprobs is not None else None
        else:
            text, lp = self._echo_text(choice) + out.text, self._echo_logprobs(choice, out)
            self._started.add(choice)
        lp = self._add_logprobs(lp, out)
        telemetry = out.features.get("telemetry")  # the per-row feature's value for this token (model/features/)
        features = token_value(out)
        if (not text and not out.finished and lp is None and out.hidden_states is None and telemetry is None
                and features is None):
            return None
        c = {"index": choice, "text": text, "logprobs": lp.as_dict() if lp else None, "finish_reason": out.finish_reason}
        if self.hidden_dtype is not None:
            c["hidden_states"] = encode_hidden(out.hidden_states, self.hidden_dtype)
        if telemetry is not None:  # every token's chunk is sent, with what produced it
            c["token_id"], c["inspect"] = out.token_ids[0], fmt.token_telemetry(telemetry)
        if features is not None:  # one token a chunk, with its features
            c["features"] = chunk_features(features)
        return c

    # ---- collected ------------------------------------------------------------------------------------------

    def add(self, choice: int, out: RequestOutput) -> None:
        if choice not in self._texts:
            self._texts[choice] = self._echo_text(choice)
        self._texts[choice] += out.text
        if choice not in self._lps:
            self._lps[choice] = self._echo_logprobs(choice, out)
        self._add_logprobs(self._lps[choice], out)
        if out.hidden_states is not None:
            self._hidden[choice].append(out.hidden_states)
        if self._features is not None:
            self._features[choice].add(token_value(out))

    def collected(self, reasons: dict[int, str | None]) -> list[dict]:
        choices = []
        for c in range(self.count):
            lp = self._lps.get(c)
            text = self._texts[c] if c in self._texts else self._echo_text(c)
            choice = {"index": c, "text": text, "logprobs": lp.as_dict() if lp else None,
                      "finish_reason": reasons.get(c)}
            if self.hidden_dtype is not None:
                choice["hidden_states"] = encode_hidden(merge_hidden(self._hidden[c]), self.hidden_dtype)
            if self._features is not None:
                choice["features"] = self._features[c].as_dict()
            choices.append(choice)
        return choices

    # ---- parts ----------------------------------------------------------------------------------------------

    def _echo_text(self, choice: int) -> str:
        return self.tok.decode(self.prompts[choice // self.n]) if self.echo else ""

    def _echo_logprobs(self, choice: int, out: RequestOutput) -> LegacyLogprobs | None:
        if self.logprobs is None:
            return None
        lp = LegacyLogprobs(self.tok)
        if self.echo:
            prompt = self.prompts[choice // self.n]
            for t, pl in zip(prompt, out.prompt_logprobs or [None] * len(prompt)):
                lp.add(t, pl)
        return lp

    @staticmethod
    def _add_logprobs(lp: LegacyLogprobs | None, out: RequestOutput) -> LegacyLogprobs | None:
        if lp is not None:
            for t, l in zip(out.token_ids, out.logprobs or [None] * len(out.token_ids)):
                lp.add(t, l)
        return lp
