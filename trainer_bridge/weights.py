"""Weight transfer, trainer side: begin → buckets → finish.

zmq transport (CPU, across machines, CI): tensors are packed into flat
buckets (bus.tensors) and sent as raw frames, zero-copy, to each engine's
weight socket; each bucket is acked per engine before the next is sent, so
memory stays bounded at one bucket and a failure is seen at the bucket it
happened. GPU transports (cuda_ipc, nccl) live in trainer_bridge.gpu_transports.

Transaction: engines stage what they receive and apply it only at finish; any
failure before finish aborts the update everywhere (old weights, old version)
and the raised ControlError names the engine and the tensor.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any

from bus import protocol as P
from bus.codec import Codec
from bus.endpoint import open_socket
from bus.errors import ControlError, ErrorCode, RequestTimeout
from bus.sockets import CurveKeys
from bus.tensors import DEFAULT_BUCKET_BYTES, pack_bucket, plan_buckets

if TYPE_CHECKING:
    from trainer_bridge.client import AsyncClient

GPU_TRANSPORTS = ("cuda_ipc", "nccl")


async def push_weights(
    client: AsyncClient,
    named: list[tuple[str, Any]],
    *,
    transport: str,
    bucket_bytes: int | None,
    targets: list[str] | None,
    timeout_s: float,
    options: dict[str, Any],
    target: str = "model",
    extra_args: dict[str, Any] | None = None,
    version: int | None = None,
) -> dict[str, Any]:
    """`version`: the weight version the engines take at commit (a model
    update). None: one above everything the cluster has served (the head's
    cluster version and every engine's), so versions never repeat or go back,
    and stale engines that take part jump to it."""
    if transport not in ("zmq", *GPU_TRANSPORTS):
        raise ValueError(f"unknown transport {transport!r} (zmq, cuda_ipc, nccl)")
    h = await client.health()
    every = list(h["engines"].values())
    # Stale engines take part: an update is what brings them up to date.
    engines = [e for e in every if _updatable(e) and (targets is None or e["engine_id"] in targets)]
    if not engines:
        raise ControlError("no healthy engine to update", missing=list(targets or []))
    if target == "model" and version is None:
        version = 1 + max([int(h.get("weight_version", 0))] + [int(e.get("weight_version", 0)) for e in every])
    elif target != "model":
        version = None
    eids = [e["engine_id"] for e in engines]
    named = [(n, t.detach()) for n, t in named]
    if target == "model":
        named = _cast_to_engine_dtype(named, engines)
    metas, sizes, tensors = plan_buckets(named, bucket_bytes or DEFAULT_BUCKET_BYTES)
    update_id = uuid.uuid4().hex[:16]
    args = dict(extra_args or {})
    sender: Any = None
    if transport in GPU_TRANSPORTS:
        from trainer_bridge import gpu_transports

        sender = gpu_transports.make_sender(transport, metas, sizes, tensors, engines, options)
        args.update(sender.transport_args())
    begin = P.BeginWeightUpdate(update_id, transport, metas, sizes, target=target, transport_args=args)
    try:
        await client.control(begin, targets=eids, timeout_s=timeout_s)
        if transport == "zmq":
            await _send_buckets_zmq(engines, update_id, metas, sizes, tensors, timeout_s, client._curve)
        else:
            await sender.send(client, update_id, eids, timeout_s)
        return await client.control(P.FinishWeightUpdate(update_id, version=version), targets=eids, timeout_s=timeout_s)
    except BaseException:
        # Every engine drops what it staged; none changes weights or version.
        try:
            await client.control(
                P.AbortWeightUpdate(update_id), targets=eids, timeout_s=min(timeout_s, 10.0), strict=False
            )
        except Exception:
            pass
        raise
    finally:
        # cuda_ipc: the engines load straight from views of our buckets at
        # finish, so the buckets live until the finish (or abort) is acked.
        release = getattr(sender, "release", None)
        if release is not None:
            release()


def _updatable(e: dict[str, Any]) -> bool:
    return bool(e.get("healthy")) or e.get("state") == "stale"


def _cast_to_engine_dtype(named: list[tuple[str, Any]], engines: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """A bf16 engine fed by an fp32 trainer (or the reverse): cast floating
    tensors to the dtype the engines registered, when they agree on one."""
    import torch

    dtypes = {e.get("dtype", "") for e in engines}
    if len(dtypes) != 1 or "" in dtypes:
        return named
    dt = getattr(torch, dtypes.pop(), None)
    if not isinstance(dt, torch.dtype):
        return named
    return [(n, t.to(dt) if t.is_floating_point() and t.dtype != dt else t) for n, t in named]


async def _send_buckets_zmq(
    engines: list[dict[str, Any]],
    update_id: str,
    metas: list[P.TensorMeta],
    sizes: list[int],
    tensors: list[Any],
    timeout_s: float,
    curve: CurveKeys | None,
) -> None:
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    codec = Codec()
    # The engines' weight sockets are CURVE servers on TCP when the cluster is
    # secured (open_socket decides per address): connect with the client's
    # keys and the engine's own key (from its Register) as the server key; the
    # engine checks ours against its "peers" allow-list.
    socks = {
        e["engine_id"]: open_socket(
            ctx,
            zmq.DEALER,
            connect=e["weight_address"],
            curve=curve.connecting_to(e["curve_key"].encode()) if curve and e.get("curve_key") else curve,
        )
        for e in engines
    }
    try:
        for b in range(len(sizes)):
            buf = pack_bucket(b, metas, sizes, tensors)
            frame = memoryview(buf.numpy())
            for s in socks.values():
                s.send_multipart(codec.encode(P.WeightBucket(update_id, b), [frame]), copy=False)
            await asyncio.gather(
                *(_bucket_ack(eid, s, codec, update_id, b, metas, timeout_s) for eid, s in socks.items())
            )
    finally:
        for s in socks.values():
            s.close(linger=0)
        ctx.term()


async def _bucket_ack(
    eid: str, sock: Any, codec: Codec, update_id: str, bucket: int, metas: list[P.TensorMeta], timeout_s: float
) -> None:
    try:
        frames = await asyncio.wait_for(sock.recv_multipart(), timeout_s)
    except asyncio.TimeoutError:
        names = [m.name for m in metas if m.bucket == bucket]
        raise RequestTimeout(
            f"engine {eid} did not ack weight bucket {bucket} ({len(names)} tensors from {names[:1]}) within timeout_s={timeout_s}",
            field="timeout_s",
        ) from None
    ack, _ = codec.decode(frames)
    if not isinstance(ack, P.WeightBucketAck) or not ack.ok:
        err = getattr(ack, "error", None) or f"unexpected {type(ack).__name__}"
        failure = P.EngineFailure(code=ErrorCode.BACKEND_REFUSED.value, message=err, field="tensors")
        raise ControlError(f"weight bucket {bucket} refused by {eid}: {err}", errors={eid: failure})
