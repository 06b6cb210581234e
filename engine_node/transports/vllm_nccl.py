"""The vllm_nccl transport, engine side: the engine's workers join the
trainer's own vLLM NCCL weight-transfer group (SkyRL's broadcast strategy) and
receive its packed broadcast into their staging buffers inside the receive
(trainer_bridge/transports/vllm_nccl.py has the protocol). One sender only.

The begin names every engine's first rank (`rank_offsets`); this engine's is
resolved here, so the backend sees a plain `rank_offset` as in vLLM's
NCCLWeightTransferInitInfo."""

from __future__ import annotations

from typing import Any, ClassVar

from bus import protocol as P
from bus.errors import BadRequest
from bus.transport import Transport, backend_args
from engine_node.transports.base import Record, Txn
from engine_node.transports.gpu import OutOfBandReceiver


def engine_args(op: P.BeginWeightUpdate, engine_id: str) -> dict[str, Any]:
    """The backend's args of this engine: its own rank_offset instead of the
    map. BadRequest naming transport_args.rank_offsets when it is not named."""
    args = backend_args(op.transport_args, list(op.bucket_sizes))
    offsets = args.pop("rank_offsets", None) or {}
    if engine_id not in offsets:
        raise BadRequest(
            f"the vllm_nccl group gives no rank to engine {engine_id!r} (it names {sorted(offsets)[:8]}): "
            "the init info was made for another set of engines",
            field="transport_args.rank_offsets",
        )
    args["rank_offset"] = int(offsets[engine_id])
    return args


class VllmNcclReceiver(OutOfBandReceiver):
    transport: ClassVar[Transport] = Transport.VLLM_NCCL

    def begin_model(self, txn: Txn, up: Record, result: P.BeginWeightsResult) -> Any:
        op = up.begin
        try:
            if op.streamed or op.senders != 1:
                raise BadRequest("vllm_nccl has one sender (the trainer's rank 0) and a planned begin", field="senders")
            args = engine_args(op, txn.engine_id)
        except BadRequest as e:
            txn.drop(up, str(e))  # nothing began: no update stays open
            raise
        bop = txn.backend.begin_weight_update(op.update_id, op.transport, list(op.tensors), args)
        if op.prepare:
            return txn.begin_receive_prepare(up, bop, list(op.handles))
        return txn.begun(up, bop, result)
