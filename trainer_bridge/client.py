"""The trainer's client: generation, streaming, Tinker-style sampling and the
RL control plane (pause/resume, weights, sleep, LoRA), over one DEALER socket.

`AsyncClient` is the implementation; its socket belongs to the asyncio loop
that first used it. It is a plain zmq socket drained from `loop.add_reader`
(no future per message) — zmq's FD is edge-triggered, so every send also
schedules a drain. Each request has one deadline timer, not one per chunk. `Client` is the synchronous face: it runs an AsyncClient
on a private loop thread, so it is safe to call from any thread.

Every wait has a deadline; a timeout names the knob (`timeout_s`,
`control_timeout_s`). Errors are typed and carry the request id.

Head liveness: while its socket is open the client pings the head every
`ping_interval_s` (idle too; the pings also renew its lease on the pauses,
sleep and weight update it holds, router_node/leases.py). Nothing from the head
for `head_timeout_s`, or no head reached within `connect_timeout_s` of a
request, ends every open request with `HeadUnavailable` naming the address;
the socket is then replaced (so no queued request reaches a later head) and
the client keeps pinging: once the head is back, new requests work.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import msgspec
import numpy as np
import zmq

from bus import protocol as P
from bus.auth import KeyDir, find_token
from bus.codec import Codec, split_packed
from bus.endpoint import open_socket
from bus.errors import (
    AuthRefused,
    BadRequest,
    ClosedByUs,
    ControlError,
    HeadUnavailable,
    ProtocolError,
    RequestTimeout,
    RolloutBusError,
    exception_from_wire,
)
from bus.frames import decode as decode_frames
from bus.frames import pack_tokens, token_versions, unpack_logprobs
from trainer_bridge.types import GenerationResult, SampledSequence, SampleOutput, SampleResponse, StreamChunk

_END = object()
_TIMED_OUT = object()
_GRACE_S = 2.0  # the servers' own deadline errors should reach us before ours fires


def _params(params: P.SamplingParams | dict[str, Any] | None, **overrides: Any) -> P.SamplingParams:
    if params is None:
        params = P.SamplingParams()
    elif isinstance(params, dict):
        unknown = set(params) - set(P.SamplingParams.__struct_fields__)
        if unknown:
            raise BadRequest(f"unknown sampling parameter(s) {sorted(unknown)}", field="params")
        params = P.SamplingParams(**params)
    if overrides:
        params = msgspec.structs.replace(params, **overrides)
    return params


def _is_batch(prompt: Any) -> bool:
    if isinstance(prompt, np.ndarray):
        return prompt.ndim == 2
    return bool(prompt) and isinstance(prompt[0], (list, tuple, np.ndarray))


class AsyncClient:
    def __init__(
        self,
        address: str = "tcp://127.0.0.1:5555",
        *,
        timeout_s: float = 600.0,
        control_timeout_s: float = 120.0,
        curve_dir: str | None = None,
        client_key: str | None = None,
        tokenizer: Any = None,
        token_file: str | None = None,
        head_timeout_s: float = 2.0,
        connect_timeout_s: float = 3.0,
        ping_interval_s: float = 0.5,
    ) -> None:
        """`head_timeout_s`: nothing heard from a connected head for this long
        ends every open request with HeadUnavailable; `connect_timeout_s`: a
        request that reached no head within this long does too;
        `ping_interval_s`: how often the client pings the head (its lease).
        `curve_dir`: the cluster's key folder (security on: its head.key is
        the server key); `client_key`: this client's key, a name in
        curve_dir/clients/ (default "default") or the path of a .key_secret
        file - its public key must be on the head's allow-list (README,
        "Security"). `tokenizer`: a Hugging Face tokenizer or a local model
        folder; without one, text/chat prompts load the tokenizer of the
        engines' model folder. `token_file`: the cluster's join token, needed
        by control ops that change the cluster (pause, updates, sleep, LoRA);
        None: $ROLLOUT_BUS_TOKEN_FILE, else the file launch.py published for
        `address` on this host (bus.auth.token_path_for); "": none."""
        self.address = address
        self._tokenizer_spec = tokenizer
        self._text: Any = None  # trainer_bridge.text.Text, loaded on first use
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self._curve = KeyDir(curve_dir).client(client_key) if curve_dir else None
        found = find_token(address, token_file)
        self._token = found[0] if found else ""
        self.token_file: str | None = found[1] if found else None  # where the join token came from
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        # Security on: a monitor of the DEALER reports a refused handshake (our
        # key is not on the allow-list); libzmq does not retry after it, so
        # every waiter fails at once with AuthRefused instead of timing out.
        self._monitor: zmq.Socket | None = None
        self._refused: AuthRefused | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._codec = Codec()
        self._drain_scheduled = False
        self._streams: dict[str, asyncio.Queue] = {}
        self._replies: dict[str, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._prefix = os.urandom(4).hex()
        self._closed = False
        # Head liveness (the loop's own state, see the module doc): when a frame
        # last came from the head, whether it answered since the socket opened,
        # and since when each open request waits (connect_timeout_s).
        self.head_timeout_s = head_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.ping_interval_s = ping_interval_s
        self._last_rx = 0.0
        self._head_up = False
        self._head_incarnation = ""  # the HeadPong's; a change: the head restarted
        self._since: dict[str, float] = {}
        self._watch: asyncio.TimerHandle | None = None
        self._watch_at = 0.0

    # ------------------------------------------------------------ plumbing

    def _new_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def _socket(self) -> zmq.Socket:
        if self._closed:
            raise ClosedByUs("the client was closed")
        if self._sock is None:
            self._loop = asyncio.get_running_loop()
            self._ctx = zmq.Context()
            self._open()
            # The first ping goes one interval later: the first frame the head
            # sees is the caller's (a scripted peer may read exactly one).
            self._watch_at = time.monotonic()
            self._watch = self._loop.call_later(self.ping_interval_s, self._watchdog)
        if self._refused is not None:
            raise self._refused
        assert self._sock is not None
        return self._sock

    def _open(self) -> None:
        assert self._loop is not None and self._ctx is not None
        self._sock = open_socket(self._ctx, zmq.DEALER, connect=self.address, curve=self._curve)
        self._head_up = False
        self._loop.add_reader(self._sock.fileno(), self._drain)
        # Handshake refusals fail every wait at once, naming the fix, instead
        # of a timeout much later: a key the head does not allow (AUTH), or
        # a security mismatch (PROTOCOL: no keys against a CURVE head, or
        # keys against a plain one).
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        )
        self._loop.add_reader(self._monitor.fileno(), self._on_monitor)
        # zmq's FD only signals once its mailbox was drained: drain now
        # so the refusal's event makes it readable.
        self._loop.call_soon(self._on_monitor)

    def _close_socket(self) -> None:
        loop = self._loop
        if self._sock is not None and loop is not None and not loop.is_closed():
            with contextlib.suppress(Exception):
                loop.remove_reader(self._sock.fileno())
        if self._monitor is not None and loop is not None and not loop.is_closed():
            with contextlib.suppress(Exception):
                loop.remove_reader(self._monitor.fileno())
        if self._sock is not None:
            if self._monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.disable_monitor()
                self._monitor.close(linger=0)
                self._monitor = None
            self._sock.close(linger=0)
            self._sock = None

    # ------------------------------------------------------------ head liveness

    def _watchdog(self) -> None:
        """Every ping_interval_s on the loop: judge the head, then ping it."""
        if self._closed or self._sock is None or self._loop is None:
            return
        now = time.monotonic()
        lag = now - self._watch_at - self.ping_interval_s
        self._watch_at = now
        self._drain()  # what arrived is heard before the head is judged
        if lag > self.head_timeout_s / 2:
            # Our own loop was stalled (a stopped process, a blocked loop): the
            # head's silence is ours; it gets a fresh head_timeout_s.
            self._last_rx = max(self._last_rx, now)
        if self._head_up and now - self._last_rx > self.head_timeout_s:
            self._head_lost(
                f"nothing came from the head at {self.address} for {now - self._last_rx:.1f}s "
                f"(head_timeout_s={self.head_timeout_s}): it died, froze or is restarting",
                "head_timeout_s",
            )
        elif not self._head_up and any(now - t > self.connect_timeout_s for t in self._since.values()):
            self._head_lost(
                f"no head answered at {self.address} within connect_timeout_s={self.connect_timeout_s}",
                "connect_timeout_s",
            )
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send_multipart(self._codec.encode(P.ClientPing()), zmq.NOBLOCK)
        self._watch = self._loop.call_later(self.ping_interval_s, self._watchdog)

    def _head_lost(self, message: str, knob: str) -> None:
        """End every open request with HeadUnavailable and replace the socket:
        what it still queues must not reach a head that comes back later."""
        for rid, q in self._streams.items():
            q.put_nowait((HeadUnavailable(message, address=self.address, request_id=rid, field=knob), None, None))
        for rid, f in self._replies.items():
            if not f.done():
                f.set_exception(HeadUnavailable(message, address=self.address, request_id=rid, field=knob))
        self._since.clear()
        self._close_socket()
        self._open()

    def _on_monitor(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor is not None:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                err = AuthRefused(
                    f"the head at {self.address} is a secured (CURVE) cluster and this client has no keys: "
                    "pass curve_dir= (a copy of the head's key folder) and client_key= - the launcher prints "
                    "the exact Client(...) line (README, Security)"
                    if self._curve is None
                    else f"the handshake with the head at {self.address} failed (ZMTP error {event['value']:#x}): "
                    "this client uses CURVE keys; is the head started with --curve?",
                    field="curve_dir",
                )
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH and self._curve is not None:
                key = self._curve.public.decode("ascii")
                err = AuthRefused(
                    f"the head at {self.address} refused this client's CURVE key {key} (ZAP status "
                    f"{event['value']}): it is not on the head's clients allow-list - add it with "
                    "`python launch.py keys add-client NAME --public FILE` (README, Security)",
                    field="client_key",
                )
            else:
                continue
            self._refused = err
            for q in self._streams.values():
                q.put_nowait((err, None, None))
            for f in self._replies.values():
                if not f.done():
                    f.set_exception(err)

    def _drain(self) -> None:
        """Read every message that is ready and hand it to its waiter."""
        self._drain_scheduled = False
        sock = self._sock
        if sock is None:
            return
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._last_rx = time.monotonic()  # any frame: the head is alive
            self._head_up = True
            try:
                msg, buffers = self._codec.decode(frames)
                if isinstance(msg, (P.Chunk, P.ChunkBatch)):
                    # Tokens decoded here, once per batch (split_packed);
                    # logprob frames stay zmq Frames (buffer protocol) until
                    # the stream reads them, and are not touched otherwise.
                    parts = split_packed(msg, buffers)
            except Exception:
                continue  # a garbled reply cannot be routed to anyone
            if isinstance(msg, (P.Chunk, P.ChunkBatch)):
                streams = self._streams
                for item in parts:
                    q = streams.get(item[0].request_id)
                    if q is not None:
                        q.put_nowait(item)
                continue
            if isinstance(msg, P.HeadPong):
                old, self._head_incarnation = self._head_incarnation, msg.incarnation or self._head_incarnation
                if old and msg.incarnation and msg.incarnation != old:
                    # A head restarted within head_timeout_s (the supervisor is
                    # quick): the requests open on the old one will never end.
                    self._head_lost(
                        f"the head at {self.address} restarted (incarnation {old} -> {msg.incarnation}): "
                        "requests open on the old head are lost",
                        "incarnation",
                    )
                    return  # _head_lost replaced the socket this loop reads
                continue
            rid = msg.request_id
            q = self._streams.get(rid)
            if q is not None:
                q.put_nowait((msg, None, None))
                continue
            fut = self._replies.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _send(self, msg: Any, buffers: Sequence[Any] = ()) -> None:
        self._socket().send_multipart(self._codec.encode(msg, buffers))
        # Edge-triggered FD: a send can swallow the readable edge of replies
        # that already arrived, so look once more on the next loop turn.
        if not self._drain_scheduled:
            self._drain_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._drain)

    async def _request(self, msg: Any, timeout_s: float, knob: str) -> Any:
        fut = asyncio.get_running_loop().create_future()
        self._replies[msg.request_id] = fut
        self._since[msg.request_id] = time.monotonic()
        self._send(msg)
        try:
            reply = await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise RequestTimeout(
                f"no reply from the head at {self.address} within {knob}={timeout_s}",
                request_id=msg.request_id,
                field=knob,
            ) from None
        finally:
            self._replies.pop(msg.request_id, None)
            self._since.pop(msg.request_id, None)
        if isinstance(reply, P.Error):
            raise exception_from_wire(reply.code, reply.message, reply.request_id, reply.field)
        return reply

    async def close(self) -> None:
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
        for q in self._streams.values():
            q.put_nowait((_END, None, None))
        for f in self._replies.values():
            if not f.done():
                f.set_exception(ClosedByUs("the client was closed while waiting"))
        self._close_socket()
        if self._ctx is not None:
            self._ctx.term()

    # ------------------------------------------------------------ generation

    async def stream(
        self,
        prompt_ids: Sequence[int],
        params: P.SamplingParams | dict[str, Any] | None = None,
        *,
        num_samples: int = 1,
        session_id: str | None = None,
        lora: str | None = None,
        timeout_s: float | None = None,
        request_id: str | None = None,
        max_staleness: int | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """Chunks as the engine produces them (per step, per sample). Ends
        after every sample's final chunk; raises a typed error instead.
        `max_staleness=k`: a sample whose oldest token falls more than k weight
        versions behind is regenerated; a chunk whose `restarts` grew says
        "discard this sample's earlier tokens"."""
        async for ch, _ in self._chunks(
            prompt_ids,
            params,
            num_samples=num_samples,
            session_id=session_id,
            lora=lora,
            timeout_s=timeout_s,
            request_id=request_id,
            max_staleness=max_staleness,
        ):
            yield ch

    async def _chunks(
        self,
        prompt_ids: Sequence[int],
        params: Any,
        *,
        num_samples: int = 1,
        session_id: str | None = None,
        lora: str | None = None,
        timeout_s: float | None = None,
        request_id: str | None = None,
        max_staleness: int | None = None,
        _stream: bool = True,
    ) -> AsyncIterator[tuple[StreamChunk, list[list[int]]]]:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            # Checked here, not only at the head: with 0 samples to wait for the
            # loop below would return an empty result without a word.
            raise BadRequest(f"num_samples must be an int >= 1, got {num_samples!r}", field="num_samples")
        rid = request_id or self._new_id()
        timeout = timeout_s or self.timeout_s
        sp = _params(params)
        msg = P.Generate(
            request_id=rid,
            params=sp,
            num_samples=num_samples,
            session_id=session_id,
            lora=lora,
            stream=_stream,
            timeout_s=timeout,
            max_staleness=max_staleness,
        )
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = q
        self._since[rid] = time.monotonic()
        timer = asyncio.get_running_loop().call_later(timeout + _GRACE_S, q.put_nowait, (_TIMED_OUT, None, None))
        open_samples = num_samples
        sent = False
        try:
            self._send(msg, [pack_tokens(prompt_ids)])
            sent = True
            while open_samples:
                item, toks, rest = await q.get()
                if type(item) is not P.Chunk:
                    open_samples = 0  # a final answer (error, timeout, close): nothing left to cancel
                    if item is _TIMED_OUT:
                        self._send(P.Cancel(request_id=rid))
                        raise RequestTimeout(
                            f"request did not finish within timeout_s={timeout}", request_id=rid, field="timeout_s"
                        )
                    if item is _END:
                        raise ClosedByUs("the client was closed while streaming", request_id=rid)
                    if isinstance(item, RolloutBusError):
                        raise item
                    if isinstance(item, P.Error):
                        raise exception_from_wire(item.code, item.message, rid, item.field)
                    raise ProtocolError(f"unexpected {type(item).__name__} for a generate request", request_id=rid)
                if item.finish_reason is not None:
                    open_samples -= 1
                if item.top_logprobs or item.prompt_logprobs >= 0:
                    yield self._rich_chunk(rid, item, toks, rest), item.version_changes
                    continue
                # The common chunk (tokens, maybe their logprobs): no Decoded,
                # positional fields (StreamChunk's order), defaults for the rest.
                yield (
                    StreamChunk(
                        rid,
                        item.sample_index,
                        toks,
                        unpack_logprobs(rest[0]) if rest else None,
                        item.weight_version,
                        item.finish_reason,
                        item.emitted_at,
                        time.time(),
                        item.engine_id,
                        item.num_prompt_tokens,
                        stop_str=item.stop_reason,
                        text=item.text,
                        restarts=item.restarts,
                    ),
                    item.version_changes,
                )
        finally:
            timer.cancel()
            self._streams.pop(rid, None)
            # The awaiting task was cancelled (asyncio.CancelledError at the
            # wait) or the stream's consumer stopped early (GeneratorExit at
            # the yield): the request is still running on its engine, so ask
            # for its end, else it generates on to max_tokens for nobody.
            # Best effort: a closed socket has nothing left to cancel.
            if sent and open_samples and not self._closed:
                with contextlib.suppress(Exception):
                    self._send(P.Cancel(request_id=rid))
            self._since.pop(rid, None)

    @staticmethod
    def _rich_chunk(rid: str, item: P.Chunk, toks: list[int], rest: list[Any]) -> StreamChunk:
        """A chunk with top-k or prompt logprobs: the full frame layout."""
        dec = decode_frames(item, [b"", *rest], token_ids=toks)
        return StreamChunk(
            request_id=rid,
            sample_index=item.sample_index,
            token_ids=toks,
            logprobs=dec.logprobs,
            weight_version=item.weight_version,
            finish_reason=item.finish_reason,
            emitted_at=item.emitted_at,
            received_at=time.time(),
            engine_id=item.engine_id,
            num_prompt_tokens=item.num_prompt_tokens,
            top_ids=dec.top_ids,
            top_logprobs=dec.top_logprobs,
            prompt=dec.prompt,
            stop_str=item.stop_reason,
            text=item.text,
            restarts=item.restarts,
        )

    async def _collect(self, prompt_ids: Sequence[int], params: Any, num_samples: int, **kw: Any) -> GenerationResult:
        samples: dict[int, SampleOutput] = {}
        n_prompt = 0
        rid = kw.pop("request_id", None) or self._new_id()
        async for ch, changes in self._chunks(
            prompt_ids, params, num_samples=num_samples, request_id=rid, _stream=False, **kw
        ):
            s = samples.get(ch.sample_index)
            if s is None:
                s = samples[ch.sample_index] = SampleOutput(
                    ch.sample_index, [], [] if ch.logprobs is not None else None, "", []
                )
            if ch.restarts > s.restarts:  # the staleness bound regenerated it: keep the new attempt only
                s.restarts = ch.restarts
                s.token_ids.clear()
                s.token_versions.clear()
                if s.logprobs is not None:
                    s.logprobs.clear()
                s.top_ids = s.top_logprobs = None
            s.token_ids.extend(ch.token_ids)
            if ch.logprobs is not None and s.logprobs is not None:
                s.logprobs.extend(ch.logprobs)
            if ch.top_ids is not None:
                s.top_ids = (s.top_ids or []) + ch.top_ids
                s.top_logprobs = (s.top_logprobs or []) + (ch.top_logprobs or [])
            s.token_versions.extend(token_versions(ch.weight_version, changes, len(ch.token_ids)))
            if ch.finish_reason is not None:
                s.finish_reason = ch.finish_reason
                s.engine_id = ch.engine_id
                s.stop_str = ch.stop_str
                if ch.text is not None:
                    s.text = ch.text  # the engine's text (stop strings: truncated as vLLM does)
                if ch.prompt is not None:
                    s.prompt_logprobs = ch.prompt.logprobs
                    s.prompt_top_ids, s.prompt_top_logprobs = ch.prompt.top_ids, ch.prompt.top_logprobs
                n_prompt = ch.num_prompt_tokens
        return GenerationResult(
            request_id=rid, samples=[samples[i] for i in sorted(samples)], num_prompt_tokens=n_prompt
        )

    async def generate(
        self,
        prompt_ids: Sequence[int] | Sequence[Sequence[int]],
        params: P.SamplingParams | dict[str, Any] | None = None,
        *,
        num_samples: int = 1,
        session_id: str | None = None,
        lora: str | None = None,
        timeout_s: float | None = None,
        max_staleness: int | None = None,
    ) -> GenerationResult | list[GenerationResult]:
        """One prompt → a GenerationResult; a batch → a list in input order.
        A prompt is token ids, a string or a chat (a list of messages: the
        model's chat template); with a tokenizer, samples carry `text`.
        `max_staleness=k`: every sample's tokens come from at most k weight
        versions before the current one when it finished (regenerated
        otherwise; SampleOutput.restarts counts it)."""
        kw = dict(
            num_samples=num_samples,
            session_id=session_id,
            lora=lora,
            timeout_s=timeout_s,
            max_staleness=max_staleness,
        )
        text = await self._text_for(prompt_ids)
        if text is not None:
            from trainer_bridge.text import attach_text, to_ids

            prompt_ids = to_ids(text, prompt_ids)
        if _is_batch(prompt_ids):
            out: Any = list(await asyncio.gather(*(self._collect(p, params, **kw) for p in prompt_ids)))  # type: ignore[arg-type]
        else:
            out = await self._collect(prompt_ids, params, **kw)  # type: ignore[arg-type]
        if text is None:
            return out
        sp = _params(params)
        return attach_text(
            out,
            text,
            skip_special_tokens=sp.skip_special_tokens,
            include_stop_str_in_output=sp.include_stop_str_in_output,
        )

    async def sample(
        self,
        prompt_ids: Sequence[int],
        num_samples: int,
        params: P.SamplingParams | dict[str, Any] | None = None,
        *,
        lora: str | None = None,
        timeout_s: float | None = None,
        max_staleness: int | None = None,
    ) -> SampleResponse:
        """Tinker semantics: num_samples sequences, each with tokens, logprobs
        and stop_reason "stop" or "length" (all samples share one engine)."""
        sp = _params(params, logprobs=True)
        res = await self._collect(
            prompt_ids, sp, num_samples, lora=lora, timeout_s=timeout_s, max_staleness=max_staleness
        )
        seqs = []
        for s in res.samples:
            if s.finish_reason not in ("stop", "length"):
                raise ProtocolError(f"sample {s.index} ended with {s.finish_reason!r}", request_id=res.request_id)
            seqs.append(SampledSequence(tokens=s.token_ids, logprobs=s.logprobs, stop_reason=s.finish_reason))
        return SampleResponse(sequences=seqs)

    # ------------------------------------------------------------ text

    async def text(self) -> Any:
        """The client's `trainer_bridge.text.Text` (tokenizer + chat template):
        the one given to the constructor, else the engines' model folder's."""
        if self._text is None:
            from trainer_bridge.text import load_text

            spec = self._tokenizer_spec
            if spec is None:
                models = [e.model for e in await self.engine_views() if os.path.isdir(e.model)]
                if not models:
                    raise BadRequest("no tokenizer given and no engine serves a local model folder", field="tokenizer")
                spec = models[0]
            self._text = load_text(spec)
        return self._text

    async def _text_for(self, prompt: Any) -> Any:
        from trainer_bridge.text import is_text_prompt

        if self._tokenizer_spec is None and self._text is None and not is_text_prompt(prompt):
            return None  # token-only traffic pays nothing
        return await self.text()

    async def tokenize(self, prompt: Any, *, add_special_tokens: bool = True) -> list[int]:
        """Text → ids (`add_special_tokens` as the tokenizer's), or a chat → its template's ids."""
        t = await self.text()
        return (
            t.encode(prompt, add_special_tokens=add_special_tokens) if isinstance(prompt, str) else t.prompt_ids(prompt)
        )

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return (await self.text()).decode(token_ids, skip_special_tokens=skip_special_tokens)

    async def cancel(self, request_id: str) -> None:
        """Ask for the request's end: its stream finishes with "cancelled"."""
        self._send(P.Cancel(request_id=request_id))

    async def end_session(self, session_id: str) -> bool:
        rep: P.QueryReply = await self._request(
            P.EndSession(request_id=self._new_id(), session_id=session_id), self.control_timeout_s, "control_timeout_s"
        )
        return _body(rep, P.SessionEnded).ended

    # ------------------------------------------------------------ queries

    async def _query(self, what: str, cls: type[_B], timeout_s: float | None = None) -> _B:
        """The head's typed answer to `what` (bus/views.py: P.QUERY_BODIES)."""
        t = timeout_s or self.control_timeout_s
        rep: P.QueryReply = await self._request(P.Query(request_id=self._new_id(), what=what), t, "control_timeout_s")
        return _body(rep, cls)

    async def health_view(self, timeout_s: float | None = None) -> P.HealthView:
        """The cluster's health, typed (`health()` is the same as plain dicts)."""
        return await self._query("health", P.HealthView, timeout_s)

    async def engine_views(self) -> list[P.EngineView]:
        """Every registered engine, typed (`engines()` is the same as plain dicts)."""
        return (await self._query("engines", P.EnginesView)).engines

    async def health(self, timeout_s: float | None = None) -> dict[str, Any]:
        """{"healthy": bool, "engines": {engine_id: detail}} (P.HealthView as dicts)."""
        return P.as_dict(await self.health_view(timeout_s))

    async def engines(self) -> list[dict[str, Any]]:
        return [P.as_dict(e) for e in await self.engine_views()]

    async def stats(self) -> dict[str, Any]:
        return P.as_dict(await self._query("stats", P.StatsView))

    async def wait_ready(self, num_engines: int = 1, timeout_s: float = 120.0) -> dict[str, Any]:
        """Wait until `num_engines` engines are healthy (deadline: timeout_s,
        which bounds every query inside it too; a head that is down or
        restarting is asked again until then)."""
        deadline = time.monotonic() + timeout_s
        last: object = None
        while True:
            left = deadline - time.monotonic()
            h: P.HealthView | None
            try:
                h = await self.health_view(timeout_s=max(0.05, left))
            except (HeadUnavailable, RequestTimeout) as e:
                h, last = None, e
            if h is not None:
                last = P.as_dict(h)
                if sum(1 for e in h.engines.values() if e.healthy) >= num_engines:
                    return P.as_dict(h)
            if time.monotonic() >= deadline:
                raise RequestTimeout(
                    f"fewer than {num_engines} healthy engine(s) after timeout_s={timeout_s}: {last}", field="timeout_s"
                )
            await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    # ------------------------------------------------------------ control plane

    async def control(
        self, op: P.Op, *, targets: list[str] | None = None, timeout_s: float | None = None, strict: bool = True
    ) -> dict[str, P.Result]:
        """Fan `op` out to the engines; returns {engine_id: the op's typed
        result} (a `P.*Result`: `r.parked`; by key as well: `r["parked"]`). With
        strict, any engine error or missing ack raises ControlError (which
        carries results, errors {engine_id: EngineFailure(code, message, field)}
        and missing)."""
        t = timeout_s or self.control_timeout_s
        msg = P.Control(request_id=self._new_id(), op=op, targets=targets, timeout_s=t, token=self._token)
        rep: P.ControlReply = await self._request(msg, t + _GRACE_S, "control_timeout_s")
        if strict and (rep.errors or rep.missing):
            parts = [
                f"{eid}: [{f.code}] {f.message}" + (f" (field={f.field})" if f.field else "")
                for eid, f in sorted(rep.errors.items())
            ]
            if rep.missing:
                parts.append(f"no ack within timeout_s={t} from {rep.missing}")
            raise ControlError(
                f"{P.OP_NAMES[type(op)]} failed on some engines: " + "; ".join(parts),
                results=dict(rep.results),
                errors=dict(rep.errors),
                missing=list(rep.missing),
                request_id=msg.request_id,
            )
        return dict(rep.results)

    async def pause(
        self, mode: str = "abort", *, lora: str | None = None, timeout_s: float | None = None
    ) -> dict[str, P.PauseResult]:
        """Returns once every engine is quiescent for the scope; per engine a
        PauseResult (parked / frozen / held counts)."""
        t = timeout_s or self.control_timeout_s
        return _expect(await self.control(P.Pause(mode=mode, lora=lora, timeout_s=t), timeout_s=t), P.PauseResult)

    async def resume(self, *, lora: str | None = None) -> dict[str, P.ResumeResult]:
        return _expect(await self.control(P.Resume(lora=lora)), P.ResumeResult)

    async def is_paused(self, *, lora: str | None = None) -> bool:
        res = _expect(await self.control(P.IsPaused(lora=lora)), P.IsPausedResult)
        return bool(res) and all(r.paused for r in res.values())

    @contextlib.asynccontextmanager
    async def paused(self, mode: str = "abort", *, lora: str | None = None):
        """`async with client.paused("abort"): await client.update_weights(...)`;
        resumes even when the body raises."""
        await self.pause(mode, lora=lora)
        try:
            yield self
        finally:
            await self.resume(lora=lora)

    async def sleep(self, level: int = 1) -> dict[str, P.SleepResult]:
        """Put both tags ("weights", "kv_cache") to sleep on every engine (1:
        offload the weights, 2: discard them); {engine_id: SleepResult}."""
        return _expect(await self.control(P.Sleep(level=level)), P.SleepResult)

    async def wake_up(self, tags: list[str] | None = None) -> dict[str, P.WakeUpResult]:
        """Wake `tags` (None: both) in any order and split, e.g. ["weights"],
        a weight update, then ["kv_cache"]; requests run once no tag sleeps.
        {engine_id: WakeUpResult} (`detail["asleep"]`: the tags still asleep)."""
        return _expect(await self.control(P.WakeUp(tags=tags)), P.WakeUpResult)

    async def reset_prefix_cache(self) -> dict[str, P.ResetPrefixCacheResult]:
        return _expect(await self.control(P.ResetPrefixCache()), P.ResetPrefixCacheResult)

    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        *,
        transport: str = "zmq",
        bucket_bytes: int | None = None,
        targets: list[str] | None = None,
        timeout_s: float | None = None,
        check_finite: bool = True,
        **transport_options: Any,
    ) -> dict[str, P.WeightsCommitted]:
        """Push new weights into every engine: begin → buckets → commit (the
        head's two-phase commit). One update at a time: while another client's
        update holds the cluster this raises UpdateInProgress naming it.
        `check_finite`: engines refuse a NaN / inf value before their vote,
        naming the tensor (False skips the pass over the bytes). `named_tensors`: a list (planned: engines
        validate before any byte moves) or any iterable, e.g. a generator
        (streamed: buckets are packed and sent as tensors arrive, the trainer
        holds at most two buckets). All-or-nothing across the cluster: on any
        failure before the commit every engine keeps its old weights and
        version, and the error names the engine and tensor; an engine that
        misses the commit itself is reported stale by the head."""
        from trainer_bridge.weights import push_weights

        # Not list(): a generator is streamed (packed as it yields).
        return await push_weights(
            self,
            named_tensors,
            transport=transport,
            bucket_bytes=bucket_bytes,
            targets=targets,
            timeout_s=timeout_s or self.control_timeout_s,
            options=transport_options,
            check_finite=check_finite,
        )

    def weight_update(
        self,
        *,
        senders: int = 1,
        version: int | None = None,
        targets: list[str] | None = None,
        bucket_bytes: int | None = None,
        timeout_s: float | None = None,
        transport: str = "zmq",
        check_finite: bool = True,
        **transport_options: Any,
    ) -> Any:
        """One update fed by several sender ranks (zmq, cuda_ipc or nccl: each
        rank delivers its own part, metas included), committed at once:
        `async with client.weight_update(senders=2) as upd:` then each rank
        `await upd.sender(rank).send(named_tensors)` (or, from its own
        process, `await client.weight_sender(upd.update_id, rank)`); leaving
        the block commits on every engine (version += 1 once), an exception
        (or a sender that failed or never finished) aborts everywhere."""
        from trainer_bridge.weights import WeightUpdate

        return WeightUpdate(
            self,
            senders=senders,
            version=version,
            targets=targets,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s or self.control_timeout_s,
            transport=transport,
            options=transport_options,
            check_finite=check_finite,
        )

    async def weight_sender(
        self,
        update_id: str,
        rank: int,
        *,
        bucket_bytes: int | None = None,
        timeout_s: float | None = None,
        **transport_options: Any,
    ) -> Any:
        """Join update `update_id` (opened by another process) as sender `rank`.
        Over cuda_ipc use it as `async with`: its exit keeps this rank's buckets
        until the coordinator's commit round is over."""
        from trainer_bridge.weights import join_update

        return await join_update(
            self,
            update_id,
            rank,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s or self.control_timeout_s,
            options=transport_options,
        )

    async def sync_stale(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        *,
        transport: str = "zmq",
        bucket_bytes: int | None = None,
        timeout_s: float | None = None,
        **transport_options: Any,
    ) -> dict[str, P.WeightsCommitted]:
        """Bring every STALE engine (below the cluster weight version: restarted
        from its checkpoint, joined late) up to date from the trainer's current
        tensors — the ones the cluster serves. Only the stale engines receive
        them; each ends at the cluster version (set, not incremented) and serves
        again. {} when none is stale. No pause needed: stale engines serve nothing."""
        h = await self.health_view()
        stale = list(h.stale or [eid for eid, e in h.engines.items() if e.stale])
        if not stale:
            return {}
        from trainer_bridge.weights import push_weights

        return await push_weights(
            self,
            list(named_tensors),
            transport=transport,
            bucket_bytes=bucket_bytes,
            targets=stale,
            timeout_s=timeout_s or self.control_timeout_s,
            options=transport_options,
            version=h.weight_version,
        )

    async def load_lora(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: Iterable[tuple[str, Any]] | None = None,
        config: dict[str, Any] | None = None,
        targets: list[str] | None = None,
    ) -> dict[str, P.ConfigResult]:
        """Load (or replace in place) adapter `name` from a PEFT folder `path`
        or from `tensors` (PEFT names) + `config` (r, lora_alpha, target_modules).
        Per engine its adapter set after the op (a LoraResult; a WeightsCommitted
        when the tensors were staged)."""
        if (path is None) == (tensors is None):
            raise ValueError("load_lora takes exactly one of path= or tensors=")
        if path is not None:
            op = P.LoadLora(name=name, path=path, config=config or {})
            return dict(_expect(await self.control(op, targets=targets), P.LoraResult))
        from trainer_bridge.weights import push_weights

        return dict(
            await push_weights(
                self,
                list(tensors or ()),
                transport="zmq",
                bucket_bytes=None,
                targets=targets,
                timeout_s=self.control_timeout_s,
                options={},
                target=f"lora:{name}",
                extra_args={"lora_config": dict(config or {})},
            )
        )

    async def unload_lora(self, name: str) -> dict[str, P.LoraResult]:
        return _expect(await self.control(P.UnloadLora(name=name)), P.LoraResult)


_B = TypeVar("_B", bound=P.Body)
_R = TypeVar("_R", bound=P.ResultBase)


def _body(rep: P.QueryReply, cls: type[_B]) -> _B:
    """The reply's body as the type its question is answered with; another
    body is a protocol error (a head of another version)."""
    if not isinstance(rep.body, cls):
        raise ProtocolError(
            f"the head answered {type(rep.body).__name__}, expected {cls.__name__}", request_id=rep.request_id
        )
    return rep.body


def _expect(results: dict[str, P.Result], cls: type[_R]) -> dict[str, _R]:
    return P.expect(results, cls, str(cls.__struct_config__.tag or cls.__name__))


# ---------------------------------------------------------------- sync face


class Client:
    """Synchronous client. Runs an AsyncClient on a private event-loop thread."""

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:5555",
        *,
        timeout_s: float = 600.0,
        control_timeout_s: float = 120.0,
        curve_dir: str | None = None,
        client_key: str | None = None,
        tokenizer: Any = None,
        token_file: str | None = None,
        head_timeout_s: float = 2.0,
        connect_timeout_s: float = 3.0,
        ping_interval_s: float = 0.5,
    ) -> None:
        """`head_timeout_s`, `connect_timeout_s`, `ping_interval_s`: head
        liveness (AsyncClient). `timeout_s`: a request's deadline; `control_timeout_s`: a control
        op's; `curve_dir`: the cluster's key folder (launch.py --curve) and
        `client_key`: this client's key in it, a name or a .key_secret path
        (AsyncClient); `tokenizer`: a Hugging Face tokenizer or a local model
        folder (else the engines' model's); `token_file`: the cluster's join
        token (None: found as AsyncClient says; "": none)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-bus-client", daemon=True)
        self._thread.start()
        self._aclient = AsyncClient(
            address,
            timeout_s=timeout_s,
            control_timeout_s=control_timeout_s,
            curve_dir=curve_dir,
            client_key=client_key,
            tokenizer=tokenizer,
            token_file=token_file,
            head_timeout_s=head_timeout_s,
            connect_timeout_s=connect_timeout_s,
            ping_interval_s=ping_interval_s,
        )
        self._finalizer = weakref.finalize(self, _close_loop, self._loop, self._thread, self._aclient)

    @property
    def address(self) -> str:
        return self._aclient.address

    def _call(self, coro: Any, timeout_s: float | None = None) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        # The coroutine has its own deadline; this outer one only guards a wedged loop.
        limit = (timeout_s or max(self._aclient.timeout_s, self._aclient.control_timeout_s)) + 30
        try:
            return fut.result(limit)
        except TimeoutError:
            fut.cancel()
            raise RequestTimeout(
                f"client call did not return within {limit}s (timeout_s + 30)", field="timeout_s"
            ) from None

    def generate(
        self,
        prompt_ids: Sequence[int] | Sequence[Sequence[int]] | str | list[dict[str, Any]],
        params: P.SamplingParams | dict[str, Any] | None = None,
        *,
        num_samples: int = 1,
        session_id: str | None = None,
        lora: str | None = None,
        timeout_s: float | None = None,
        max_staleness: int | None = None,
    ) -> GenerationResult | list[GenerationResult]:
        """One prompt → a GenerationResult; a batch → a list in input order.
        A prompt is token ids, a string or a chat (a list of messages: the
        model's chat template); with a tokenizer, samples carry `text`.
        `max_staleness=k`: see AsyncClient.generate."""
        coro = self._aclient.generate(
            prompt_ids,  # type: ignore[arg-type]
            params,
            num_samples=num_samples,
            session_id=session_id,
            lora=lora,
            timeout_s=timeout_s,
            max_staleness=max_staleness,
        )
        return self._call(coro, timeout_s)

    def sample(
        self,
        prompt_ids: Sequence[int],
        num_samples: int,
        params: P.SamplingParams | dict[str, Any] | None = None,
        *,
        lora: str | None = None,
        timeout_s: float | None = None,
        max_staleness: int | None = None,
    ) -> SampleResponse:
        """Tinker semantics: num_samples sequences, each with tokens, logprobs
        and stop_reason "stop" or "length" (all samples share one engine)."""
        coro = self._aclient.sample(
            prompt_ids, num_samples, params, lora=lora, timeout_s=timeout_s, max_staleness=max_staleness
        )
        return self._call(coro, timeout_s)

    def stream(
        self,
        prompt_ids: Sequence[int],
        params: P.SamplingParams | dict[str, Any] | None = None,
        *,
        num_samples: int = 1,
        session_id: str | None = None,
        lora: str | None = None,
        timeout_s: float | None = None,
        request_id: str | None = None,
        max_staleness: int | None = None,
    ) -> Iterator[StreamChunk]:
        """Chunks as the engine produces them (per step, per sample). Ends
        after every sample's final chunk; raises the request's typed error.
        With `max_staleness`, a chunk whose `restarts` grew says "discard this
        sample's earlier tokens"."""
        q: queue.Queue = queue.Queue()
        kw = dict(
            num_samples=num_samples,
            session_id=session_id,
            lora=lora,
            timeout_s=timeout_s,
            request_id=request_id,
            max_staleness=max_staleness,
        )

        async def pump() -> None:
            try:
                async for ch in self._aclient.stream(prompt_ids, params, **kw):  # type: ignore[arg-type]
                    q.put(ch)
                q.put(_END)
            except BaseException as e:  # handed to the consumer thread
                q.put(e)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        limit = (timeout_s or self._aclient.timeout_s) + 30
        try:
            while True:
                item = q.get(timeout=limit)
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        except queue.Empty:
            raise RequestTimeout(f"stream stalled for {limit}s (timeout_s + 30)", field="timeout_s") from None
        finally:
            if not fut.done():
                fut.cancel()

    def cancel(self, request_id: str) -> None:
        """Ask for the request's end: its stream finishes with "cancelled"."""
        self._call(self._aclient.cancel(request_id))

    def text(self) -> Any:
        """The client's `trainer_bridge.text.Text` (tokenizer + chat template):
        the one given to the constructor, else the engines' model folder's."""
        return self._call(self._aclient.text())

    def tokenize(self, prompt: str | list[dict[str, Any]], *, add_special_tokens: bool = True) -> list[int]:
        """Text → ids (`add_special_tokens` as the tokenizer's), or a chat → its template's ids."""
        return self._call(self._aclient.tokenize(prompt, add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Ids → text."""
        return self._call(self._aclient.detokenize(token_ids, skip_special_tokens=skip_special_tokens))

    def end_session(self, session_id: str) -> bool:
        """Forget the session's engine binding; True when it existed."""
        return self._call(self._aclient.end_session(session_id))

    def health(self, timeout_s: float | None = None) -> dict[str, Any]:
        """{"healthy": bool, "engines": {engine_id: detail}}."""
        return self._call(self._aclient.health(timeout_s), timeout_s)

    def health_view(self, timeout_s: float | None = None) -> P.HealthView:
        """The cluster's health, typed (`health()` is the same as plain dicts)."""
        return self._call(self._aclient.health_view(timeout_s), timeout_s)

    def engine_views(self) -> list[P.EngineView]:
        """Every registered engine, typed (`engines()` is the same as plain dicts)."""
        return self._call(self._aclient.engine_views())

    def engines(self) -> list[dict[str, Any]]:
        """Every registered engine's detail (state, address, backend, load…)."""
        return self._call(self._aclient.engines())

    def stats(self) -> dict[str, Any]:
        """The head's counters, requests in flight and open sessions."""
        return self._call(self._aclient.stats())

    def wait_ready(self, num_engines: int = 1, timeout_s: float = 120.0) -> dict[str, Any]:
        """Wait until `num_engines` engines are healthy (deadline: timeout_s)."""
        return self._call(self._aclient.wait_ready(num_engines, timeout_s), timeout_s)

    def control(
        self, op: P.Op, *, targets: list[str] | None = None, timeout_s: float | None = None, strict: bool = True
    ) -> dict[str, P.Result]:
        """Fan `op` out to the engines; returns {engine_id: the op's typed
        result}. With strict, any engine error or missing ack raises
        ControlError (results, errors {engine_id: EngineFailure}, missing)."""
        return self._call(self._aclient.control(op, targets=targets, timeout_s=timeout_s, strict=strict), timeout_s)

    def pause(
        self, mode: str = "abort", *, lora: str | None = None, timeout_s: float | None = None
    ) -> dict[str, P.PauseResult]:
        """Returns once every engine is quiescent for the scope; per engine a
        PauseResult (parked / frozen / held counts)."""
        return self._call(self._aclient.pause(mode, lora=lora, timeout_s=timeout_s), timeout_s)

    def resume(self, *, lora: str | None = None) -> dict[str, P.ResumeResult]:
        """Open the gate (all scopes, or adapter `lora`); per engine a ResumeResult."""
        return self._call(self._aclient.resume(lora=lora))

    def is_paused(self, *, lora: str | None = None) -> bool:
        """True when every engine is paused (for adapter `lora`, when given)."""
        return self._call(self._aclient.is_paused(lora=lora))

    @contextlib.contextmanager
    def paused(self, mode: str = "abort", *, lora: str | None = None):
        """`with client.paused("abort"): client.update_weights(...)` — resumes
        even when the body raises."""
        self.pause(mode, lora=lora)
        try:
            yield self
        finally:
            self.resume(lora=lora)

    def sleep(self, level: int = 1) -> dict[str, P.SleepResult]:
        """Release GPU memory (1: offload weights, 2: discard them); requests wait."""
        return self._call(self._aclient.sleep(level))

    def wake_up(self, tags: list[str] | None = None) -> dict[str, P.WakeUpResult]:
        """Restore memory by tag ("weights", "kv_cache"; None: both), in any order
        and split; requests run again once no tag is asleep. Per engine results."""
        return self._call(self._aclient.wake_up(tags))

    def reset_prefix_cache(self) -> dict[str, P.ResetPrefixCacheResult]:
        return self._call(self._aclient.reset_prefix_cache())

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        *,
        transport: str = "zmq",
        bucket_bytes: int | None = None,
        targets: list[str] | None = None,
        timeout_s: float | None = None,
        check_finite: bool = True,
        **transport_options: Any,
    ) -> dict[str, P.WeightsCommitted]:
        """Push new weights into every engine: begin → buckets → finish.
        All-or-nothing per engine: on any failure every engine keeps its old
        weights and version, and the error names the engine and tensor.
        `transport_options` go to the GPU transports (cuda_ipc, nccl)."""
        coro = self._aclient.update_weights(
            named_tensors,
            transport=transport,
            bucket_bytes=bucket_bytes,
            targets=targets,
            timeout_s=timeout_s,
            check_finite=check_finite,
            **transport_options,
        )
        return self._call(coro, timeout_s)

    def weight_update(self, **kw: Any) -> SyncWeightUpdate:
        """The sync form of AsyncClient.weight_update: `with c.weight_update(senders=2) as upd:
        upd.sender(0).send(named)` — commits on leaving the block."""
        return SyncWeightUpdate(self, self._aclient.weight_update(**kw))

    def weight_sender(self, update_id: str, rank: int, **kw: Any) -> SyncWeightSender:
        """Join update `update_id` (opened by another process) as sender `rank`."""
        return SyncWeightSender(self, self._call(self._aclient.weight_sender(update_id, rank, **kw)))

    def sync_stale(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        *,
        transport: str = "zmq",
        bucket_bytes: int | None = None,
        timeout_s: float | None = None,
        **transport_options: Any,
    ) -> dict[str, P.WeightsCommitted]:
        """Bring every STALE engine up to date from the trainer's current tensors
        (only those engines; they take the cluster version). {} when none is stale."""
        return self._call(
            self._aclient.sync_stale(
                named_tensors, transport=transport, bucket_bytes=bucket_bytes, timeout_s=timeout_s, **transport_options
            ),
            timeout_s,
        )

    def load_lora(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: Iterable[tuple[str, Any]] | None = None,
        config: dict[str, Any] | None = None,
        targets: list[str] | None = None,
    ) -> dict[str, P.ConfigResult]:
        """Load (or replace in place) adapter `name` from a PEFT folder `path`
        or from `tensors` (PEFT names) + `config` (r, lora_alpha, target_modules)."""
        return self._call(self._aclient.load_lora(name, path=path, tensors=tensors, config=config, targets=targets))

    def unload_lora(self, name: str) -> dict[str, P.LoraResult]:
        return self._call(self._aclient.unload_lora(name))

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class SyncWeightSender:
    def __init__(self, client: Client, sender: Any) -> None:
        self._client, self._sender = client, sender

    def send(self, named_tensors: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        """Pack and stream this rank's tensors (any iterable), then declare its end."""
        return self._client._call(self._sender.send(named_tensors))

    def wait_released(self, timeout_s: float | None = None) -> Any:
        """cuda_ipc: keep this rank's buckets until the coordinator's commit round
        is over (or it aborted), then free them. Other transports: nothing to wait for."""
        wait = getattr(self._sender, "wait_released", None)
        return None if wait is None else self._client._call(wait(timeout_s), timeout_s)

    def __enter__(self) -> SyncWeightSender:
        return self

    def __exit__(self, *exc: Any) -> None:
        if getattr(self._sender, "_ipc", None) is not None:
            self.wait_released()


class SyncWeightUpdate:
    """A multi-sender update from the sync Client (see AsyncClient.weight_update)."""

    def __init__(self, client: Client, upd: Any) -> None:
        self._client, self._upd = client, upd

    @property
    def update_id(self) -> str:
        return self._upd.update_id

    @property
    def results(self) -> dict[str, P.WeightsCommitted]:
        return self._upd.results

    def sender(self, rank: int = 0) -> SyncWeightSender:
        return SyncWeightSender(self._client, self._upd.sender(rank))

    def prepare(self) -> dict[str, P.WeightsPrepared]:
        return self._client._call(self._upd.prepare())

    def commit(self) -> dict[str, P.WeightsCommitted]:
        return self._client._call(self._upd.commit())

    def abort(self) -> None:
        self._client._call(self._upd.abort())

    def __enter__(self) -> SyncWeightUpdate:
        self._client._call(self._upd.open())
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._client._call(self._upd.__aexit__(exc_type, exc, tb))


def _close_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, aclient: AsyncClient) -> None:
    if loop.is_closed():
        return
    try:
        asyncio.run_coroutine_threadsafe(aclient.close(), loop).result(5)
    except Exception:
        pass
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()
