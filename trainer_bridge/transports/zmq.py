"""The zmq transport, trainer side (CPU, across machines, CI).

Tensors are packed into buckets AS THEY ARRIVE (bus.tensors.BucketPacker) and
each full bucket is sent at once as a raw frame, zero-copy, to every engine's
weight socket. One bucket is in flight while the next is packed, so the
trainer holds at most two buckets beyond its own tensors, and any iterable
works (a generator that gathers and frees shards one by one). A list is
planned up front (its begin carries the metas: engines validate
names/shapes before any byte moves and stage eagerly); any other iterable is
streamed (each bucket carries its metas; engines hold them until the
prepare). The engine side is engine_node/transports/zmq.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any, ClassVar

from bus import protocol as P
from bus.codec import Codec
from bus.endpoint import open_socket
from bus.errors import ControlError, ErrorCode
from bus.tensors import BucketPacker
from bus.transport import Transport
from trainer_bridge.control_port import ControlPort
from trainer_bridge.update_ids import sender_secret


class WeightSender:
    """One rank's part of an update over zmq: packs buckets as tensors arrive
    and streams them to every engine, one bucket in flight while the next is
    packed; then declares its bucket count to every engine."""

    def __init__(
        self,
        client: ControlPort,
        update_id: str,
        rank: int,
        engines: list[P.EngineView],
        *,
        bucket_bytes: int,
        timeout_s: float,
        cast: Any,
        with_metas: bool,
    ) -> None:
        self.client = client
        self.update_id = update_id
        self.rank = rank
        self.engines = engines
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.cast = cast
        self.with_metas = with_metas
        # The update's sender credential (the opener's Begin reply, or given to
        # weight_sender by the coordinator): every bucket and end carries it.
        self.secret = sender_secret(client, update_id)
        self.stats: dict[str, Any] = {}

    async def send(self, named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        import zmq.asyncio

        t0 = time.perf_counter()
        ctx = zmq.asyncio.Context()
        codec = Codec()
        curve = self.client._curve
        # The engines' weight sockets are CURVE servers on TCP when the cluster is
        # secured: connect with the client's keys (open_socket decides per address).
        socks = {
            # The engine's own key (from its Register) is the server key; the
            # engine checks ours against its "peers" allow-list.
            e.engine_id: open_socket(
                ctx,
                zmq.DEALER,
                connect=e.weight_address,
                curve=curve.connecting_to(e.curve_key.encode()) if curve and e.curve_key else curve,
                plain=self.client._plain,  # without CURVE: the join token's client credential
            )
            for e in self.engines
        }
        packer = BucketPacker(self.bucket_bytes)
        inflight: tuple[int, list[P.TensorMeta], Any] | None = None
        n = nbytes = 0
        try:
            for name, t in named:
                for b in packer.add(name, self.cast(t.detach())):
                    await self._settle(socks, codec, inflight)
                    inflight = self._ship(socks, codec, b)
                    n, nbytes = n + 1, nbytes + b[2].numel()
            for b in packer.flush():
                await self._settle(socks, codec, inflight)
                inflight = self._ship(socks, codec, b)
                n, nbytes = n + 1, nbytes + b[2].numel()
            await self._settle(socks, codec, inflight)
            inflight = None
            end = codec.encode(P.WeightSenderEnd(self.update_id, self.rank, n, sender_secret=self.secret))
            for s in socks.values():
                s.send_multipart(end)
            await self._acks(socks, codec, -1, [])
        finally:
            for s in socks.values():
                s.close(linger=0)
            ctx.term()
        dt = time.perf_counter() - t0
        self.stats = {"buckets": n, "bytes": nbytes, "seconds": round(dt, 4)}
        return self.stats

    def release(self) -> None:
        """Nothing outlives send(): every bucket was acked before it returned."""

    def _ship(
        self, socks: dict[str, Any], codec: Codec, b: tuple[int, list[P.TensorMeta], Any]
    ) -> tuple[int, list[P.TensorMeta], Any]:
        index, metas, buf = b
        metas = metas if self.with_metas else []
        msg = P.WeightBucket(self.update_id, index, sender=self.rank, metas=metas, sender_secret=self.secret)
        frame = memoryview(buf.numpy())  # zero-copy: `buf` lives until every engine acked it
        for s in socks.values():
            s.send_multipart(codec.encode(msg, [frame]), copy=False)
        return b

    async def _settle(self, socks: dict[str, Any], codec: Codec, inflight: Any) -> None:
        if inflight is not None:
            await self._acks(socks, codec, inflight[0], inflight[1])

    async def _acks(self, socks: dict[str, Any], codec: Codec, bucket: int, metas: list[P.TensorMeta]) -> None:
        await asyncio.gather(*(self._ack(eid, s, codec, bucket, metas) for eid, s in socks.items()))

    async def _ack(self, eid: str, sock: Any, codec: Codec, bucket: int, metas: list[P.TensorMeta]) -> None:
        what = f"the end of sender {self.rank}" if bucket < 0 else f"weight bucket {bucket} of sender {self.rank}"
        try:
            frames = await asyncio.wait_for(sock.recv_multipart(), self.timeout_s)
        except asyncio.TimeoutError:
            first = [m.name for m in metas[:1]]
            raise ControlError(
                f"engine {eid} did not ack {what} ({len(metas)} tensors from {first}) within timeout_s={self.timeout_s}",
                missing=[eid],
            ) from None
        ack, _ = codec.decode(frames)
        if not isinstance(ack, P.WeightBucketAck) or not ack.ok:
            err = getattr(ack, "error", None) or f"unexpected {type(ack).__name__}"
            field = getattr(ack, "field", None) or "tensors"
            code = ErrorCode.UNAUTHORIZED if field == "sender_secret" else ErrorCode.BACKEND_REFUSED
            failure = P.EngineFailure(code=code.value, message=err, field=field)
            raise ControlError(f"{what} refused by {eid}: {err}", errors={eid: failure})


class ZmqKind:
    """The SENDERS entry of zmq: the one-sender push is the multi-sender path
    with one rank (a list is planned: its begin announces the metas)."""

    transport: ClassVar[Transport] = Transport.ZMQ
    takes_plan = True

    def part_sender(
        self, client: Any, update_id: str, rank: int, engines: list[P.EngineView], **kw: Any
    ) -> WeightSender:
        kw.pop("options", None)
        kw.pop("check_finite", None)  # the engines check zmq bytes at their prepare
        return WeightSender(client, update_id, rank, engines, **kw)

    async def push(self, upd: Any, named: Iterable[tuple[str, Any]], options: dict[str, Any]) -> dict[str, Any]:
        planned = isinstance(named, (list, tuple))
        async with upd.opened(plan=list(named) if planned else None):
            await upd.sender(0).send(named)
        return upd.results


KIND = ZmqKind()
