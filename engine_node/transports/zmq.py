"""The zmq transport, engine side: buckets arrive as raw frames on the node's
weight socket (engine_node/weight_update.py on_bucket / on_sender_end); the
node stages them into the backend, or holds them until the prepare when the
update is streamed (the tensor list is only known once every sender ended)."""

from __future__ import annotations

from typing import Any, ClassVar

from bus import protocol as P
from bus.transport import Transport, backend_args
from engine_node.transports.base import Record, Txn


class ZmqReceiver:
    transport: ClassVar[Transport] = Transport.ZMQ
    out_of_band: ClassVar[bool] = False
    takes_lora: ClassVar[bool] = True

    def begin_model(self, txn: Txn, up: Record, result: P.BeginWeightsResult) -> Any:
        op = up.begin
        if op.streamed:
            up.backend_open = False
            return result  # the backend begins at prepare, when every tensor is known
        args = backend_args(op.transport_args, list(op.bucket_sizes))
        bop = txn.backend.begin_weight_update(op.update_id, op.transport, list(op.tensors), args)
        return txn.begun(up, bop, result)
