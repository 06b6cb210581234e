"""The vllm_nccl transport, trainer side: vLLM's own NCCL weight-transfer
protocol (`NCCLWeightTransferEngine`, packed), whose group and broadcast belong
to the trainer's framework (SkyRL's BroadcastTransferStrategy: its rank 0 calls
`NCCLWeightTransferEngine.trainer_init` and `trainer_send_weights`). rollout-bus
sends no byte of it: this module only describes the update to the engines.

    rank_offsets(engines, first)   each engine's first rank (SkyRL's for_servers:
                                   rank_offset + the workers of the engines before it)
    packed_plan(names, dtype_names, shapes, buffer_size_bytes)
                                   the metas / bucket sizes of vLLM's packed chunks:
                                   bucket i = the i-th broadcast, its tensors back to
                                   back (no padding), as packed_tensor.pack_tensors cuts
                                   them (a chunk closes after the tensor that takes it
                                   PAST buffer_size_bytes)
    group_args(...)                the VllmNcclArgs the engines join the group with

The engine side (engine_node/transports/vllm_nccl.py, the vLLM backend's
vllm/worker_packed.py) joins the group as vLLM's receiver does
(StatelessProcessGroup.create at rank_offset + worker rank) and receives with
vLLM's packed consumer into its staging buffers; the commit is the nccl
transport's. The flow that drives it is trainer_bridge/skyrl/broadcast.py.

SENDERS entry: refuses (`update_weights(transport="vllm_nccl")` has no bytes to
send: the broadcast is the trainer's own).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from bus import protocol as P
from bus.errors import BadRequest, Unsupported
from bus.tensors import ITEMSIZE
from bus.transport import VllmNcclArgs

# vLLM 0.24's packed_tensor defaults (DEFAULT_PACKED_BUFFER_SIZE_BYTES / _NUM_BUFFERS)
DEFAULT_BUFFER_BYTES = 1 << 30
DEFAULT_NUM_BUFFERS = 2


def dtype_name(d: Any, field: str = "update_info.dtype_names") -> str:
    """ "bfloat16" from "bfloat16", "torch.bfloat16" or torch.bfloat16;
    BadRequest naming `field` for a dtype vLLM's receiver cannot build."""
    name = str(d).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise BadRequest(f"dtype {d!r} is not one vLLM's packed receiver takes ({', '.join(ITEMSIZE)})", field=field)
    return name


def packed_plan(
    names: Sequence[str],
    dtype_names: Sequence[Any],
    shapes: Sequence[Sequence[int]],
    buffer_size_bytes: int = DEFAULT_BUFFER_BYTES,
) -> tuple[list[P.TensorMeta], list[int]]:
    """(metas, bucket sizes) of vLLM's packed broadcast of these tensors, in
    this order: one bucket per broadcast (see the module doc)."""
    if not len(names) == len(dtype_names) == len(shapes):
        raise BadRequest(
            f"{len(names)} names, {len(dtype_names)} dtype_names, {len(shapes)} shapes: they must be as many",
            field="update_info.names",
        )
    if buffer_size_bytes < 1:
        raise BadRequest("packed_buffer_size_bytes must be >= 1", field="update_info.packed_buffer_size_bytes")
    metas: list[P.TensorMeta] = []
    sizes: list[int] = []
    used = 0
    for name, d, shape in zip(names, dtype_names, shapes, strict=True):
        dt = dtype_name(d)
        dims = [int(x) for x in shape]
        if any(x < 0 for x in dims):
            raise BadRequest(f"tensor {name!r}: bad shape {list(shape)}", field="update_info.shapes")
        nbytes = math.prod(dims) * ITEMSIZE[dt]
        metas.append(P.TensorMeta(str(name), dt, dims, len(sizes), used, nbytes))
        used += nbytes
        if used > buffer_size_bytes:  # the producer flushes here (pack_tensors)
            sizes.append(used)
            used = 0
    if metas and metas[-1].bucket == len(sizes):  # the last, partly filled chunk
        sizes.append(used)
    return metas, sizes


def rank_offsets(engines: Iterable[P.EngineView], first: int = 1) -> dict[str, int]:
    """Each engine's first rank: `first` (the init info's rank_offset) plus
    the workers (tp x pp x dp) of the engines before it, in engine-id order —
    SkyRL's `BroadcastInitInfo.for_servers` (equal workers per engine: engine
    index x workers per engine)."""
    out: dict[str, int] = {}
    rank = int(first)
    for e in sorted(engines, key=lambda e: e.engine_id):
        out[e.engine_id] = rank
        rank += (e.tp or 1) * (e.pp or 1) * (e.dp or 1)
    return out


def workers(engines: Iterable[P.EngineView]) -> int:
    return sum((e.tp or 1) * (e.pp or 1) * (e.dp or 1) for e in engines)


def group_args(
    host: str,
    port: int,
    world_size: int,
    engines: Sequence[P.EngineView],
    *,
    first: int = 1,
    timeout_s: float | None = None,
    buffer_size_bytes: int = DEFAULT_BUFFER_BYTES,
    num_buffers: int = DEFAULT_NUM_BUFFERS,
) -> VllmNcclArgs:
    """The args every engine joins the trainer's group with. BadRequest
    naming world_size when the group cannot hold these engines' workers."""
    need = first + workers(engines)
    if int(world_size) != need:
        raise BadRequest(
            f"world_size {world_size} but the trainer's ranks 0..{first - 1} plus {workers(engines)} engine "
            f"worker(s) make {need}: the init info was made for another set of engines",
            field="world_size",
        )
    return VllmNcclArgs(
        host=str(host),
        port=int(port),
        world_size=int(world_size),
        rank_offsets=rank_offsets(engines, first),
        group_id=f"vllm:{host}:{port}",
        timeout_s=timeout_s,
        packed_buffer_size_bytes=int(buffer_size_bytes),
        packed_num_buffers=int(num_buffers),
    )


_NO_SEND = (
    "the vllm_nccl transport carries no bytes from rollout-bus: the trainer broadcasts with vLLM's "
    "NCCLWeightTransferEngine itself (SkyRL's BroadcastTransferStrategy, through "
    "trainer_bridge.skyrl.RolloutBusEngine.update_weights_nccl); to send tensors use transport='nccl'"
)


class VllmNcclKind:
    """The SENDERS entry: nothing to send (see the module doc)."""

    takes_plan = False

    def part_sender(self, client: Any, update_id: str, rank: int, engines: list[P.EngineView], **kw: Any) -> Any:
        raise Unsupported(_NO_SEND, field="transport")

    async def push(self, upd: Any, named: Iterable[tuple[str, Any]], options: dict[str, Any]) -> dict[str, Any]:
        raise Unsupported(_NO_SEND, field="transport")


KIND = VllmNcclKind()
