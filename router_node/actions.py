"""What the forwarding core (router_node/forwarding_core.py) asks its shell
(router_node/forwarding.py) to do: typed, I/O-free values, executed in order.

Hazards: order is meaning. Chunks for a client go out in the order of their
actions, and a `FailRequest` goes out after every chunk before it (the shell
flushes its outbox first). A `SendToEngine` of a Generate whose leg has left the
ledger by the time it is executed (an earlier send of the same batch failed)
is not sent.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bus import protocol as P
from bus.errors import ErrorCode


@dataclasses.dataclass(frozen=True, slots=True)
class SendToEngine:
    """A Generate (a leg, its prompt frame in `buffers`) or a Cancel to one engine."""

    engine_id: str
    msg: P.Generate | P.Cancel
    buffers: tuple[Any, ...] = ()
    # Never block the loop on it: a Cancel to an engine that died or hung
    # (its queue may be full); lost, it changes nothing.
    nonblock: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class SendToClient:
    """A chunk for a client, batched with the others of this turn (bus.codec.Outbox)."""

    client: bytes
    chunk: P.Chunk
    buffers: list[Any]


@dataclasses.dataclass(frozen=True, slots=True)
class RelayToClient:
    """An engine's chunk message as it came (the fast path: no re-encoding
    when it leaves alone); `chunk` and `buffers` are the same chunk decoded,
    for when it leaves in one batch with others for the same client."""

    client: bytes
    frames: list[Any]
    chunk: P.Chunk
    buffers: list[Any]


@dataclasses.dataclass(frozen=True, slots=True)
class FailRequest:
    """The one typed Error that ends a client's request."""

    client: bytes
    request_id: str
    code: ErrorCode
    message: str
    field: str | None = None


Action = SendToEngine | SendToClient | RelayToClient | FailRequest
