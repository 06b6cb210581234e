"""What a receiver sees of the engine's weight-update transaction.

A receiver (one per transport, registered in engine_node/transports/registry.py)
decides how a `BeginWeightUpdate` of its transport opens the backend's
transaction; the transaction itself (phases, votes, deadlines, aborts) stays
in engine_node/weight_update.py, which calls the receiver through `Txn`.
This module imports nothing of weight_update: the receivers and the
transaction know each other only through these protocols (no import cycle).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from bus import protocol as P
from bus.transport import Transport


class Record(Protocol):
    """One update of the transaction (engine_node.weight_update.WeightUpdate)."""

    begin: P.BeginWeightUpdate
    backend_open: bool


class Txn(Protocol):
    """The engine's transaction (engine_node.weight_update.WeightUpdates)."""

    backend: Any
    core: Any
    engine_id: str

    def drop(self, up: Any, why: str) -> None:
        """The backend refused the begin: forget the update (nothing is staged)."""

    def begun(self, up: Any, bop: Any, result: P.BeginWeightsResult) -> Any:
        """The begin's ack once the backend's begin finished (detail = its result)."""

    def begin_receive_prepare(self, up: Any, bop: Any, handles: list[Any]) -> Any:
        """Begin + receive + prepare in one op: the ack is the engine's vote."""


class Receiver(Protocol):
    """How the bytes of one transport reach the engine.

    out_of_band: the bytes arrive through the backend (its receive_weights /
    receive_part pulls them: IPC handles, a broadcast), never as frames on the
    node's weight socket; a streamed update over it is a set of sender parts,
    one ReceiveWeights each. takes_lora: the node itself sees the bytes, so
    it can keep a LoRA adapter's tensors (target "lora:NAME")."""

    transport: ClassVar[Transport]
    out_of_band: ClassVar[bool]
    takes_lora: ClassVar[bool]

    def begin_model(self, txn: Txn, up: Record, result: P.BeginWeightsResult) -> Any:
        """Open the backend's transaction for a model update; returns the ack
        (a result or a Pending)."""
