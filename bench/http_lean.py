"""A lean HTTP/1.1 client owned by the benchmark: the HTTP twin of
``bench.rb_side.RawDriver`` (issue 36 row 3), so the lean rollout-bus driver is
compared with an equally lean HTTP reader, never with aiohttp.

What it does per request, and no more: one keep-alive connection from a pool
(an ``asyncio.Protocol``, no stream reader, no per-chunk future), the request
written as one pre-built byte string, the response parsed in place (status
line, Content-Length or chunked framing, SSE events split on a blank line),
and the tokens COUNTED, not decoded: the commas between the brackets of each
``"token_ids":[...]`` plus one, a finish seen as ``"finish_reason":"``. No JSON
is decoded (RawDriver decodes each Chunk's small msgpack header and counts its
token frame's bytes: about the same work). One future per request, as
RawDriver. Not a product API; loopback only.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import urlsplit

from bench import harness as H

TOKEN_IDS = b'"token_ids":'
FINISHED = b'"finish_reason":"'  # a string value; an unfinished event has null
DONE = b"data: [DONE]"


def count_tokens(data: bytes | bytearray) -> int:
    """Token ids in every ``"token_ids":[...]`` of `data`, counted by commas."""
    n = 0
    i = data.find(TOKEN_IDS)
    while i >= 0:
        s = data.find(b"[", i) + 1
        j = data.find(b"]", s)
        if s <= 0 or j < 0:
            raise ValueError("token_ids without its closing bracket")
        if j > s:  # "[]": none
            n += data.count(b",", s, j) + 1
        i = data.find(TOKEN_IDS, j)
    return n


class _Conn(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.t: asyncio.Transport | None = None
        self.buf = bytearray()
        self.fut: asyncio.Future | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.fut is not None and not self.fut.done():
            self.fut.set_exception(ConnectionError(f"connection closed mid-response: {exc}"))

    def start(self, request: bytes, stream: bool, fut: asyncio.Future) -> None:
        self.fut = fut
        self.stream = stream
        self.head = True
        self.status = 0
        self.clen = -1
        self.chunked = False
        self.tokens = 0
        self.first: float | None = None
        self.finished = False
        self.body = bytearray()
        assert self.t is not None
        self.t.write(request)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.fut is None or self.fut.done():
            return
        try:
            self._parse()
        except (ValueError, IndexError) as e:
            self.fut.set_exception(RuntimeError(f"bad HTTP response: {e}"))
            self.closed = True
            assert self.t is not None
            self.t.close()

    def _parse(self) -> None:
        buf = self.buf
        if self.head:
            i = buf.find(b"\r\n\r\n")
            if i < 0:
                return
            head = bytes(buf[:i]).lower()
            self.status = int(head[9:12])
            self.chunked = b"transfer-encoding: chunked" in head
            if not self.chunked:
                k = head.find(b"content-length:")
                self.clen = int(head[k + 15 : head.find(b"\r\n", k) if head.find(b"\r\n", k) > 0 else None])
            del buf[: i + 4]
            self.head = False
        if not self.chunked:
            if len(buf) >= self.clen:
                self._payload(buf[: self.clen])
                del buf[: self.clen]
                self._end()
            return
        while True:
            j = buf.find(b"\r\n")
            if j < 0:
                return
            size = int(bytes(buf[:j]).split(b";", 1)[0], 16)
            if size == 0:
                if len(buf) < j + 4:  # the empty trailer's CRLF
                    return
                del buf[: j + 4]
                self._end()
                return
            if len(buf) < j + 4 + size:
                return
            self._payload(buf[j + 2 : j + 2 + size])
            del buf[: j + 4 + size]

    def _payload(self, data: bytearray) -> None:
        self.body += data
        if not self.stream:
            return
        body = self.body
        while (k := body.find(b"\n\n")) >= 0:
            ev = body[:k]
            del body[: k + 2]
            if ev.startswith(DONE):
                continue
            n = count_tokens(ev)
            if n and self.first is None:
                self.first = time.perf_counter()
            self.tokens += n
            if FINISHED in ev:
                self.finished = True

    def _end(self) -> None:
        fut, self.fut = self.fut, None
        assert fut is not None
        if self.status != 200:
            fut.set_exception(RuntimeError(f"HTTP {self.status}: {bytes(self.body[:200])!r}"))
            return
        if not self.stream:
            self.tokens = count_tokens(self.body)
            self.first = time.perf_counter()
            self.finished = FINISHED in self.body
        fut.set_result((self.tokens, self.first, self.finished))


class LeanHttp:
    """A pool of lean keep-alive connections to one server (see the module doc)."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.host, self.port = u.hostname or H.LOOPBACK, u.port or 80
        self.idle: list[_Conn] = []
        self.all: list[_Conn] = []

    async def _conn(self) -> _Conn:
        while self.idle:
            c = self.idle.pop()
            if not c.closed:
                return c
        loop = asyncio.get_running_loop()
        _, c = await loop.create_connection(_Conn, self.host, self.port)
        self.all.append(c)
        return c

    def request(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
        """The bytes of one POST (built once per load, not per request)."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        return (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n"
        ).encode() + body

    async def send(self, request: bytes, stream: bool) -> tuple[int, float | None, bool]:
        """(tokens counted, perf_counter of the first token, finished)."""
        c = await self._conn()
        fut = asyncio.get_running_loop().create_future()
        c.start(request, stream, fut)
        try:
            res = await fut
        except BaseException:
            c.closed = True  # a half-read response: the connection is not reused
            assert c.t is not None
            c.t.close()
            raise
        self.idle.append(c)
        return res

    async def close(self) -> None:
        for c in self.all:
            if c.t is not None:
                c.t.close()
        self.idle, self.all = [], []


async def lean_load(drv: LeanHttp, spec: Any) -> H.RunResult:
    """`bench.peer_side.http_load`'s shape (an HttpLoad spec), through LeanHttp."""
    import msgspec

    body = msgspec.json.encode(
        {
            "model": "null",
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "stream": spec.stream,
            "return_token_ids": True,
        }
    )
    plain = drv.request("/v1/completions", body)
    by_session = [
        drv.request("/v1/completions", body, {"X-Session-ID": f"traj-{k}"}) for k in range(spec.sessions or 0)
    ]

    async def request(i: int) -> tuple[int, float | None, bool]:
        return await drv.send(by_session[i % spec.sessions] if spec.sessions else plain, spec.stream)

    return await H.run_load(
        spec.n, spec.concurrency, request, expected_tokens=spec.max_tokens, timeout_s=spec.per_request_timeout_s,
        stream=spec.stream,
    )  # fmt: skip
