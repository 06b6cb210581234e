"""The cuda_ipc transport, engine side: the begin (one sender) or each
sender's ReceiveWeights (several) carries one IPC handle per bucket of the
trainer's GPU memory; the vLLM backend maps them at the commit."""

from __future__ import annotations

from typing import ClassVar

from bus.transport import Transport
from engine_node.transports.gpu import OutOfBandReceiver


class CudaIpcReceiver(OutOfBandReceiver):
    transport: ClassVar[Transport] = Transport.CUDA_IPC
