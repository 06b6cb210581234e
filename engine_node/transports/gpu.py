"""What the GPU transports (cuda_ipc, nccl) share on the engine side: the
bytes never pass the node; the backend pulls them (receive_weights for one
sender, receive_part per sender of a streamed update). One sender's begin may
carry `prepare=True`: begin + receive + prepare in one op, the ack is the vote
(two round trips per update)."""

from __future__ import annotations

from typing import Any, ClassVar

from bus import protocol as P
from bus.errors import BadRequest
from bus.transport import Transport, backend_args
from engine_node.core import Pending
from engine_node.transports.base import Record, Txn


class OutOfBandReceiver:
    transport: ClassVar[Transport]
    out_of_band: ClassVar[bool] = True
    takes_lora: ClassVar[bool] = False

    def begin_model(self, txn: Txn, up: Record, result: P.BeginWeightsResult) -> Any:
        op = up.begin
        if op.streamed:
            return self._begin_parts(txn, up, result)
        args = backend_args(op.transport_args, list(op.bucket_sizes))
        bop = txn.backend.begin_weight_update(op.update_id, op.transport, list(op.tensors), args)
        if op.prepare:
            return txn.begin_receive_prepare(up, bop, list(op.handles))
        return txn.begun(up, bop, result)

    def _begin_parts(self, txn: Txn, up: Record, result: P.BeginWeightsResult) -> Any:
        # Every sender's ReceiveWeights carries its own metas, sizes and
        # handles / NCCL group; the backend appends each part.
        op = up.begin
        if getattr(txn.backend, "receive_part", None) is None:
            txn.drop(up, "GPU parts not supported")
            raise BadRequest(
                f"the {txn.core.info.backend} backend takes several GPU senders' parts only over zmq",
                field="transport",
            )
        bop = txn.backend.begin_weight_update(op.update_id, op.transport, [], backend_args(op.transport_args, []))
        return Pending(bop, lambda _r: result, lambda e: txn.drop(up, f"begin failed: {e}"))
