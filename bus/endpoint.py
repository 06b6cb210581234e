"""Endpoints: opening sockets (CURVE applied in one place) and serving them
(decode → handler table → typed Error reply, gone peers).

`open_socket` is the only place that decides CURVE: a TCP endpoint is secured
when keys are given (the binding side is the CURVE server, checked by the ZAP
domain it names), IPC never is (a private 0700 folder guards it).

`Endpoint` serves one socket for the thread that owns it: `drain()` reads what
is ready, decodes each message with the codec, calls the handler registered
for its type, and turns a failure into the typed reply the socket's peers
expect (`P.Error` by default) — after `before_error` (flush-then-error: chunks
already produced reach the peer before the error). A ROUTER_MANDATORY send to a
peer that left reports it to `on_peer_gone`, which belongs to this socket
alone: a gone peer of one socket never touches the state of another.

Ownership: an Endpoint and its socket belong to one thread; close with `close()`
(linger 0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import structlog
import zmq

from bus import protocol as P
from bus.codec import ENCODE_ERRORS, Codec, encode_failed, request_id_of
from bus.errors import EncodeFailed, ErrorCode, ProtocolError, RolloutBusError, truncate
from bus.ratelog import RateLimitedLog
from bus.roles import Plain
from bus.sockets import CurveKeys, make_socket

log = structlog.get_logger("bus.endpoint")

# The hot path talks to pyzmq's Cython socket methods directly. pyzmq's
# Python wrappers cost more than the message itself here (measured with
# bench/profile_hop.py): send_multipart does a buffer check per frame, then
# a wrapper `send` per frame with `zmq.SNDMORE | flags` — IntFlag arithmetic
# in Python's enum module; recv_multipart calls a wrapper recv and a
# getsockopt(RCVMORE) per frame; and a drain that reads until zmq.Again
# builds and raises a ZMQError per drain (29k instructions, callgrind: more
# than the message it ended). Plain ints and the Cython methods do the same
# libzmq calls.
_raw_send = zmq.backend.Socket.send
_raw_recv = zmq.backend.Socket.recv
_zmq_poll = zmq.zmq_poll
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
# A frame at least this big goes out zero-copy when it is immutable (bytes,
# or a received zmq.Frame); smaller ones are copied (cheaper than a Frame).
# Hazard: only immutable buffers: libzmq reads a zero-copy frame later, on its
# I/O thread, so a bytearray changed after the send would go out changed.
ZERO_COPY_MIN = 64 * 1024


def send_multipart(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> None:
    """`sock.send_multipart(frames, flags)` without pyzmq's per-frame Python
    wrappers (same libzmq calls; raises the same ZMQError)."""
    last = len(frames) - 1
    more = flags | _SNDMORE
    for i, f in enumerate(frames):
        big = type(f) is bytes and len(f) >= ZERO_COPY_MIN
        _raw_send(sock, f, more if i < last else flags, not big, False)


def recv_frames(sock: zmq.Socket) -> list[Any] | None:
    """One whole message as zmq.Frames without blocking; None when none is queued."""
    try:
        f = _raw_recv(sock, _NOBLOCK, False, False)
    except zmq.Again:
        return None
    frames = [f]
    while f.more:  # the rest of a multipart message is already here (atomic delivery)
        f = _raw_recv(sock, 0, False, False)
        frames.append(f)
    return frames


def readable(sock: zmq.Socket) -> bool:
    """A message is queued on `sock` now. A one-item zmq_poll with timeout 0:
    about a third of the instructions of getsockopt(ZMQ_EVENTS), which builds
    a SocketOption enum per call (3.5k vs 9.7k instructions, callgrind)."""
    return bool(_zmq_poll([(sock, _POLLIN)], 0))


Handler = Callable[[bytes, Any, list[Any]], None]  # (peer, message, raw buffers)
ErrorReply = Callable[[str, ErrorCode, str, "str | None"], Any]  # (request id, code, message, field) -> reply


def open_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    curve: CurveKeys | None = None,
    zap_domain: str | None = None,
    plain: Plain | None = None,
    **options: Any,
) -> zmq.Socket:
    """A socket with every option set (bus.sockets.make_socket), bound or
    connected; CURVE on when `curve` is given and the address is TCP. A bound
    CURVE socket is a server whose peers' keys are checked against the
    allow-list of `zap_domain` (bus/auth.py: "clients", "engines", "peers").
    Otherwise (IPC, or no keys) `plain`, when given: ZMQ PLAIN, a role's
    credential or (binding) a PLAIN server of `zap_domain` (bus/roles.py)."""
    address = bind or connect or ""
    secure = curve if address.startswith("tcp://") else None
    server = bind is not None
    plain = plain if secure is None else None
    return make_socket(
        ctx,
        kind,
        bind=bind,
        connect=connect,
        curve=secure,
        curve_server=server,
        zap_domain=zap_domain if (secure is not None or plain is not None) and server else None,
        plain=plain,
        **options,
    )


def open_monitored(
    ctx: zmq.Context, kind: int, *, connect: str, events: int, **options: Any
) -> tuple[zmq.Socket, zmq.Socket]:
    """open_socket(connect=...) and a libzmq monitor of `events` on it, the
    monitor attached BEFORE the connect. Hazard: a handshake refused with a
    reason (AUTH, PROTOCOL) ends libzmq's session for good, without a
    reconnect, so its one event is lost to a monitor attached after the
    connect: the IO thread may finish the handshake first (a race a loaded
    machine loses), and the refusal then reads as a timeout."""
    monitors: list[zmq.Socket] = []
    sock = open_socket(
        ctx, kind, connect=connect, before_connect=lambda s: monitors.append(s.get_monitor_socket(events)), **options
    )
    return sock, monitors[0]


def error_message(rid: str, code: ErrorCode, message: str, field: str | None) -> P.Error:
    return P.Error(request_id=rid, code=code.value, message=truncate(message), field=field)


def _request_ids(msg: Any) -> list[str]:
    """The request ids a message answers (a ChunkBatch: each of its chunks')."""
    if isinstance(msg, P.ChunkBatch):
        return list(dict.fromkeys(c.request_id for c in msg.chunks))
    rid = getattr(msg, "request_id", None)
    return [rid] if isinstance(rid, str) else []


class Endpoint:
    """One socket served through a handler table.

    `routed`: frames start with one routing frame (ROUTER: the peer id; SUB:
    the topic), passed to handlers as `peer` (b"" otherwise).
    `error_reply`: builds the reply to a message that failed (None: log only,
    for sockets whose peers expect no answer: events, commands).
    """

    def __init__(
        self,
        sock: zmq.Socket,
        codec: Codec,
        handlers: dict[type, Handler],
        *,
        name: str,
        routed: bool,
        error_reply: ErrorReply | None = error_message,
        before_error: Callable[[], None] = lambda: None,
        on_peer_gone: Callable[[bytes], None] = lambda peer: None,
        on_peer_full: Callable[[bytes], None] | None = None,
        max_batch: int = 512,
        after_drain: Callable[[], None] | None = None,
        counters: dict[str, int] | None = None,
    ) -> None:
        self.sock = sock
        self.codec = codec
        self.handlers = handlers
        self.name = name
        self.routed = routed
        self.error_reply = error_reply
        self.before_error = before_error
        self.on_peer_gone = on_peer_gone
        # None: a send to a peer over its high-water mark blocks (backpressure:
        # an engine waits for a slow head). Set (the head's frontend): sends
        # never block the loop; a peer over its HWM is reported here instead
        # and the message is dropped (the callback ends that peer's requests).
        self.on_peer_full = on_peer_full
        self.max_batch = max_batch  # messages per drain (fairness between sockets)
        # Run once when a drain ends, however it ends (the head's engine sockets:
        # what the drain's handlers gathered for clients goes out as one message each).
        self.after_drain = after_drain
        self._flags = _NOBLOCK if on_peer_full is not None else 0  # a plain int: no IntFlag arithmetic per frame
        self._more = self._flags | _SNDMORE
        self._encode = codec.encoder.encode
        # The frames of the message being handled (without the routing frame):
        # valid only during the handler call (zero-copy forwarding).
        self.frames: list[Any] = []
        # Refused messages: every one counted (`counters`: "bad_messages" on a
        # socket that answers none, "request_errors" on one that answers), the
        # log written at a bounded rate (a flood of bad frames is one line per
        # interval per kind, bus/ratelog.py).
        self.counters = counters if counters is not None else {}
        self.refusals = RateLimitedLog(log)

    # ------------------------------------------------------------ receiving

    def drain(self) -> None:
        if self.after_drain is None:
            self._drain()
            return
        try:
            self._drain()
        finally:
            self.after_drain()

    def _drain(self) -> None:
        sock = self.sock
        for _ in range(self.max_batch):
            frames = recv_frames(sock)
            if frames is None:
                return
            self.dispatch(frames)
            # A one-item poll instead of reading until zmq.Again: the common
            # drain reads one message, and an exception per drain costs more.
            if sock.closed or not readable(sock):  # a handler may close its own socket (an engine forgotten)
                return

    def dispatch(self, frames: list[Any]) -> None:
        """Decode one message and run its handler; never raises for a bad frame
        or a handler's failure (the process outlives both)."""
        peer = frames[0].bytes if self.routed and frames else b""
        body = frames[1:] if self.routed else frames
        self.frames = body
        try:
            msg, buffers = self.codec.decode(body)
            handler = self.handlers.get(type(msg))
            if handler is None:
                raise ProtocolError(f"{type(msg).__name__} is not served on the {self.name} socket", field="kind")
            handler(peer, msg, buffers)
        except RolloutBusError as e:
            self.fail(peer, e.request_id or _rid_of(body), e.code, e.message, e.field)
        except Exception as e:  # a bug of ours: answer it, keep serving
            log.exception("handler_crashed", socket=self.name)
            self.fail(peer, _rid_of(body), ErrorCode.INTERNAL, truncate(f"{type(e).__name__}: {e}"), None)
        finally:
            self.frames = []

    # ------------------------------------------------------------ sending

    def send(self, peer: bytes, msg: Any, buffers: Sequence[Any] = ()) -> bool:
        """Encode and send `msg` (+ its raw frames) to `peer`; False when the
        peer is gone or (with `on_peer_full`) over its high-water mark."""
        # Hot path (every chunk an engine sends): the codec's encoder and
        # send_multipart's loop inlined here, in one call; a routed message
        # with one small buffer (a chunk and its token frame) is unrolled.
        try:
            body = self._encode(msg)
        except ENCODE_ERRORS as e:
            return self._unencodable(peer, msg, encode_failed(msg, e))
        sock, flags, more = self.sock, self._flags, self._more
        try:
            if self.routed and len(buffers) == 1:
                b = buffers[0]
                if type(b) is bytes and len(b) < ZERO_COPY_MIN:
                    _raw_send(sock, peer, more, True, False)
                    _raw_send(sock, body, more, True, False)
                    _raw_send(sock, b, flags, True, False)
                    return True
            frames = [peer, body, *buffers] if self.routed else [body, *buffers]
            last = len(frames) - 1
            for i, f in enumerate(frames):
                _raw_send(sock, f, more if i < last else flags, type(f) is not bytes or len(f) < ZERO_COPY_MIN, False)
        except zmq.ZMQError as e:
            return self._not_sent(peer, e)
        return True

    def _unencodable(self, peer: bytes, msg: Any, e: EncodeFailed) -> bool:
        """Never a crash: the requests `msg` answered end with a typed error
        instead (an Error that cannot be encoded: logged)."""
        log.error("encode_failed", socket=self.name, error=e.message)
        if isinstance(msg, P.Error):
            return False
        for rid in _request_ids(msg):
            self.send(peer, error_message(rid, ErrorCode.INTERNAL, e.message, None))
        return False

    def send_frames(self, frames: list[Any]) -> bool:
        """Send ready frames (routing frame included), as `send` does."""
        try:
            send_multipart(self.sock, frames, self._flags)
        except zmq.ZMQError as e:
            return self._not_sent(bytes(frames[0]) if self.routed else b"", e)
        return True

    def _not_sent(self, peer: bytes, e: zmq.ZMQError) -> bool:
        """A send failed: a peer over its HWM (with `on_peer_full`) or gone
        (ROUTER_MANDATORY) is reported and False returned; anything else raises."""
        if isinstance(e, zmq.Again):
            full = self.on_peer_full
            if full is None:
                raise e
            full(peer if self.routed else b"")
            return False
        if e.errno != zmq.EHOSTUNREACH:
            raise e
        self.on_peer_gone(peer)
        return False

    def fail(self, peer: bytes, rid: str, code: ErrorCode, message: str, field: str | None) -> None:
        """The typed reply to a failed request: what was produced before goes first."""
        c = self.counters
        if self.error_reply is None:
            c["bad_messages"] = c.get("bad_messages", 0) + 1
            self.refusals.refused(
                "bad_message", socket=self.name, code=code.value, error=truncate(message, 200), field=field
            )
            return
        self.before_error()
        c["request_errors"] = c.get("request_errors", 0) + 1
        self.refusals.refused(
            "request_error", "info", kind=f"request_error.{code.value}", socket=self.name, request_id=rid[:128], code=code.value,
            field=field, error=truncate(message, 200),
        )  # fmt: skip
        self.send(peer, self.error_reply(rid, code, message, field))

    def close(self) -> None:
        self.sock.close(linger=0)


def _rid_of(body: Sequence[Any]) -> str:
    return request_id_of([bytes(body[0])]) if body else ""
