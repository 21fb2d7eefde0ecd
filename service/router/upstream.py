"""The front's connections to the models' processes: HTTP/1.1 over asyncio streams, kept alive and reused, the
response body read as it arrives (RFC 9112: a status line, header fields, then a body framed by Content-Length or
chunked transfer coding, 7.1). A streamed answer is one chunk per event, passed on as it is read; no parser beyond
the framing runs per chunk, so routing costs the front little CPU per token (httpx's pure-Python h11 parsing of
each chunk did, in the benchmark benchmarks/router_overhead.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

READ_LIMIT = 1 << 20  # longest header line or chunk-size line accepted


class UpstreamError(ConnectionError):
    """The child closed the connection, or answered something that is not HTTP/1.1."""


class UpstreamResponse:
    def __init__(self, pool: "Upstream", port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 status: int, headers: list[tuple[str, str]]) -> None:
        self.pool, self.port, self.reader, self.writer = pool, port, reader, writer
        self.status, self.headers = status, headers
        fields = {k.lower(): v for k, v in headers}
        self.chunked = "chunked" in fields.get("transfer-encoding", "").lower()
        self.length = int(fields["content-length"]) if "content-length" in fields and not self.chunked else None
        self.reusable = fields.get("connection", "").lower() != "close" and (self.chunked or self.length is not None)
        self.done = False

    def header(self, name: str) -> str:
        return next((v for k, v in self.headers if k.lower() == name), "")

    async def body(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunked: one piece per chunk)."""
        r = self.reader
        try:
            if self.chunked:
                while True:
                    size = int((await r.readline()).split(b";")[0].strip() or b"x", 16)
                    if size == 0:
                        while (await r.readline()) not in (b"\r\n", b"\n", b""):  # trailer fields
                            pass
                        break
                    data = await r.readexactly(size)
                    await r.readexactly(2)
                    yield data
            elif self.length is not None:
                left = self.length
                while left:
                    data = await r.read(min(left, 1 << 16))
                    if not data:
                        raise UpstreamError("the connection closed inside the body")
                    left -= len(data)
                    yield data
            else:
                while data := await r.read(1 << 16):
                    yield data
            self.done = True
        except (asyncio.IncompleteReadError, ValueError) as e:
            raise UpstreamError(f"the answer broke off: {e}") from None

    def close(self) -> None:
        """Back to the pool when the whole body was read, else closed (a half-read answer cannot be reused)."""
        if self.done and self.reusable:
            self.pool.idle.setdefault(self.port, []).append((self.reader, self.writer))
        else:
            self.writer.close()


class Upstream:
    def __init__(self) -> None:
        self.idle: dict[int, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}

    async def request(self, port: int, method: str, target: str, headers: list[tuple[str, str]],
                      body: bytes) -> UpstreamResponse:
        head = [f"{method} {target} HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in headers]
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        while self.idle.get(port):  # a kept-alive connection the child may have closed meanwhile: try the next
            reader, writer = self.idle[port].pop()
            try:
                return await self._exchange(port, reader, writer, data)
            except (UpstreamError, ConnectionError):
                writer.close()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=READ_LIMIT)
        except OSError as e:
            raise UpstreamError(str(e)) from None
        return await self._exchange(port, reader, writer, data)

    async def _exchange(self, port: int, reader, writer, data: bytes) -> UpstreamResponse:
        try:
            writer.write(data)
            await writer.drain()
            status_line = await reader.readline()
            parts = status_line.split(None, 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
                raise UpstreamError(f"no HTTP status line: {status_line[:80]!r}")
            headers = []
            while (line := await reader.readline()) not in (b"\r\n", b"\n"):
                if not line:
                    raise UpstreamError("the connection closed inside the header")
                name, _, value = line.decode("latin-1").partition(":")
                headers.append((name.strip(), value.strip()))
        except (ConnectionError, ValueError, asyncio.LimitOverrunError) as e:
            writer.close()
            raise UpstreamError(str(e)) from None
        return UpstreamResponse(self, port, reader, writer, int(parts[1]), headers)

    def drop(self, port: int) -> None:
        """Close the kept-alive connections to a process that has gone (unloaded, or exited)."""
        for _, writer in self.idle.pop(port, []):
            writer.close()

    def close(self) -> None:
        for conns in self.idle.values():
            for _, writer in conns:
                writer.close()
        self.idle.clear()
