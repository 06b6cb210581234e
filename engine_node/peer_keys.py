"""Security on: re-checking a peer's CURVE key on every data / weight frame.

ZAP checks a key once, at the handshake. A key taken off the socket's
allow-list later (bus/auth.py; the Gatekeeper re-reads it at each tick) must
stop being served on connections it already opened: `keyed` wraps a socket
handler so such a frame is refused with a typed Unauthorized naming
`client_key`, answered by the socket's Endpoint like any refusal.

Ownership: the node's loop thread (the handlers run inside Endpoint.drain).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bus import auth
from bus.errors import Unauthorized

Handler = Callable[[bytes, Any, list[Any]], None]


def keyed(gate: auth.Gatekeeper | None, domain: str, frames_of: Callable[[], list[Any]], handler: Handler) -> Handler:
    """`handler`, refusing frames whose key left `domain`'s allow-list (security off: as is).
    `frames_of()` gives the frames being handled (the Endpoint's `frames`)."""
    if gate is None:
        return handler

    def run(peer: bytes, msg: Any, buffers: list[Any]) -> None:
        frames = frames_of()
        key = auth.peer_key(frames[0]) if frames else None
        if key is not None and not gate.allows(domain, key.encode()):
            raise Unauthorized(
                f"key {key} was removed from this engine's allow-list",
                request_id=getattr(msg, "request_id", None),
                field="client_key",
            )
        handler(peer, msg, buffers)

    return run
