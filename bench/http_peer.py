"""A minimal OpenAI-compatible HTTP server with NO MODEL (benchmarks only).

It is the HTTP twin of the ``null`` backend: ``POST /v1/completions`` answers
at once with ``max_tokens`` deterministic token ids, token ``i`` being
``(prompt[-1] + 1 + i) % vocab`` (the same series as the null backend), with
``finish_reason: "length"``. With ``"stream": true`` it sends Server-Sent
Events the way vLLM does (one ``data: {json}`` event per token — or per
``--tokens-per-event`` tokens — then ``data: [DONE]``), each event written to
the socket separately, as a real server flushes each decode step.
``/health``, ``/v1/models``, ``/get_model_info``, ``/get_server_info``,
``/metrics`` answer what vllm-router probes. With ``--prefix-cache`` it also
counts what an unbounded prefix cache of 16-id blocks would hit (token-id
prompts) and ``/metrics`` reports it under vLLM's names
(``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``,
``vllm:request_success_total``), so a bench that scrapes vLLM servers can be
dry-run against it (bench/gpu/prefix_vllm_router.py); off by default: it
costs a hash per block per request.

Why a raw asyncio HTTP/1.1 server (keep-alive, Content-Length and chunked
bodies, chunked SSE responses) rather than FastAPI/uvicorn as vLLM uses: it is
the fastest server Python offers here (see `--impl aiohttp` for a comparison),
so the HTTP side is not handicapped by its servers; what we compare is the
routers. Token ids travel as JSON in ``choices[i].token_ids`` (vLLM's
``return_token_ids`` field); ``text`` is empty since there is no tokenizer.

Run: ``python -m bench.http_peer --port 8101`` (binds 127.0.0.1 only).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import sys
import time
from typing import Any

import msgspec

_json_enc = msgspec.json.Encoder()
_json_dec = msgspec.json.Decoder()

_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed", 413: b"Payload Too Large"}
MAX_BODY = 64 << 20
_CONTROL_ROUTES = ("/pause", "/resume", "/sleep", "/wake_up", "/reset_prefix_cache")


class Peer:
    """State shared by every connection of one server process."""

    def __init__(
        self,
        model: str,
        vocab: int,
        tokens_per_event: int,
        port: int,
        log_requests: bool,
        step_delay_s: float = 0.0,
        prefix_cache: bool = False,
    ) -> None:
        self.step_delay_s = step_delay_s
        self.cache: PrefixCounter | None = PrefixCounter() if prefix_cache else None
        self.paused = False
        self.model = model
        self.vocab = vocab
        self.tpe = max(1, tokens_per_event)
        self.port = port
        self.log_requests = log_requests
        self.ids = itertools.count()
        self.requests = 0
        self.started = int(time.time())

    # -------------------------------------------------------------- routes
    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes, w: _Writer) -> None:
        self.requests += 1
        if self.log_requests:
            print(f"{method} {path} {len(body)}B hdr={sorted(headers)}", flush=True)
        path = path.split("?", 1)[0]
        if path == "/v1/completions" and method == "POST":
            return self.completions(body, w)
        if method == "POST" and path in _CONTROL_ROUTES:
            # the per-server control calls an HTTP RL stack fans out (vLLM's
            # /pause, /resume, /sleep, /wake_up, /reset_prefix_cache): no-ops here
            if path in ("/pause", "/resume"):
                self.paused = path == "/pause"
            return w.json(200, {"ok": True, "paused": self.paused})
        if method not in ("GET", "HEAD"):
            return w.json(405, {"error": {"message": f"{method} {path} not allowed"}})
        if path in ("/health", "/ping"):
            return w.raw(200, b"", b"text/plain")
        if path == "/v1/models":
            return w.json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": self.model,
                            "object": "model",
                            "created": self.started,
                            "owned_by": "bench",
                            "max_model_len": 1 << 20,
                        }
                    ],
                },
            )
        if path == "/get_model_info":
            return w.json(200, {"model_path": self.model, "is_generation": True, "tokenizer_path": None})
        if path == "/get_server_info":
            return w.json(200, {"model_path": self.model, "port": self.port, "max_total_num_tokens": 1 << 20})
        if path == "/metrics":
            text = f"bench_http_peer_requests_total {self.requests}\n"
            if self.cache is not None:
                text += self.cache.metrics()
            return w.raw(200, text.encode(), b"text/plain")
        if path == "/version":
            return w.json(200, {"version": "bench-http-peer"})
        return w.json(404, {"error": {"message": f"no route {path}"}})

    def completions(self, body: bytes, w: _Writer) -> None:
        try:
            req = _json_dec.decode(body)
            prompt = req.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                prompt = prompt[0]
            if isinstance(prompt, str):
                last = len(prompt)
                n_prompt = len(prompt.split())
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                last = prompt[-1]
                n_prompt = len(prompt)
                if self.cache is not None:
                    self.cache.add(prompt)
            else:
                raise ValueError("prompt must be a non-empty list of token ids or a string")
            max_tokens = int(req.get("max_tokens") or 16)
            if max_tokens < 1:
                raise ValueError("max_tokens must be >= 1")
            n = int(req.get("n") or 1)
            stream = bool(req.get("stream", False))
            want_lp = req.get("logprobs") is not None
        except Exception as e:
            return w.json(400, {"error": {"message": str(e), "type": "BadRequestError", "code": 400}})

        rid = f"cmpl-{self.port}-{next(self.ids)}"
        created = int(time.time())
        vocab = self.vocab
        toks = [(last + 1 + i) % vocab for i in range(max_tokens)]
        if not stream:
            choices = [
                {
                    "index": k,
                    "text": "",
                    "token_ids": toks,
                    "logprobs": {"token_logprobs": [0.0] * max_tokens} if want_lp else None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
                for k in range(n)
            ]
            return w.json(
                200,
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.model,
                    "choices": choices,
                    "usage": {
                        "prompt_tokens": n_prompt,
                        "completion_tokens": max_tokens * n,
                        "total_tokens": n_prompt + max_tokens * n,
                    },
                },
            )
        w.start_sse()
        tpe = self.tpe

        def event(k: int, i: int) -> bytes:
            part = toks[i : i + tpe]
            return _json_enc.encode(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.model,
                    "choices": [
                        {
                            "index": k,
                            "text": "",
                            "token_ids": part,
                            "logprobs": {"token_logprobs": [0.0] * len(part)} if want_lp else None,
                            "finish_reason": "length" if i + tpe >= max_tokens else None,
                            "stop_reason": None,
                        }
                    ],
                    # bench-only field: server wall clock when the event was written
                    "emitted_at": time.time(),
                }
            )

        if self.step_delay_s > 0:
            asyncio.get_running_loop().create_task(self._paced(w, n, max_tokens, event, req, rid, created, n_prompt))
            return
        for k in range(n):
            for i in range(0, max_tokens, tpe):
                w.sse(event(k, i))
        self._finish_sse(w, req, rid, created, n_prompt, max_tokens, n)

    async def _paced(
        self, w: _Writer, n: int, max_tokens: int, event: Any, req: dict, rid: str, created: int, n_prompt: int
    ) -> None:
        """--step-delay-ms: one event per decode step, like an engine with that step time."""
        for i in range(0, max_tokens, self.tpe):
            await asyncio.sleep(self.step_delay_s)
            if w.t.is_closing():
                return
            for k in range(n):
                w.sse(event(k, i))
        self._finish_sse(w, req, rid, created, n_prompt, max_tokens, n)

    def _finish_sse(
        self, w: _Writer, req: dict, rid: str, created: int, n_prompt: int, max_tokens: int, n: int
    ) -> None:
        so = req.get("stream_options") or {}
        if so.get("include_usage"):
            w.sse(
                _json_enc.encode(
                    {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": self.model,
                        "choices": [],
                        "usage": {
                            "prompt_tokens": n_prompt,
                            "completion_tokens": max_tokens * n,
                            "total_tokens": n_prompt + max_tokens * n,
                        },
                    }
                )
            )
        w.sse(b"[DONE]")
        w.end_chunked()


class PrefixCounter:
    """What an unbounded prefix cache of BLOCK-id blocks would hit: a prompt's
    full blocks are looked up in order (block i's key covers blocks 0..i) and
    count as hits until the first miss, as vLLM's prefix cache counts them."""

    BLOCK = 16  # ids per block (vLLM's default block size)

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.queries = self.hits = self.requests = 0

    def add(self, prompt: list[int]) -> None:
        self.requests += 1
        self.queries += len(prompt)
        key = 0
        matched = True
        for i in range(0, len(prompt) - self.BLOCK + 1, self.BLOCK):
            key = hash((key, tuple(prompt[i : i + self.BLOCK])))
            if matched and key in self.seen:
                self.hits += self.BLOCK
            else:
                matched = False
                self.seen.add(key)

    def metrics(self) -> str:
        return (
            f"vllm:prefix_cache_queries_total {self.queries}\n"
            f"vllm:prefix_cache_hits_total {self.hits}\n"
            f"vllm:request_success_total {self.requests}\n"
        )


class _Writer:
    __slots__ = ("t", "keep_alive", "head_only")

    def __init__(self, transport: asyncio.Transport, keep_alive: bool, head_only: bool) -> None:
        self.t = transport
        self.keep_alive = keep_alive
        self.head_only = head_only

    def _conn_hdr(self) -> bytes:
        return b"keep-alive" if self.keep_alive else b"close"

    def raw(self, status: int, body: bytes, ctype: bytes) -> None:
        head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: %s\r\n\r\n" % (
            status,
            _REASONS.get(status, b"X"),
            ctype,
            len(body),
            self._conn_hdr(),
        )
        self.t.write(head if self.head_only else head + body)
        if not self.keep_alive:
            self.t.close()

    def json(self, status: int, obj: Any) -> None:
        self.raw(status, _json_enc.encode(obj), b"application/json")

    def start_sse(self) -> None:
        self.t.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\nconnection: %s\r\n\r\n" % self._conn_hdr()
        )

    def sse(self, data: bytes) -> None:
        payload = b"data: " + data + b"\n\n"
        self.t.write(b"%x\r\n%s\r\n" % (len(payload), payload))

    def end_chunked(self) -> None:
        self.t.write(b"0\r\n\r\n")
        if not self.keep_alive:
            self.t.close()


class _Conn(asyncio.Protocol):
    """HTTP/1.1: keep-alive, pipelining, Content-Length or chunked request bodies."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.buf = bytearray()
        self.t: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            import socket as _s

            try:
                sock.setsockopt(_s.IPPROTO_TCP, _s.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.t is not None and not self.t.is_closing():
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > 65536:
                    self._bad(413, "header too large")
                return
            head = bytes(self.buf[:end]).decode("latin-1")
            lines = head.split("\r\n")
            try:
                method, target, version = lines[0].split(" ", 2)
            except ValueError:
                return self._bad(400, "bad request line")
            headers: dict[str, str] = {}
            for ln in lines[1:]:
                k, _, v = ln.partition(":")
                headers[k.strip().lower()] = v.strip()
            pos = end + 4
            if headers.get("transfer-encoding", "").lower() == "chunked":
                body_parts = []
                while True:
                    nl = self.buf.find(b"\r\n", pos)
                    if nl < 0:
                        return  # wait for more
                    try:
                        size = int(bytes(self.buf[pos:nl]).split(b";")[0], 16)
                    except ValueError:
                        return self._bad(400, "bad chunk size")
                    if len(self.buf) < nl + 2 + size + 2:
                        return
                    if size == 0:
                        # trailers not supported: expect the final CRLF
                        pos = nl + 4
                        break
                    body_parts.append(bytes(self.buf[nl + 2 : nl + 2 + size]))
                    pos = nl + 2 + size + 2
                body = b"".join(body_parts)
            else:
                cl = int(headers.get("content-length", "0") or 0)
                if cl > MAX_BODY:
                    return self._bad(413, "body too large")
                if len(self.buf) < pos + cl:
                    return
                body = bytes(self.buf[pos : pos + cl])
                pos += cl
            del self.buf[:pos]
            conn = headers.get("connection", "").lower()
            keep = (conn != "close") if version == "HTTP/1.1" else (conn == "keep-alive")
            w = _Writer(self.t, keep, method == "HEAD")
            self.peer.handle(method, target, headers, body, w)

    def _bad(self, status: int, msg: str) -> None:
        if self.t is not None:
            _Writer(self.t, False, False).json(status, {"error": {"message": msg}})

    def connection_lost(self, exc: Exception | None) -> None:
        self.t = None


async def serve_raw(peer: Peer, host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Conn(peer), host, port, backlog=4096, reuse_address=True)
    print(f"http_peer (raw asyncio) listening on http://{host}:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


async def serve_aiohttp(peer: Peer, host: str, port: int) -> None:
    """The same routes on aiohttp.web (for comparing server implementations)."""
    from aiohttp import web

    class _AioWriter:
        def __init__(self) -> None:
            self.resp: web.StreamResponse | None = None
            self.chunks: list[bytes] = []
            self.status = 200
            self.body = b""
            self.ctype = "application/json"

        def raw(self, status: int, body: bytes, ctype: bytes) -> None:
            self.status, self.body, self.ctype = status, body, ctype.decode()

        def json(self, status: int, obj: Any) -> None:
            self.raw(status, _json_enc.encode(obj), b"application/json")

        def start_sse(self) -> None:
            self.ctype = "sse"

        def sse(self, data: bytes) -> None:
            self.chunks.append(b"data: " + data + b"\n\n")

        def end_chunked(self) -> None:
            pass

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        w = _AioWriter()
        peer.handle(request.method, request.path_qs, dict(request.headers), body, w)  # type: ignore[arg-type]
        if w.ctype == "sse":
            resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
            await resp.prepare(request)
            for c in w.chunks:
                await resp.write(c)
            await resp.write_eof()
            return resp
        return web.Response(status=w.status, body=w.body, content_type=w.ctype.split(";")[0])

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    print(f"http_peer (aiohttp) listening on http://{host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1", choices=["127.0.0.1", "localhost"], help="loopback only")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="null")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens-per-event", type=int, default=1, help="tokens per SSE event when streaming")
    ap.add_argument("--impl", choices=["raw", "aiohttp"], default="raw")
    ap.add_argument(
        "--step-delay-ms",
        type=float,
        default=0.0,
        help="streaming: wait this long before each event (an engine's decode step time)",
    )
    ap.add_argument("--log-requests", action="store_true")
    ap.add_argument(
        "--prefix-cache",
        action="store_true",
        help="count an unbounded prefix cache's hits; /metrics reports them under vLLM's names",
    )
    a = ap.parse_args(argv)
    try:
        import setproctitle

        setproctitle.setproctitle(f"bench.http_peer:{a.port}")
    except Exception:
        pass
    peer = Peer(a.model, a.vocab, a.tokens_per_event, a.port, a.log_requests, a.step_delay_ms / 1e3, a.prefix_cache)
    fn = serve_raw if a.impl == "raw" else serve_aiohttp
    asyncio.run(fn(peer, a.host, a.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
