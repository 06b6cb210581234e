"""RECEIVERS: the engine-side receiver of every transport, found by lookup.

Adding a transport: its member in bus/transport.py, a module here with its
receiver, and one line in this table."""

from __future__ import annotations

from typing import Any

from bus.errors import BadRequest
from bus.transport import Transport, check_args, parse_transport
from engine_node.transports.base import Receiver
from engine_node.transports.cuda_ipc import CudaIpcReceiver
from engine_node.transports.nccl import NcclReceiver
from engine_node.transports.vllm_nccl import VllmNcclReceiver
from engine_node.transports.zmq import ZmqReceiver

RECEIVERS: dict[Transport, Receiver] = {
    Transport.ZMQ: ZmqReceiver(),
    Transport.CUDA_IPC: CudaIpcReceiver(),
    Transport.NCCL: NcclReceiver(),
    Transport.VLLM_NCCL: VllmNcclReceiver(),
}


def receiver_for(transport: Any, args: Any = None) -> Receiver:
    """The receiver of `transport`; BadRequest naming transport (unknown) or
    transport_args (args of another transport)."""
    t = parse_transport(transport)
    r = RECEIVERS.get(t)
    if r is None:
        raise BadRequest(f"transport {t.value!r} has no receiver on this engine", field="transport")
    check_args(t, args)
    return r
