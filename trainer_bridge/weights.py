"""Weight transfer, trainer side: a two-phase commit coordinated by the head.

    begin (update id, transport, senders; the tensor plan, or none: streamed)
    → buckets, from one or several sender ranks, each closed by a WeightSenderEnd
    → commit: the head prepares every engine that has not voted (each checks it
      holds everything every sender declared and that the backend validated it),
      and commits only if all voted yes; otherwise it aborts everywhere.

Atomicity: engines stage what they receive and change nothing before the
commit. Any failure before the commit (an engine refuses a tensor, dies, goes
silent; a sender fails or vanishes) aborts the update on every engine — old
weights, old version — and the ControlError names the engine (or the sender).
After the head decided to commit, an engine that misses it is STALE (the head
shows it, routes nothing to it) and the next update or `sync_stale` brings it
back; `update_weights` returns the engines that committed.

zmq transport (CPU, across machines, CI): tensors are packed into buckets AS
THEY ARRIVE (bus.tensors.BucketPacker) and each full bucket is sent at once as
a raw frame, zero-copy, to every engine's weight socket. One bucket is in
flight while the next is packed, so the trainer holds at most two buckets
beyond its own tensors, and any iterable works (a generator that gathers and
frees shards one by one). A list is planned up front (its begin carries the
metas: engines validate names/shapes before any byte moves and stage eagerly);
any other iterable is streamed (each bucket carries its metas; engines hold
them until the prepare).

GPU transports (cuda_ipc, nccl) live in trainer_bridge.gpu_transports. Both
take two round trips: begin + receive + prepare in one op, then the commit.
cuda_ipc: the trainer's buckets live until the commit (or abort) is acked;
nccl: the begin is published and the broadcast runs while the engines wait in it.

Several senders: `client.weight_update(senders=n)` opens an update (the
coordinator); each rank sends its part through `upd.sender(rank)` or, from its
own process, `client.weight_sender(update_id, rank)`; leaving the `async with`
commits (version += 1 once, prefix cache reset once), an exception aborts.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterable
from typing import Any

import structlog

from bus import protocol as P
from bus.codec import Codec
from bus.endpoint import open_socket
from bus.errors import BadRequest, ControlError, ErrorCode, UpdateInProgress
from bus.tensors import DEFAULT_BUCKET_BYTES, BucketPacker, plan_buckets, start_nonfinite_check
from trainer_bridge import gpu_transports
from trainer_bridge.control_port import ControlPort
from trainer_bridge.gpu_transports import GpuPartSender

log = structlog.get_logger("trainer_bridge.weights")

GPU_TRANSPORTS = ("cuda_ipc", "nccl")


async def push_weights(
    client: ControlPort,
    named: Iterable[tuple[str, Any]],
    *,
    transport: str,
    bucket_bytes: int | None,
    targets: list[str] | None,
    timeout_s: float,
    options: dict[str, Any],
    target: str = "model",
    extra_args: dict[str, Any] | None = None,
    version: int | None = None,
    check_finite: bool = True,
) -> dict[str, Any]:
    """`version`: the weight version the engines take at commit (a model
    update). None: the head picks one above everything the cluster has served
    (its cluster version and every engine's), so versions never repeat or go
    back, and stale engines that take part jump to it."""
    if transport not in ("zmq", *GPU_TRANSPORTS):
        raise ValueError(f"unknown transport {transport!r} (zmq, cuda_ipc, nccl)")
    upd = WeightUpdate(
        client,
        targets=targets,
        timeout_s=timeout_s,
        version=version,
        target=target,
        extra_args=extra_args,
        bucket_bytes=bucket_bytes,
        check_finite=check_finite,
    )
    if transport in GPU_TRANSPORTS:
        return await _push_gpu(upd, list(named), transport, options)
    planned = isinstance(named, (list, tuple))
    async with upd.opened(plan=list(named) if planned else None):
        await upd.sender(0).send(named)
    return upd.results


class WeightUpdate:
    """One update, coordinator side (`client.weight_update(...)`)."""

    def __init__(
        self,
        client: ControlPort,
        *,
        senders: int = 1,
        targets: list[str] | None = None,
        timeout_s: float = 60.0,
        version: int | None = None,
        target: str = "model",
        extra_args: dict[str, Any] | None = None,
        bucket_bytes: int | None = None,
        transport: str = "zmq",
        options: dict[str, Any] | None = None,
        check_finite: bool = True,
    ) -> None:
        if senders < 1:
            raise ValueError(f"senders must be >= 1, got {senders}")
        if transport not in ("zmq", *GPU_TRANSPORTS):
            raise ValueError(f"unknown transport {transport!r} (zmq, cuda_ipc, nccl)")
        self.transport = transport
        # Engines refuse NaN / inf values at the prepare (zmq); GPU transports
        # are checked here, before the begin (the bytes never pass the node).
        self.check_finite = check_finite
        self.options = dict(options or {})  # GPU senders: device, nccl_host, nccl_port, nccl_timeout_s
        self._gpu_senders: list[Any] = []  # cuda_ipc: their buckets live until the commit / abort is acked
        self.client = client
        self.senders = senders
        self.targets = targets
        self.timeout_s = timeout_s
        self.version = version if target == "model" else None
        self.target = target
        self.extra_args = dict(extra_args or {})
        self.bucket_bytes = int(bucket_bytes or DEFAULT_BUCKET_BYTES)
        self.update_id = uuid.uuid4().hex[:16]
        self.engines: list[dict[str, Any]] = []
        self.planned = False
        self.results: dict[str, Any] = {}
        self.state = "new"  # new | open | committed | aborted

    @property
    def engine_ids(self) -> list[str]:
        return [e["engine_id"] for e in self.engines]

    async def _pick_engines(self) -> None:
        h = await self.client.health()
        # Stale engines take part: an update is what brings them up to date.
        self.engines = [
            e
            for e in h["engines"].values()
            if _updatable(e) and (self.targets is None or e["engine_id"] in self.targets)
        ]
        if not self.engines:
            raise ControlError("no healthy engine to update", missing=list(self.targets or []))

    async def open(
        self,
        *,
        plan: list[tuple[str, Any]] | None = None,
        transport: str | None = None,
        begin: P.BeginWeightUpdate | None = None,
    ) -> WeightUpdate:
        """Begin on every engine. `plan`: the tensors, known up front (one
        sender): the begin announces their metas. None: streamed (over a GPU
        transport: each sender's part brings its own metas)."""
        transport = transport or self.transport
        if not self.engines:
            await self._pick_engines()
        if begin is None and transport in GPU_TRANSPORTS:
            if plan is not None:
                raise ValueError("GPU senders bring their own metas: open(plan=...) is for zmq")
            begin = P.BeginWeightUpdate(
                self.update_id,
                transport,
                [],
                [],
                target=self.target,
                transport_args=self.extra_args,
                senders=self.senders,
                streamed=True,
                check_finite=self.check_finite,
            )
        if begin is None:
            metas: list[P.TensorMeta] = []
            sizes: list[int] = []
            if plan is not None:
                if self.senders != 1:
                    raise ValueError("a planned update has one sender; stream from several")
                metas, sizes = _plan(plan, self.bucket_bytes, _caster(self.engines, self.target))
                self.planned = True
            begin = P.BeginWeightUpdate(
                self.update_id,
                transport,
                metas,
                sizes,
                target=self.target,
                transport_args=self.extra_args,
                senders=self.senders,
                streamed=plan is None,
                check_finite=self.check_finite,
            )
        self.state = "open"
        try:
            await self.client.control(begin, targets=self.engine_ids, timeout_s=self.timeout_s)
        except UpdateInProgress:
            self.state = "aborted"  # refused at the head: nothing began, nothing to abort
            raise
        except BaseException:
            await self.abort()
            raise
        return self

    def sender(self, rank: int = 0) -> Any:
        """The handle through which rank `rank` sends its tensors."""
        if not 0 <= rank < self.senders:
            raise ValueError(f"rank {rank} is not one of the {self.senders} sender(s)")
        if self.transport in GPU_TRANSPORTS:
            g = GpuPartSender(
                self.client,
                self.update_id,
                rank,
                self.engines,
                self.transport,
                bucket_bytes=self.bucket_bytes,
                timeout_s=self.timeout_s,
                cast=_caster(self.engines, self.target),
                options=self.options,
                check_finite=self.check_finite,
            )
            self._gpu_senders.append(g)
            return g
        return WeightSender(
            self.client,
            self.update_id,
            rank,
            self.engines,
            bucket_bytes=self.bucket_bytes,
            timeout_s=self.timeout_s,
            cast=_caster(self.engines, self.target),
            with_metas=not self.planned,
        )

    async def prepare(self) -> dict[str, Any]:
        """Phase one on its own (optional: commit() prepares what has not
        voted). Returns {engine_id: WeightsPrepared}; raises ControlError."""
        op = P.PrepareWeights(self.update_id, wait_s=self.timeout_s * 0.75)
        try:
            return await self.client.control(op, targets=self.engine_ids, timeout_s=self.timeout_s)
        except BaseException:
            await self.abort()
            raise

    async def commit(self) -> dict[str, Any]:
        """The head prepares engines that have not voted and commits only if
        all voted yes. Returns {engine_id: WeightsCommitted} of the engines
        that committed (one that missed the commit is stale: see health())."""
        commit = P.FinishWeightUpdate(self.update_id, version=self.version)
        try:
            return await self._commit(commit)
        finally:
            self._release_gpu()

    def _release_gpu(self) -> None:
        for g in self._gpu_senders:
            g.release()
        self._gpu_senders = []

    async def _commit(self, commit: P.FinishWeightUpdate) -> dict[str, Any]:
        try:
            # targets=None: the head commits on the update's own targets.
            self.results = await self.client.control(commit, timeout_s=self.timeout_s)
        except ControlError as e:
            if not e.results:  # nothing committed: the head aborted it (or never decided)
                await self.abort()
                raise
            # Decided and committed; these engines missed it and are stale now.
            log.warning("weight_commit_missed", update_id=self.update_id, failed=sorted(e.errors), missing=e.missing)
            self.results = dict(e.results)
        except BaseException:
            await self.abort()
            raise
        self.state = "committed"
        return self.results

    async def abort(self) -> None:
        """Every engine drops what it staged (idempotent, best effort)."""
        if self.state in ("committed", "aborted"):
            return
        self.state = "aborted"
        try:
            await self.client.control(
                P.AbortWeightUpdate(self.update_id), timeout_s=min(self.timeout_s, 10.0), strict=False
            )
        except Exception:
            pass
        finally:
            self._release_gpu()

    def opened(self, **kw: Any) -> _Opened:
        return _Opened(self, kw)

    async def __aenter__(self) -> WeightUpdate:
        return await self.open()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            await self.commit()
        else:
            await self.abort()


class _Opened:
    """`async with upd.opened(plan=...)`: open with arguments, commit on exit."""

    def __init__(self, upd: WeightUpdate, kw: dict[str, Any]) -> None:
        self.upd, self.kw = upd, kw

    async def __aenter__(self) -> WeightUpdate:
        return await self.upd.open(**self.kw)

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await self.upd.__aexit__(exc_type, exc, tb)


async def join_update(
    client: ControlPort,
    update_id: str,
    rank: int,
    *,
    bucket_bytes: int | None = None,
    timeout_s: float = 60.0,
    options: dict[str, Any] | None = None,
) -> Any:
    """A sender handle for an update opened elsewhere (another process's
    coordinator): the head says its targets and senders."""
    ups = (await client._query("weight_updates"))["updates"]
    txn = ups.get(update_id)
    if txn is None:
        raise ControlError(f"no open weight update {update_id!r} at the head (open: {sorted(ups)})")
    if not 0 <= rank < int(txn["senders"]):
        raise ValueError(f"rank {rank} is not one of the {txn['senders']} sender(s) of update {update_id}")
    h = await client.health()
    engines = [h["engines"][eid] for eid in txn["targets"] if eid in h["engines"]]
    if txn.get("transport") in GPU_TRANSPORTS:
        return GpuPartSender(
            client,
            update_id,
            rank,
            engines,
            txn["transport"],
            bucket_bytes=int(bucket_bytes or DEFAULT_BUCKET_BYTES),
            timeout_s=timeout_s,
            cast=_caster(engines, txn["target"]),
            options=dict(options or {}),
            check_finite=bool(txn.get("check_finite", True)),
        )
    return WeightSender(
        client,
        update_id,
        rank,
        engines,
        bucket_bytes=int(bucket_bytes or DEFAULT_BUCKET_BYTES),
        timeout_s=timeout_s,
        cast=_caster(engines, txn["target"]),
        with_metas=True,
    )


class WeightSender:
    """One rank's part of an update over zmq: packs buckets as tensors arrive
    and streams them to every engine, one bucket in flight while the next is
    packed; then declares its bucket count to every engine."""

    def __init__(
        self,
        client: ControlPort,
        update_id: str,
        rank: int,
        engines: list[dict[str, Any]],
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
            e["engine_id"]: open_socket(
                ctx,
                zmq.DEALER,
                connect=e["weight_address"],
                curve=curve.connecting_to(e["curve_key"].encode()) if curve and e.get("curve_key") else curve,
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
            end = codec.encode(P.WeightSenderEnd(self.update_id, self.rank, n))
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

    def _ship(
        self, socks: dict[str, Any], codec: Codec, b: tuple[int, list[P.TensorMeta], Any]
    ) -> tuple[int, list[P.TensorMeta], Any]:
        index, metas, buf = b
        msg = P.WeightBucket(self.update_id, index, sender=self.rank, metas=metas if self.with_metas else [])
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
            failure = P.EngineFailure(code=ErrorCode.BACKEND_REFUSED.value, message=err, field="tensors")
            raise ControlError(f"{what} refused by {eid}: {err}", errors={eid: failure})


# ---------------------------------------------------------------- GPU transports


async def _push_gpu(
    upd: WeightUpdate, named: list[tuple[str, Any]], transport: str, options: dict[str, Any]
) -> dict[str, Any]:
    await upd._pick_engines()
    cast = _caster(upd.engines, upd.target)
    cast_named = [(n, cast(t.detach())) for n, t in named]
    # The trainer's writes so far, as an event: the zero-copy share waits for
    # them, not for the NaN/inf check queued behind them, which runs on the
    # GPU while the begin makes its round trip and is waited for before the
    # commit (nothing is written on the engines before it).
    written = gpu_transports.record_written(cast_named)
    check = start_nonfinite_check(cast_named) if upd.check_finite else None
    if check is not None and transport != "cuda_ipc":
        # nccl: the broadcast queues behind the check on the same stream
        # anyway; refuse before a group is even made
        _refuse_nonfinite(check())
        check = None
    planned = None
    if transport == "cuda_ipc" and options.get("zero_copy"):
        # In place only when nothing was cast (a cast tensor is a temporary:
        # sharing it would pin a new allocation every update) and every
        # tensor can be shared as it is; else the packed buckets, as usual.
        uncast = all(c is t or c.data_ptr() == t.data_ptr() for (_, c), (_, t) in zip(cast_named, named, strict=True))
        planned = gpu_transports.plan_zero_copy(cast_named) if uncast else None
        if planned is None:
            log.warning("zero_copy_unavailable", reason="a tensor is cast, not contiguous, or not on one GPU")
            options = {**options, "zero_copy": False}
    metas, sizes, tensors = planned or plan_buckets(cast_named, upd.bucket_bytes)
    sender = gpu_transports.make_sender(transport, metas, sizes, tensors, upd.engines, options)
    sender.written = written
    args = {**upd.extra_args, **sender.transport_args()}
    # Both transports: begin + receive + prepare in one op, then the commit.
    # cuda_ipc: the handles travel with the begin; nccl: the engines wait for
    # the broadcast inside the begin, so it is published, not awaited, first.
    handles = sender.handles() if transport == "cuda_ipc" else []
    begin = P.BeginWeightUpdate(
        upd.update_id, transport, metas, sizes, target=upd.target, transport_args=args,
        prepare=True, handles=handles, check_finite=upd.check_finite,
    )  # fmt: skip
    try:
        if transport == "nccl":
            try:
                await sender.send_during(upd.open(begin=begin), upd.timeout_s)
            except BaseException:
                await upd.abort()
                raise
        else:
            await upd.open(begin=begin)
        bad = check() if check is not None else None
        if bad is not None:
            await upd.abort()
            _refuse_nonfinite(bad)
        return await upd.commit()
    finally:
        # cuda_ipc: the engines load straight from views of our buckets at the
        # commit, so the buckets live until the commit (or abort) is acked.
        release = getattr(sender, "release", None)
        if release is not None:
            release()


# ---------------------------------------------------------------- helpers


def _refuse_nonfinite(bad: str | None) -> None:
    if bad is not None:
        raise BadRequest(
            f"tensor {bad!r} has NaN or inf values: not sent (update_weights(check_finite=False) skips this check)",
            field="tensors",
        )


def _updatable(e: dict[str, Any]) -> bool:
    return bool(e.get("healthy")) or e.get("state") == "stale"


def _caster(engines: list[dict[str, Any]], target: str) -> Any:
    """A bf16 engine fed by an fp32 trainer (or the reverse): floating tensors
    are cast, one at a time as they are packed, to the dtype the engines
    registered, when they agree on one."""
    import torch

    dtypes = {e.get("dtype", "") for e in engines}
    dt = getattr(torch, dtypes.pop(), None) if len(dtypes) == 1 and "" not in dtypes else None
    if target != "model" or not isinstance(dt, torch.dtype):
        return lambda t: t
    return lambda t: t.to(dt) if t.is_floating_point() and t.dtype != dt else t


def _plan(named: list[tuple[str, Any]], bucket_bytes: int, cast: Any) -> tuple[list[P.TensorMeta], list[int]]:
    """The metas and bucket sizes the packer will produce, without packing
    (casting a meta tensor allocates nothing)."""
    import torch

    packer = BucketPacker(bucket_bytes, dry=True)
    metas: list[P.TensorMeta] = []
    sizes: list[int] = []
    for name, t in named:
        shadow = cast(torch.empty(t.shape, dtype=t.dtype, device="meta"))
        for _i, ms, _ in packer.add(name, shadow):
            metas += ms
            sizes.append(_size(ms))
    for _i, ms, _ in packer.flush():
        metas += ms
        sizes.append(_size(ms))
    return metas, sizes


def _size(metas: list[P.TensorMeta]) -> int:
    last = metas[-1]
    return (last.offset + last.nbytes + 255) // 256 * 256
