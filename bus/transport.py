"""The weight transports: their names and their typed arguments on the wire.

A transport is one member of `Transport` (str-valued: the wire strings are
"zmq", "cuda_ipc", "nccl", "vllm_nccl"). Its arguments travel in
`BeginWeightUpdate.transport_args` / `ReceiveWeights.transport_args` as ONE
tagged Struct of `TransportArgs`, its tag the transport's name, so a bad
argument is refused at decode naming the field.

Where each transport lives (adding one = one module on each side plus its
registration):
- trainer side: `trainer_bridge/transports/<name>.py`, registered in
  `trainer_bridge/transports/registry.py` (SENDERS);
- engine side: `engine_node/transports/<name>.py`, registered in
  `engine_node/transports/registry.py` (RECEIVERS);
- here: the enum member and its args Struct (a member of `TransportArgs`).

Backends receive the arguments as a plain dict (`backend_args`): the vLLM
worker extension runs in vLLM's worker processes and takes builtins.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from bus.errors import BadRequest


class Transport(str, enum.Enum):
    ZMQ = "zmq"  # raw frames to every engine's weight socket (CPU, across machines, CI)
    CUDA_IPC = "cuda_ipc"  # IPC handles of the trainer's GPU buffers (same GPU(s))
    NCCL = "nccl"  # a broadcast from the trainer, rank 0 of one NCCL group
    # vLLM's own NCCL weight-transfer protocol (NCCLWeightTransferEngine, packed): the
    # trainer's group and broadcast are its own (SkyRL's BroadcastTransferStrategy);
    # rollout-bus only joins the group and stages what arrives (trainer_bridge/skyrl/broadcast.py)
    VLLM_NCCL = "vllm_nccl"

    def __str__(self) -> str:
        return self.value


_Host = Annotated[str, Meta(max_length=4096)]
_GroupId = Annotated[str, Meta(max_length=256)]
_Port = Annotated[int, Meta(ge=0, le=65535)]
_World = Annotated[int, Meta(ge=2, le=1 << 20)]
_Rank = Annotated[int, Meta(ge=0, le=1 << 20)]
_Seconds = Annotated[float, Meta(ge=0.0, le=1e7)]
_EngineId = Annotated[str, Meta(max_length=256)]
_Bytes = Annotated[int, Meta(ge=1, le=1 << 50)]


class _Args(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False, kw_only=True):
    """Base of the per-transport args (tag = the transport's wire name)."""


class ZmqArgs(_Args, tag="zmq"):
    pass


class CudaIpcArgs(_Args, tag="cuda_ipc"):
    # The engines also run vLLM's load_weights and compare every parameter
    # with the fast write path (update_weights(weight_check=True); slow).
    weight_check: bool = False
    # Zero-copy mode: the handles name the trainer's own parameters and repeat
    # every update, so the engines keep their maps open.
    keep_maps: bool = False


class NcclArgs(_Args, tag="nccl"):
    host: _Host  # the trainer's TCPStore (rank 0 of the group)
    port: _Port
    world_size: _World  # the trainer plus every engine worker
    group_id: _GroupId
    timeout_s: _Seconds | None = None  # None: the engine's weight_timeout_s
    weight_check: bool = False
    # Engines take ranks 1.. from a counter in the store, or rank_offset + their worker rank.
    rank_offset: _Rank | None = None
    # A multi-sender part: this sender rank's own group (one communicator per rank).
    sender_group: bool = False
    # A token fresh per update: each engine worker adds 1 to the trainer store's
    # key "rollout_bus/in/<token>" as it enters the receive, BEFORE it joins
    # the group or the broadcast. The trainer broadcasts only once every worker
    # checked in, so an op refused anywhere never leaves it blocked in NCCL.
    # "" (old trainers): no check-in.
    check_in: _GroupId = ""
    # With check_in: the trainer's NaN/inf check runs on its GPU beside the
    # broadcast, and its verdict is put under "rollout_bus/ok/<token>" (b"ok", or
    # the first bad tensor's name). Each worker reads it after its last bucket
    # and refuses the update (nothing written) unless it is b"ok".
    verdict: bool = False


class VllmNcclArgs(_Args, tag="vllm_nccl"):
    host: _Host  # the trainer's TCPStore (vLLM's StatelessProcessGroup, rank 0)
    port: _Port
    world_size: _World  # the trainer plus every engine worker
    # Each engine's first rank in the group (engine id -> rank); a worker takes
    # that plus its own rank, as vLLM's init_transfer_engine does with rank_offset.
    rank_offsets: Annotated[dict[_EngineId, _Rank], Meta(max_length=1 << 16)]
    group_id: _GroupId
    timeout_s: _Seconds | None = None  # None: the engine's weight_timeout_s
    # vLLM's packed broadcast: chunks close past this many bytes (producer and consumer agree)
    packed_buffer_size_bytes: _Bytes = 1 << 30
    packed_num_buffers: Annotated[int, Meta(ge=1, le=64)] = 2


TransportArgs = ZmqArgs | CudaIpcArgs | NcclArgs | VllmNcclArgs

ARGS_OF: dict[Transport, type[_Args]] = {
    Transport.ZMQ: ZmqArgs,
    Transport.CUDA_IPC: CudaIpcArgs,
    Transport.NCCL: NcclArgs,
    Transport.VLLM_NCCL: VllmNcclArgs,
}


def parse_transport(value: Any, field: str = "transport") -> Transport:
    """`value` as a Transport; BadRequest naming `field` when it is none."""
    try:
        return Transport(value)
    except ValueError:
        names = ", ".join(t.value for t in Transport)
        raise BadRequest(f"unknown transport {value!r} ({names})", field=field) from None


def check_args(transport: Transport | str, args: TransportArgs | None) -> None:
    """BadRequest naming transport_args when `args` belong to another
    transport than `transport` (None: the transport's defaults)."""
    t = parse_transport(transport)
    if args is not None and not isinstance(args, ARGS_OF[t]):
        raise BadRequest(
            f"transport_args are {type(args).__name__}, transport {t.value!r} takes {ARGS_OF[t].__name__}",
            field="transport_args",
        )


def backend_args(args: TransportArgs | None, bucket_sizes: list[int]) -> dict[str, Any]:
    """What a backend's begin_weight_update / receive_part takes: the args'
    set fields as builtins, plus the bucket sizes."""
    out: dict[str, Any] = {}
    if args is not None:
        out = {k: v for k, v in msgspec.structs.asdict(args).items() if v is not None}
    out["bucket_sizes"] = [int(s) for s in bucket_sizes]
    return out
