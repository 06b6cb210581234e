"""SkyRL's broadcast weight sync on rollout-bus (what `RolloutBusEngine` runs
for SkyRL's own `BroadcastTransferStrategy`: weight_sync_backend="nccl"
without placement.colocate_all), over the vllm_nccl transport
(trainer_bridge/transports/vllm_nccl.py).

SkyRL's order, and what each call does here:

    create_sender (a thread: NCCLWeightTransferEngine.trainer_init, rank 0)
      CONCURRENTLY init_weight_update_communicator(BroadcastInitInfo)
        → `join`: an empty transaction (begin, ReceiveWeights, abort) in whose
          receive every engine worker joins the trainer's group at
          rank_offset + the workers of the engines before it + its own rank;
          no weights, no version change
    start_weight_update(is_checkpoint_format=True)
    update_weights_nccl({names, dtype_names, shapes, packed: True}) as a task,
      CONCURRENTLY trainer_send_weights on a thread (SkyRL's own broadcast)
        → `open_update`: ONE begin (prepare=True) with vLLM's packed chunks
          as its buckets; each engine receives them with vLLM's packed
          consumer into its staging buffers and votes; nothing live changes
    finish_weight_update()
        → the head commits: every engine at version + 1, or none (an engine
          that refused or failed aborts the update everywhere: old weights)

Hazard (SkyRL's design, as with vLLM's own server): the trainer broadcasts
whatever the engines do. If the engines refuse the begin (an unknown tensor
name, another update holding the cluster), update_weights_nccl raises but
SkyRL's sending thread stays inside NCCL waiting for receivers: SkyRL awaits
that thread before the task, so the error surfaces only when its NCCL call
gives up. Tensor names are checked by the engines at the begin, so such a
refusal is a configuration error seen on the first update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import msgspec

from bus import protocol as P
from bus.errors import BadRequest, ControlError, Unsupported
from bus.transport import Transport, VllmNcclArgs
from trainer_bridge.transports.vllm_nccl import DEFAULT_BUFFER_BYTES, DEFAULT_NUM_BUFFERS, group_args, packed_plan
from trainer_bridge.update_ids import learn_update_id
from trainer_bridge.weights import WeightUpdate

GPU_BACKENDS = ("vllm",)  # backends whose workers join a vLLM NCCL group

_NOT_ON_BACKEND = (
    "SkyRL's weight_sync_backend='nccl' (BroadcastInitInfo: a NCCL group between the trainer's GPU and the "
    "engines' GPUs) needs engines on the vllm backend; engine(s) {bad} run {backends}: set "
    "generator.inference_engine.weight_sync_backend to anything but 'nccl' and send the weights with "
    "rollout-bus's zmq transport (trainer_bridge.skyrl.weights.get_transfer_strategy_cls in place of SkyRL's, "
    "or engine.update_named_weights(tensors))"
)


@dataclasses.dataclass
class BroadcastGroup:
    """SkyRL's group as the engines join it (set by init_weight_update_communicator)."""

    args: VllmNcclArgs
    engines: list[P.EngineView]
    timeout_s: float


async def updatable_engines(client: Any) -> list[P.EngineView]:
    h = await client.health_view()
    learn_update_id(client, h)  # the head binds update ids: the next begin takes this one
    engines = [e for e in h.engines.values() if e.healthy or e.stale]
    if not engines:
        raise ControlError("no healthy engine to join SkyRL's NCCL group with")
    return engines


def check_backends(engines: list[P.EngineView]) -> None:
    """Unsupported naming weight_sync_backend when an engine cannot join."""
    bad = [e for e in engines if e.backend not in GPU_BACKENDS]
    if bad:
        raise Unsupported(
            _NOT_ON_BACKEND.format(
                bad=", ".join(e.engine_id for e in bad[:8]), backends=", ".join(sorted({e.backend for e in bad}))
            ),
            field="weight_sync_backend",
        )


def group_of(init_info: Any, engines: list[P.EngineView], timeout_s: float) -> BroadcastGroup:
    """SkyRL's BroadcastInitInfo (master_addr, master_port, rank_offset,
    world_size) as the engines' group args."""
    args = group_args(
        init_info.master_addr,
        init_info.master_port,
        init_info.world_size,
        engines,
        first=int(init_info.rank_offset),
        timeout_s=timeout_s,
    )
    return BroadcastGroup(args, engines, timeout_s)


def _update(client: Any, g: BroadcastGroup) -> WeightUpdate:
    upd = WeightUpdate(client, transport=Transport.VLLM_NCCL.value, timeout_s=g.timeout_s)
    upd.engines = list(g.engines)  # the ranks were given to these engines: no other set
    return upd


async def join(client: Any, g: BroadcastGroup) -> dict[str, Any]:
    """Every engine worker joins the trainer's group (see the module doc).
    Returns each engine's receive detail (its rank, set-up time)."""
    upd = _update(client, g)
    await upd.open(begin=P.BeginWeightUpdate(upd.update_id, Transport.VLLM_NCCL, [], [], transport_args=g.args))
    try:
        res = await client.control(P.ReceiveWeights(upd.update_id), targets=upd.engine_ids, timeout_s=g.timeout_s)
    finally:
        await upd.abort()  # nothing staged; the group stays joined
    return {eid: getattr(r, "detail", None) for eid, r in (res or {}).items()}


def _info(update_info: Mapping[str, Any]) -> tuple[list[Any], list[Any], list[Any], int, int]:
    for k in ("names", "dtype_names", "shapes"):
        if not isinstance(update_info.get(k), (list, tuple)):
            raise BadRequest(f"update_info needs a list {k!r} (SkyRL's weight metadata)", field=f"update_info.{k}")
    if update_info.get("packed") is not True:
        raise BadRequest(
            "update_info.packed must be True: rollout-bus engines receive vLLM's packed broadcast "
            "(SkyRL's broadcast sender always packs)",
            field="update_info.packed",
        )
    buffer = int(update_info.get("packed_buffer_size_bytes") or DEFAULT_BUFFER_BYTES)
    num = int(update_info.get("packed_num_buffers") or DEFAULT_NUM_BUFFERS)
    return list(update_info["names"]), list(update_info["dtype_names"]), list(update_info["shapes"]), buffer, num


async def open_update(client: Any, g: BroadcastGroup, update_info: Mapping[str, Any]) -> tuple[WeightUpdate, Any]:
    """ONE begin (+ receive + prepare) of the whole broadcast: returns the
    opened update (its commit is finish_weight_update's) and a summary. On
    any failure the update is aborted on every engine (old weights)."""
    names, dtypes, shapes, buffer, num = _info(update_info)
    metas, sizes = packed_plan(names, dtypes, shapes, buffer)
    args = msgspec.structs.replace(g.args, packed_buffer_size_bytes=buffer, packed_num_buffers=num)
    upd = _update(client, g)
    begin = P.BeginWeightUpdate(upd.update_id, Transport.VLLM_NCCL, metas, sizes, transport_args=args, prepare=True)
    await upd.open(begin=begin)  # returns once every engine received and voted (aborts on failure)
    return upd, {"update_id": upd.update_id, "tensors": len(metas), "chunks": len(sizes), "bytes": int(sum(sizes))}
