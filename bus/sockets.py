"""Socket helpers: every option that matters is set explicitly.

Ownership: a socket belongs to the one thread (or asyncio loop) that made it.
Close with linger=0 before the context is terminated.
"""

from __future__ import annotations

import os
import re
import tempfile
import uuid
from collections.abc import Callable

import zmq

from bus.errors import BadRequest
from bus.roles import Plain

# Hard cap enforced by libzmq: a larger message makes libzmq drop the
# connection (no reply is possible), so it sits well above the application
# limits (max prompt tokens, weight bucket size), which do get a typed Error.
MAX_MSG_BYTES = 2 << 30
# High-water marks (messages queued per peer, each direction): every socket
# has explicit, finite ones (issue 22: a peer that never reads must not grow
# our memory without bound). Data plane: a chunk must never be dropped, so a
# full pipe BLOCKS the sender (an engine waits for a slow head: backpressure)
# except on the head's frontend, which must never block its loop: there a
# client over its HWM (RouterConfig.client_hwm) has its requests cancelled
# (bus/endpoint.py on_peer_full, router_node/router.py).
DATA_HWM = 100_000
CONTROL_HWM = 100_000


def make_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    hwm: int = DATA_HWM,
    maxmsgsize: int = MAX_MSG_BYTES,
    router_mandatory: bool = True,
    identity: bytes | None = None,
    subscribe: list[bytes] | None = None,
    curve: CurveKeys | None = None,
    curve_server: bool = False,
    zap_domain: str | None = None,
    plain: Plain | None = None,
    before_connect: Callable[[zmq.Socket], object] | None = None,
) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, hwm)
    s.setsockopt(zmq.RCVHWM, hwm)
    s.setsockopt(zmq.MAXMSGSIZE, maxmsgsize)
    if kind == zmq.ROUTER and router_mandatory:
        # Sending to an unknown/gone peer raises EHOSTUNREACH instead of
        # silently dropping: the caller decides (usually: the client left).
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if identity is not None:
        s.setsockopt(zmq.IDENTITY, identity)
    if curve is not None:
        curve.apply(s, server=curve_server, zap_domain=zap_domain)
    elif plain is not None:
        plain.apply(s, zap_domain)
    for topic in subscribe or ():
        s.setsockopt(zmq.SUBSCRIBE, topic)
    if before_connect is not None:
        before_connect(s)
    if bind:
        s.bind(bind)
    if connect:
        s.connect(connect)
    return s


class CurveKeys:
    """One side's CURVE keys (bus/auth.py's KeyDir loads them by role).

    `server_public`: the key of the server this side connects to (the head's
    for engines and clients; an engine's own key, from its Register, for the
    head and trainers connecting to engine sockets). A binding side is a CURVE
    server and names its ZAP domain: the allow-list its peers are checked
    against (bus/auth.py's Gatekeeper)."""

    def __init__(self, public: bytes, secret: bytes, server_public: bytes | None = None) -> None:
        self.public = public
        self.secret = secret
        self.server_public = server_public

    def connecting_to(self, server_public: bytes) -> CurveKeys:
        return CurveKeys(self.public, self.secret, server_public)

    def apply(self, s: zmq.Socket, *, server: bool, zap_domain: str | None = None) -> None:
        s.curve_secretkey = self.secret
        s.curve_publickey = self.public
        if server:
            if not zap_domain:
                # No domain: libzmq would let any key that knows ours in.
                raise ValueError("a CURVE server socket needs a ZAP domain (its allow-list)")
            s.zap_domain = zap_domain.encode()
            s.curve_server = True
        else:
            if self.server_public is None:
                raise ValueError("a CURVE client socket needs the server's public key")
            s.curve_serverkey = self.server_public


_TCP_ENDPOINT = re.compile(r"^tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
# An IPC path is absolute (or abstract, "@name"): a relative one names a file
# wherever the connecting process happens to run (issue 34 row 14).
_IPC_ENDPOINT = re.compile(r"^ipc://[/@][^\x00]{1,200}$")


def check_endpoint(address: str, *, field: str) -> str:
    """A peer-supplied address we are about to connect to: `tcp://host:port`
    or `ipc://path`, nothing else (no wildcard, no inproc). zmq would accept
    some junk lazily and fail later, or raise inside the caller's loop."""
    m = _TCP_ENDPOINT.match(address)
    if m is not None:
        if m.group(1) in ("*", "0.0.0.0", "[::]") or not 0 < int(m.group(2)) < 65536:
            raise BadRequest(f"{address!r} is not an address a peer can connect to", field=field)
        return address
    if _IPC_ENDPOINT.match(address):
        return address
    raise BadRequest(f"{address!r} is not a tcp://host:port or ipc://path endpoint", field=field)


def ipc_dir() -> str:
    """A private folder for this run's IPC endpoints (paths must stay short)."""
    d = os.path.join(tempfile.gettempdir(), f"rbus-{uuid.uuid4().hex[:8]}")
    os.makedirs(d, mode=0o700, exist_ok=True)  # IPC is never CURVE: the folder's mode guards it
    return d


def bound_address(s: zmq.Socket) -> str:
    """The concrete endpoint after binding `tcp://host:*` (port resolved)."""
    return s.getsockopt_string(zmq.LAST_ENDPOINT)
