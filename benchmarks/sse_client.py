"""Streamed `/v1/completions` as the HTTP benchmarks read them: two clients, one answer shape.

- `stream_httpx`: httpx's streaming API, what a Python user would write (its HTTP/1.1 parser, h11, is pure Python);
- `stream_raw`: one asyncio socket per request, `Connection: close`, the SSE `data:` lines read as they arrive and
  only their JSON parsed: the least client work per token.

On a 2-core machine the client's CPU time is taken from the servers' cores, and it weighs most on the fastest
server (a fixed cost per token): at 1 stream on the default model, httpx read our tokens 5% and 20% later than the
raw client did in two runs (`benchmarks.http_overhead`). Both return {"marks": arrival time of every chunk carrying
text, "text", "logprobs": each token's logprob as the server printed it (`logprobs=True`), "finish": finish_reason}.
Requests are greedy with `ignore_eos`, prompts as token ids; a response that is not 200 raises.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx


def _body(prompt: list[int], max_tokens: int, logprobs: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True}
    if logprobs:
        body["logprobs"] = 1
    return body


class _Reader:
    """Accumulates the SSE events' choices."""

    def __init__(self) -> None:
        self.marks: list[float] = []
        self.text: list[str] = []
        self.lps: list[float] = []
        self.finish: str | None = None

    def event(self, payload: bytes | str) -> None:
        now = time.perf_counter()
        for choice in json.loads(payload).get("choices", []):
            if choice.get("text"):
                self.marks.append(now)
                self.text.append(choice["text"])
            lp = choice.get("logprobs") or {}
            self.lps += lp.get("token_logprobs") or [c.get("logprob") for c in lp.get("content") or []]
            self.finish = choice.get("finish_reason") or self.finish

    def result(self) -> dict:
        return {"marks": self.marks, "text": "".join(self.text), "logprobs": self.lps, "finish": self.finish}


async def stream_httpx(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                       logprobs: bool = False) -> dict:
    out = _Reader()
    async with client.stream("POST", url + "/v1/completions", json=_body(prompt, max_tokens, logprobs)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.event(line[6:])
    return out.result()


async def stream_raw(url: str, prompt: list[int], max_tokens: int, logprobs: bool = False) -> dict:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(_body(prompt, max_tokens, logprobs)).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (host.encode(), len(body)) + body)
    out = _Reader()
    try:
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"{url}: {status!r}: {(await reader.read(300))!r}")
        # Headers, chunk-size lines and the blank lines between events are skipped: each event is one line (both
        # servers write an event in one chunk).
        while (line := await reader.readline()) not in (b"", b"data: [DONE]\n", b"data: [DONE]\r\n"):
            if line.startswith(b"data: "):
                out.event(line[6:])
    finally:
        writer.close()
    return out.result()


async def stream(client: httpx.AsyncClient | None, url: str, prompt: list[int], max_tokens: int,
                 logprobs: bool = False) -> dict:
    """The raw client where `client` is None, else httpx through `client`."""
    if client is None:
        return await stream_raw(url, prompt, max_tokens, logprobs)
    return await stream_httpx(client, url, prompt, max_tokens, logprobs)
