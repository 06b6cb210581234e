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

Every transport has one sender module in trainer_bridge/transports/ (found
through registry.SENDERS): zmq.py, and cuda_ipc.py / nccl.py on the one GPU
send path of gpu.py (two round trips: begin + receive + prepare in one op,
then the commit; cuda_ipc: the trainer's buckets live until the commit (or
abort) is acked; nccl: the begin is published and the broadcast runs while
the engines wait in it). A zero-copy cuda_ipc update whose layout every
engine already holds is ONE round trip (trainer_bridge/transports/one_trip.py:
the head decides the version, each engine receives + prepares + commits in
that op), with a fallback to the two round trips when an engine lost it.
`update_weights(..., pause=MODE)` pipelines pause → update → resume
(trainer_bridge/pipelined.py).

Several senders: `client.weight_update(senders=n)` opens an update (the
coordinator); each rank sends its part through `upd.sender(rank)` or, from its
own process, `client.weight_sender(update_id, rank)`; leaving the `async with`
commits (version += 1 once, prefix cache reset once), an exception aborts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import msgspec
import structlog

from bus import protocol as P
from bus.errors import BadRequest, ControlError, StaleUpdate, UpdateInProgress
from bus.tensors import DEFAULT_BUCKET_BYTES, BucketPacker
from bus.transport import Transport
from trainer_bridge.control_port import ControlPort
from trainer_bridge.transports.registry import sender_kind
from trainer_bridge.update_ids import keep_sender_secret, learn_update_id, take_update_id
from trainer_bridge.update_ids import sender_secret as own_sender_secret

log = structlog.get_logger("trainer_bridge.weights")


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
    pipeline: Any = None,
) -> dict[str, P.WeightsCommitted]:
    """`version`: the weight version the engines take at commit (a model
    update). None: the head picks one above everything the cluster has served
    (its cluster version and every engine's), so versions never repeat or go
    back, and stale engines that take part jump to it."""
    kind = sender_kind(transport)
    upd = WeightUpdate(
        client,
        targets=targets,
        timeout_s=timeout_s,
        version=version,
        target=target,
        extra_args=extra_args,
        bucket_bytes=bucket_bytes,
        check_finite=check_finite,
        transport=transport,
    )
    upd.pipeline = pipeline  # trainer_bridge/pipelined.py: a resume may follow the one-trip op at once
    return await kind.push(upd, named, options)


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
        self.kind = sender_kind(transport)
        self.transport = Transport(transport)
        # Engines refuse NaN / inf values at the prepare (zmq); GPU transports
        # are checked here, before the begin (the bytes never pass the node).
        self.check_finite = check_finite
        self.options = dict(options or {})  # GPU senders: device, nccl_host, nccl_port, nccl_timeout_s
        self._part_senders: list[Any] = []  # cuda_ipc: their buckets live until the commit / abort is acked
        self.client = client
        self.senders = senders
        self.targets = targets
        self.timeout_s = timeout_s
        self.version = version if target == "model" else None
        self.target = target
        # extra_args: {"lora_config": ...} of a LoRA update (client.load_lora)
        self.lora_config = dict(dict(extra_args or {}).pop("lora_config", None) or {})
        unknown = sorted(set(extra_args or {}) - {"lora_config"})
        if unknown:
            raise ValueError(f"unknown extra_args {unknown} (lora_config)")
        self.bucket_bytes = int(bucket_bytes or DEFAULT_BUCKET_BYTES)
        self.update_id = take_update_id(client)  # minted again by every health read (_pick_engines)
        self.engines: list[P.EngineView] = []
        self.planned = False
        self.results: dict[str, P.WeightsCommitted] = {}
        self.state = "new"  # new | open | committed | aborted
        self.pipeline: Any = None  # a pipelined pause's (trainer_bridge/pipelined.py), else None

    @property
    def sender_secret(self) -> str:
        """The credential of this update's senders, minted by the head and
        returned to this client alone at the begin ("" before it). A rank in
        another process needs it with the update id:
        `client.weight_sender(upd.update_id, rank, sender_secret=upd.sender_secret)`.
        Keep it as private as the join token: it lets its holder feed this update."""
        return own_sender_secret(self.client, self.update_id)

    @property
    def engine_ids(self) -> list[str]:
        return [e.engine_id for e in self.engines]

    async def renew(self, why: str) -> None:
        """A second try under a fresh id, after a one-trip op was refused with
        nothing committed (trainer_bridge/transports/one_trip.py): the engines
        are read again, and a pipelined pause is sent again (the resume went
        out right behind the refused op)."""
        log.info("weight_update_renewed", update_id=self.update_id, why=why[:300])
        self.state = "new"
        self.results = {}
        if self.pipeline is not None:
            self.pipeline.pause()
        await self._pick_engines()

    async def _pick_engines(self) -> None:
        h = await self.client.health_view()
        learn_update_id(self.client, h)
        self.update_id = take_update_id(self.client)  # renew: a fresh id too
        # Stale engines take part: an update is what brings them up to date.
        self.engines = [
            e for e in h.engines.values() if _updatable(e) and (self.targets is None or e.engine_id in self.targets)
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
        transport = Transport(transport or self.transport)
        if not self.engines:
            await self._pick_engines()
        if begin is None:
            begin = self._begin(transport, plan)
        self.state = "open"
        try:
            try:
                await self.client.control(begin, targets=self.engine_ids, timeout_s=self.timeout_s)
            except StaleUpdate:
                # Refused at the head, nothing began: an id it did not mint (no
                # health read yet, a restarted head, another trainer took it). Once more, fresh.
                learn_update_id(self.client, await self.client.health_view())
                self.update_id = take_update_id(self.client)
                begin = msgspec.structs.replace(begin, update_id=self.update_id)
                await self.client.control(begin, targets=self.engine_ids, timeout_s=self.timeout_s)
        except UpdateInProgress:
            self.state = "aborted"  # refused at the head: nothing began, nothing to abort
            raise
        except BaseException:
            await self.abort()
            raise
        return self

    def _begin(self, transport: Transport, plan: list[tuple[str, Any]] | None) -> P.BeginWeightUpdate:
        metas: list[P.TensorMeta] = []
        sizes: list[int] = []
        if plan is not None:
            if not sender_kind(transport).takes_plan:
                raise ValueError(f"{transport.value} senders bring their own metas: open(plan=...) is for zmq")
            if self.senders != 1:
                raise ValueError("a planned update has one sender; stream from several")
            metas, sizes = _plan(plan, self.bucket_bytes, self.caster())
            self.planned = True
        return P.BeginWeightUpdate(
            self.update_id,
            transport,
            metas,
            sizes,
            target=self.target,
            senders=self.senders,
            streamed=plan is None,
            check_finite=self.check_finite,
            lora_config=self.lora_config,
        )

    def caster(self) -> Any:
        """Casts each tensor to the dtype the engines registered (see _caster)."""
        return _caster(self.engines, self.target)

    def sender(self, rank: int = 0) -> Any:
        """The handle through which rank `rank` sends its tensors (its
        transport's part sender, trainer_bridge/transports/registry.py)."""
        if not 0 <= rank < self.senders:
            raise ValueError(f"rank {rank} is not one of the {self.senders} sender(s)")
        s = self.kind.part_sender(
            self.client,
            self.update_id,
            rank,
            self.engines,
            bucket_bytes=self.bucket_bytes,
            timeout_s=self.timeout_s,
            cast=self.caster(),
            options=self.options,
            check_finite=self.check_finite,
            with_metas=not self.planned,
        )
        self._part_senders.append(s)
        return s

    async def prepare(self) -> dict[str, P.WeightsPrepared]:
        """Phase one on its own (optional: commit() prepares what has not
        voted). Returns {engine_id: WeightsPrepared}; raises ControlError."""
        op = P.PrepareWeights(self.update_id, wait_s=self.timeout_s * 0.75, sender_secret=self.sender_secret)
        try:
            res = await self.client.control(op, targets=self.engine_ids, timeout_s=self.timeout_s)
            return P.expect(res, P.WeightsPrepared, "prepare_weights")
        except BaseException:
            await self.abort()
            raise

    async def commit(self) -> dict[str, P.WeightsCommitted]:
        """The head prepares engines that have not voted and commits only if
        all voted yes. Returns {engine_id: WeightsCommitted} of the engines
        that committed (one that missed the commit is stale: see health())."""
        commit = P.FinishWeightUpdate(self.update_id, version=self.version, sender_secret=self.sender_secret)
        try:
            return await self._commit(commit)
        finally:
            self._release_parts()

    def _release_parts(self) -> None:
        for g in self._part_senders:
            g.release()
        self._part_senders = []

    async def _commit(self, commit: P.FinishWeightUpdate) -> dict[str, P.WeightsCommitted]:
        try:
            # targets=None: the head commits on the update's own targets.
            res = await self.client.control(commit, timeout_s=self.timeout_s)
        except ControlError as e:
            if not e.results:  # nothing committed: the head aborted it (or never decided)
                await self.abort()
                raise
            # Decided and committed; these engines missed it and are stale now.
            log.warning("weight_commit_missed", update_id=self.update_id, failed=sorted(e.errors), missing=e.missing)
            res = dict(e.results)
        except BaseException:
            await self.abort()
            raise
        self.state = "committed"
        self.results = P.expect(res, P.WeightsCommitted, "finish_weights")
        return self.results

    async def abort(self) -> None:
        """Every engine drops what it staged (idempotent, best effort)."""
        if self.state in ("committed", "aborted"):
            return
        self.state = "aborted"
        try:
            await self.client.control(
                P.AbortWeightUpdate(self.update_id, sender_secret=self.sender_secret),
                timeout_s=min(self.timeout_s, 10.0),
                strict=False,
            )
        except Exception as e:  # best effort: an engine drops an idle update after its prepare_ttl_s
            log.warning("weight_abort_failed", update_id=self.update_id, error=repr(e))
        finally:
            self._release_parts()

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
    engines: list[str] | None = None,
    sender_secret: str = "",
) -> Any:
    """A sender handle for an update opened elsewhere (another process's
    coordinator): the head says its targets and senders; `sender_secret` (the
    coordinator's `upd.sender_secret`) proves this rank is one of them (this
    client's own update: known already). `engines`: this
    rank's part goes to these engines only (colocated: the engine on the
    rank's own GPU); every other target of the update gets an empty part
    from it (ended with 0 buckets), so each engine still hears from every
    sender and the commit stays one, all-or-nothing."""
    if sender_secret:
        keep_sender_secret(client, update_id, sender_secret)
    elif not own_sender_secret(client, update_id):
        raise BadRequest(
            f"weight update {update_id!r}: no sender_secret; the engines take its bytes only from its senders: "
            "pass the coordinator's upd.sender_secret with the update id",
            field="sender_secret",
        )
    ups = (await client._query("weight_updates", P.WeightUpdatesView)).updates
    txn = ups.get(update_id)
    if txn is None:
        raise ControlError(f"no open weight update {update_id!r} at the head (open: {sorted(ups)})")
    if not 0 <= rank < txn.senders:
        raise ValueError(f"rank {rank} is not one of the {txn.senders} sender(s) of update {update_id}")
    if engines is not None:
        unknown = sorted(set(engines) - set(txn.targets))
        if unknown or not engines:
            raise BadRequest(
                f"engines {unknown or engines} are not targets of update {update_id} ({sorted(txn.targets)})",
                field="engines",
            )
    h = await client.health_view()
    mine = [h.engines[eid] for eid in txn.targets if eid in h.engines and (engines is None or eid in engines)]
    part = sender_kind(txn.transport).part_sender(
        client,
        update_id,
        rank,
        mine,
        bucket_bytes=int(bucket_bytes or DEFAULT_BUCKET_BYTES),
        timeout_s=timeout_s,
        cast=_caster(mine, txn.target),
        options=dict(options or {}),
        check_finite=txn.check_finite,
        with_metas=True,
    )
    others = [eid for eid in txn.targets if engines is not None and eid not in engines]
    return PartToSome(part, client, update_id, rank, others, timeout_s) if others else part


class PartToSome:
    """A rank's part sender whose bytes go to some of the update's engines;
    the others get this rank's empty part (a ReceiveWeights with nothing),
    sent beside the bytes: no engine waits for a part that never comes."""

    def __init__(self, part: Any, client: ControlPort, update_id: str, rank: int, others: list[str], timeout_s: float):
        self.part, self.client, self.update_id, self.rank = part, client, update_id, rank
        self.others, self.timeout_s = others, timeout_s

    async def send(self, named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        empty = P.ReceiveWeights(self.update_id, sender=self.rank)
        stats, _ = await asyncio.gather(
            self.part.send(named), self.client.control(empty, targets=self.others, timeout_s=self.timeout_s)
        )
        return {**stats, "empty_parts": list(self.others)}

    def __getattr__(self, name: str) -> Any:  # release, wait_released, stats: the part sender's
        return getattr(self.part, name)

    async def __aenter__(self) -> PartToSome:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        aexit = getattr(self.part, "__aexit__", None)
        if aexit is not None:
            await aexit(exc_type, exc, tb)


# ---------------------------------------------------------------- helpers


def _updatable(e: P.EngineView) -> bool:
    return e.healthy or e.stale


def _caster(engines: list[P.EngineView], target: str) -> Any:
    """A bf16 engine fed by an fp32 trainer (or the reverse): floating tensors
    are cast, one at a time as they are packed, to the dtype the engines
    registered, when they agree on one."""
    import torch

    dtypes = {e.dtype for e in engines}
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
