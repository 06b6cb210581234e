"""What the engine node's I/O-free cores ask the shell to do: typed actions.

The request core (engine_node/request_flow.py and its gates) and the weight
transaction (engine_node/weight_update.py) never touch a socket. They append
actions to a list the shell (engine_node/node.py) takes after every event and
executes in order through a dispatch table keyed by the action's type:

  SendChunks(peer, msg, buffers)   a Chunk or a coalesced ChunkBatch for one peer
  SendError(peer, error)           the one Error that ends a request
  SendAck(seq, result | failure)   a control op's late ack (pause(wait), a
                                   prepare that waited for its senders)

A control handler's own outcome (engine_node/control.py runs them) is an
`OpOutcome`: the op's typed `P.*Result` (ack now), `Pending` (a BackendOp still
running: ack when it completes) or `DEFERRED` (a core acks it later with a
SendAck).

Hazard (ordering): an action list is ordered, and chunks produced before a
SendError or SendAck are flushed into the list before it (RequestFlow does
that), so no consumer sees an Error or a pause's ack overtake tokens.

One ack shape: `SendAck` carries either a typed result or a `P.EngineFailure`
(code, message, field), whoever produced it; `wire_ack` is the one place that
maps it onto the wire `P.Ack`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import msgspec

from bus import protocol as P
from bus.errors import ErrorCode, RolloutBusError
from engine_node.backend import BackendOp


class SendChunks(msgspec.Struct, frozen=True):
    """Chunks for one peer: a Chunk alone or a ChunkBatch (bus.codec.Outbox)."""

    peer: bytes
    msg: P.Chunk | P.ChunkBatch
    buffers: list[Any]


class SendError(msgspec.Struct, frozen=True):
    """The Error that ends a request (after every chunk produced before it)."""

    peer: bytes
    error: P.Error


class SendAck(msgspec.Struct, frozen=True):
    """A control op's ack: its result, or why it failed (never both)."""

    seq: int
    result: P.Result | None = None
    failure: P.EngineFailure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    @classmethod
    def done(cls, seq: int, result: P.Result | None = None) -> SendAck:
        return cls(seq, result if result is not None else P.Done())

    @classmethod
    def failed(cls, seq: int, e: BaseException) -> SendAck:
        return cls(seq, failure=failure_of(e))


Action = SendChunks | SendError | SendAck


@dataclasses.dataclass(eq=False)
class Pending:
    """A control op in progress: the shell acks with `then(op result)` when the
    op's future completes, or reports the error (calling `on_error` first, so the
    owner can roll its state back)."""

    op: BackendOp
    then: Callable[[dict[str, Any]], Any]  # the backend's dict -> the op's P.*Result
    on_error: Callable[[BaseException], object] | None = None


class Deferred:
    """The type of DEFERRED: "a core acks this op later" (a SendAck action)."""

    def __repr__(self) -> str:
        return "DEFERRED"


DEFERRED = Deferred()

OpOutcome = P.Result | Pending | Deferred


def failure_of(e: BaseException) -> P.EngineFailure:
    """Why a control op failed, typed: backend failures keep their own codes
    (backend_timeout naming the knob, backend_refused naming the field), never
    bad_request; an untyped ValueError is a backend's refusal of bad input."""
    if isinstance(e, RolloutBusError):  # BackendTimeout / BackendError included
        return P.EngineFailure(code=e.code.value, message=e.message, field=e.field)
    if isinstance(e, ValueError):
        return P.EngineFailure(code=ErrorCode.BACKEND_REFUSED.value, message=str(e))
    return P.EngineFailure(code=ErrorCode.INTERNAL.value, message=f"{type(e).__name__}: {e}")


def wire_ack(engine_id: str, a: SendAck) -> P.Ack:
    """The wire Ack of a SendAck (the only place that knows the Ack's layout)."""
    if a.failure is None:
        return P.Ack(seq=a.seq, engine_id=engine_id, result=a.result or P.Done())
    return P.Ack(seq=a.seq, engine_id=engine_id, failure=a.failure)
