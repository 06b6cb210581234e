"""The nccl transport, engine side: the engines' workers receive a broadcast
from the trainer (rank 0 of the group named by NcclArgs) inside the receive,
which blocks until every bucket arrived."""

from __future__ import annotations

from typing import ClassVar

from bus.transport import Transport
from engine_node.transports.gpu import OutOfBandReceiver


class NcclReceiver(OutOfBandReceiver):
    transport: ClassVar[Transport] = Transport.NCCL
