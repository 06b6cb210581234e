"""The client's link to the head: one DEALER socket, its pings, and what
happens when the head is lost or restarts.

Ownership: everything here belongs to the asyncio loop that first used the
client (`_socket` records it). The socket is a plain zmq socket drained from
`loop.add_reader` (no future per message) — zmq's FD is edge-triggered, so
every send also schedules a drain. Replies go to the waiter registered under
their request id: a queue per generate request (`streams.RequestStream`), a
future per request/reply call.

Head liveness: while its socket is open the client pings the head every
`ping_interval_s` (idle too; the pings also renew its lease on the pauses,
sleep and weight update it holds, router_node/leases.py). A dead head and a
stalled one are told apart by the connection (a socket monitor): nothing from
the head for `head_timeout_s` after its connection dropped (a killed process:
the kernel closes its sockets), nothing for `head_stall_timeout_s` while the
connection stays up (a stopped or frozen process, a long GC pause: it may come
back with every stream intact), or no head reached within `connect_timeout_s`
of a request, ends every open request with `HeadUnavailable` naming the address
and the knob;
the socket is then replaced (so no queued request reaches a later head) and
the client keeps pinging: once the head is back, new requests work. A pong
with a new incarnation means the head restarted between two pings: the
same, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from bus import protocol as P
from bus.codec import Codec, split_packed
from bus.endpoint import open_monitored, readable, recv_frames, send_multipart
from bus.errors import AuthRefused, ClosedByUs, HeadUnavailable, RequestTimeout, exception_from_wire
from bus.handshake_refusal import HANDSHAKE_EVENTS, RefusalJudge, silent_words
from bus.roles import Plain
from bus.sockets import DATA_HWM, CurveKeys
from trainer_bridge.pacing import InflightGate
from trainer_bridge.streams import END, GRACE_S, TIMED_OUT, RequestStream

log = structlog.get_logger("trainer_bridge.connection")


class HeadLink:
    def __init__(
        self,
        address: str,
        *,
        curve: CurveKeys | None,
        plain: Plain | None = None,
        head_timeout_s: float,
        connect_timeout_s: float,
        ping_interval_s: float,
        head_stall_timeout_s: float = 30.0,
    ) -> None:
        self.address = address
        self._curve = curve
        self._plain = plain  # the join token's client credential (bus/roles.py); None: none found
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        # Security on: a monitor of the DEALER reports a refused handshake (our
        # key is not on the allow-list); libzmq does not retry after it, so
        # every waiter fails at once with AuthRefused instead of timing out.
        self._monitor: zmq.Socket | None = None
        self._refused: AuthRefused | None = None
        self._refusals = RefusalJudge()
        self._token_may_appear = False  # the client's: a join token may be published later (async_client.py)
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
        self.head_stall_timeout_s = max(head_stall_timeout_s, head_timeout_s)
        # The monitor saw the connection drop and no new handshake since: a
        # silent head is then dead (head_timeout_s), not stalled.
        self._link_down = False
        self._last_rx = 0.0
        self._head_up = False
        self._head_incarnation = ""  # the HeadPong's; a change: the head restarted
        self._since: dict[str, float] = {}
        self.inflight = InflightGate()  # generate requests in flight, under the head's per-client cap
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
            # Hazard: a client dropped without close() (a caller's failed
            # scenario) is destroyed by the garbage collector, anywhere in
            # the caller's code; every socket of this context lingers 0 so
            # that destroy -> term never waits for undelivered frames.
            self._ctx.setsockopt(zmq.LINGER, 0)
            try:
                self._open()
            except zmq.ZMQError:
                # zmq refused the address: no socket may stay in the
                # context, or close() (ctx.term) would wait on it forever.
                self._ctx.destroy(linger=0)
                self._ctx = self._sock = None
                raise
            # The first ping goes one interval later: the first frame the head
            # sees is the caller's (a scripted peer may read exactly one).
            self._watch_at = time.monotonic()
            self._watch = self._loop.call_later(self.ping_interval_s, self._watchdog)
        if self._refused is not None and not self._recover_refusal(self._refused):
            raise self._refused
        assert self._sock is not None
        return self._sock

    def _recover_refusal(self, err: AuthRefused) -> bool:
        """A chance to mend a refusal before the next call (True: mended, the
        socket is new). Here: none; the client looks for a token published since."""
        return False

    def _reconnect_as(self, plain: Plain) -> None:
        """A new socket that proves `plain` at the handshake; the refusal is gone."""
        self._plain = plain
        self._refused = None
        self._refusals = RefusalJudge()
        self._close_socket()
        self._open()

    def _open(self) -> None:
        assert self._loop is not None and self._ctx is not None
        # Handshake refusals fail every wait at once, naming the fix, instead
        # of a timeout much later: a key the head does not allow (AUTH), or
        # a security mismatch (PROTOCOL: no keys against a CURVE head, or
        # keys against a plain one). Disconnects and handshakes tell a dead
        # head from a stalled one (the module doc). The monitor is attached
        # before the connect (bus/endpoint.py open_monitored).
        self._sock, self._monitor = open_monitored(
            self._ctx,
            zmq.DEALER,
            connect=self.address,
            events=HANDSHAKE_EVENTS | zmq.EVENT_DISCONNECTED,
            curve=self._curve,
            plain=self._plain,
        )
        self._head_up = False
        self._link_down = False
        self._loop.add_reader(self._sock.fileno(), self._drain)
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

    def _fail_all(self, err: Exception) -> None:
        """End every open request with `err`."""
        for q in self._streams.values():
            q.put_nowait((err, None, None))
        for f in self._replies.values():
            if not f.done():
                f.set_exception(err)

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
        silent = now - self._last_rx
        if self._head_up and self._link_down and silent > self.head_timeout_s:
            self._head_lost(
                f"the connection to the head at {self.address} dropped and nothing came for {silent:.1f}s "
                f"(head_timeout_s={self.head_timeout_s}): it died or is restarting",
                "head_timeout_s",
            )
        elif self._head_up and silent > self.head_stall_timeout_s:
            self._head_lost(
                f"the head at {self.address} is connected but sent nothing for {silent:.1f}s "
                f"(head_stall_timeout_s={self.head_stall_timeout_s}): it is stopped or frozen",
                "head_stall_timeout_s",
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
        while self._monitor is not None:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_DISCONNECTED:
                self._link_down = True
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._link_down = False
            # A run of silent handshake failures is a refusal too (bus/handshake_refusal.py).
            refusal = self._refusals.judge(event)  # type: ignore[arg-type]
            if refusal is None:
                continue
            err = self._refusal(refusal)
            if err is None:
                continue
            self._refused = err
            self._fail_all(err)

    def _refusal(self, event: Any) -> AuthRefused | None:
        """The typed error a handshake-failure event means (None: not one)."""
        tcp = self.address.startswith("tcp://")
        if not tcp or (self._curve is None and event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH):
            return self._token_refusal(event)  # PLAIN: a wrong token, or none where one is needed
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            return AuthRefused(
                f"the head at {self.address} is a secured (CURVE, or join token) cluster ({_why(event)}) and this "
                f"client has no keys{'' if self._plain is not None else ' and no join token'}: "
                "pass curve_dir= (a copy of the head's key folder) and client_key= - the launcher prints "
                "the exact Client(...) line (docs/security.md)"
                if self._curve is None
                else f"the handshake with the head at {self.address} failed ({_why(event)}): "
                "this client uses CURVE keys; is the head started with --curve?",
                field="curve_dir",
            )
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH and self._curve is not None:
            key = self._curve.public.decode("ascii")
            return AuthRefused(
                f"the head at {self.address} refused this client's CURVE key {key} (ZAP status "
                f"{event['value']}): it is not on the head's clients allow-list - add it with "
                "`python launch.py keys add-client NAME --public FILE` (docs/security.md)",
                field="client_key",
            )
        return None

    def _token_refusal(self, event: Any) -> AuthRefused | None:
        """No CURVE here: the head admits token holders only (PLAIN), or anyone."""
        if event["event"] not in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH):
            return None
        why = "refused this client's join token" if self._plain is not None else "needs the cluster's join token"
        return AuthRefused(
            f"the head at {self.address} {why} at the handshake ({_why(event)}): pass "
            "Client(..., token_file=PATH) (the 0600 file launch.py made), set $ROLLOUT_BUS_TOKEN_FILE, or run "
            "on the launcher's host, where it is found by the address (docs/security.md)",
            field="token",
        )

    # ------------------------------------------------------------ receiving

    def _drain(self) -> None:
        """Read every message that is ready and hand it to its waiter."""
        self._drain_scheduled = False
        sock = self._sock
        if sock is None:
            return
        # A one-item poll per message instead of reading until zmq.Again (an
        # exception per drain costs more than the message: bus/endpoint.py);
        # the poll reads ZMQ_EVENTS, which is what re-arms the edge-triggered FD.
        while not sock.closed and readable(sock):
            frames = recv_frames(sock)
            if frames is None:
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
            except Exception as e:
                # A garbled reply names no waiter we could hand it to; the
                # waiter's own deadline ends its request. Logged: a head that
                # speaks another protocol shows up here first.
                log.warning("garbled_reply_dropped", address=self.address, frames=len(frames), error=repr(e))
                continue
            if isinstance(msg, (P.Chunk, P.ChunkBatch)):
                streams = self._streams
                for item in parts:
                    q = streams.get(item[0].request_id)
                    if q is not None:
                        q.put_nowait(item)
                continue
            if isinstance(msg, P.HeadPong):
                if self._on_pong(msg):
                    return  # _head_lost replaced the socket this loop reads
                continue
            self._deliver(msg)

    def _on_pong(self, msg: P.HeadPong) -> bool:
        """True when the pong says the head restarted (the socket was replaced)."""
        self.inflight.learn(msg.max_inflight_per_client)
        old, self._head_incarnation = self._head_incarnation, msg.incarnation or self._head_incarnation
        if old and msg.incarnation and msg.incarnation != old:
            # A head restarted within head_timeout_s (the supervisor is
            # quick): the requests open on the old one will never end.
            self._head_lost(
                f"the head at {self.address} restarted (incarnation {old} -> {msg.incarnation}): "
                "requests open on the old head are lost",
                "incarnation",
            )
            return True
        return False

    def _deliver(self, msg: Any) -> None:
        rid = msg.request_id
        q = self._streams.get(rid)
        if q is not None:
            q.put_nowait((msg, None, None))
            return
        fut = self._replies.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    # ------------------------------------------------------------ sending and waiting

    def _send(self, msg: Any, buffers: Sequence[Any] = ()) -> None:
        sock = self._socket()
        try:
            # Never a blocking send: libzmq ends the DEALER's only pipe when the
            # head refuses the handshake, and a blocking send would then freeze
            # this loop before the monitor's refusal event is read.
            send_multipart(sock, self._codec.encode(msg, buffers), zmq.NOBLOCK)
        except zmq.Again:
            self._on_monitor()  # the refusal, when that is why
            if self._refused is not None:
                raise self._refused from None
            raise HeadUnavailable(
                f"the connection to the head at {self.address} takes no message (closed after a failed "
                f"handshake, or {DATA_HWM} messages queued that the head never read)",
                address=self.address,
                request_id=getattr(msg, "request_id", None),
                field="connect_timeout_s",
            ) from None
        # Edge-triggered FD: a send can swallow the readable edge of replies
        # that already arrived, so look once more on the next loop turn.
        if not self._drain_scheduled:
            self._drain_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._drain)

    async def _request(self, msg: Any, timeout_s: float, knob: str) -> Any:
        return await self._reply(msg, self._issue(msg), timeout_s, knob)

    def _issue(self, msg: Any) -> asyncio.Future:
        """Send `msg` now (messages leave in call order) and register the
        future its reply resolves; `_reply` awaits it (always: it unregisters)."""
        fut = asyncio.get_running_loop().create_future()
        self._replies[msg.request_id] = fut
        self._since[msg.request_id] = time.monotonic()
        try:
            self._send(msg)
        except BaseException:  # never sent: nothing will resolve or await the future
            self._replies.pop(msg.request_id, None)
            self._since.pop(msg.request_id, None)
            raise
        return fut

    async def _reply(self, msg: Any, fut: asyncio.Future, timeout_s: float, knob: str) -> Any:
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

    def _open_stream(self, rid: str, timeout: float, num_samples: int) -> RequestStream:
        """Register a generate request's queue and its one deadline timer
        (not one per chunk), before its Generate is sent."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = q
        self._since[rid] = time.monotonic()
        # The timer only enqueues TIMED_OUT: the awaiting coroutine sends the Cancel.
        timer = asyncio.get_running_loop().call_later(timeout + GRACE_S, q.put_nowait, (TIMED_OUT, None, None))
        return RequestStream(rid, q, timer, num_samples)

    def _close_stream(self, st: RequestStream) -> None:
        st.timer.cancel()
        self._streams.pop(st.request_id, None)
        # The awaiting task was cancelled (asyncio.CancelledError at the
        # wait) or the stream's consumer stopped early (GeneratorExit at
        # the yield): the request is still running on its engine, so ask
        # for its end, else it generates on to max_tokens for nobody.
        # Best effort: a closed socket has nothing left to cancel.
        if st.sent and st.open_samples and not self._closed:
            with contextlib.suppress(Exception):
                self._send(P.Cancel(request_id=st.request_id))
        self._since.pop(st.request_id, None)

    async def close(self) -> None:
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
        for q in self._streams.values():
            q.put_nowait((END, None, None))
        for f in self._replies.values():
            if not f.done():
                f.set_exception(ClosedByUs("the client was closed while waiting"))
        self._close_socket()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # every socket closed, linger 0: returns at once


def _why(event: dict) -> str:
    if event.get("silent"):
        return silent_words()
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"ZAP status {event['value']}"
    return f"ZMTP error {event['value']:#x}"
