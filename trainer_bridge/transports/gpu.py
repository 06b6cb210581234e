"""The one send path of the GPU transports (cuda_ipc, nccl), trainer side.

Whether an update has one sender or several, a sender rank's part goes the
same way: plan its buckets, let the transport's link share them (cuda_ipc:
IPC handles) or get ready to broadcast them (nccl), put the part on the op
that carries it, and let the link deliver that op (cuda_ipc: send it and
gather the acks; nccl: publish it and broadcast while the engines wait in
it). Only the carrying op differs:

- one sender (`update_weights(transport=...)`, `GpuSender.push`): the part
  rides on the `BeginWeightUpdate(prepare=True)`: begin + receive + prepare in
  one op, then the commit — two round trips;
- several senders (`client.weight_update(senders=n, transport=...)`,
  `GpuSender.send`): each rank's part is ONE `ReceiveWeights` carrying its
  metas; the engines append it; the coordinator's commit is all-or-nothing.

GPU bytes never pass the engine node, so NaN / inf values are checked here.

cuda_ipc hazard: the engines load straight from the sender's buckets at the
COMMIT, so they live until it is acked. A one-sender push releases them after
its commit / abort; the coordinator's own part senders are released by its
commit / abort; a sender in another process uses `async with` (its exit
waits for the head's decision, `wait_released`).

A link (one per transport: trainer_bridge/transports/{cuda_ipc,nccl}.py)
implements `GpuLink`; `GpuKind(link)` is its entry in the SENDERS table.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Iterable
from typing import Any, ClassVar, Protocol

import structlog

from bus import protocol as P
from bus.errors import BadRequest
from bus.tensors import first_nonfinite, plan_buckets, start_nonfinite_check
from bus.transport import Transport, TransportArgs
from trainer_bridge.transports import one_trip
from trainer_bridge.transports.packing import check_beside, record_written

log = structlog.get_logger("trainer_bridge.transports.gpu")


class GpuLink(Protocol):
    transport: ClassVar[Transport]
    check_after_begin: ClassVar[bool]  # the one-sender NaN check may finish after the begin's round trip
    keeps_buffers: ClassVar[bool]  # the engines read the sender's memory until the commit is acked

    def __init__(
        self,
        engines: list[P.EngineView],
        options: dict[str, Any],
        *,
        part: bool,
        rank: int | None,
        tensors: list[Any],
        bucket_bytes: int = ...,
        zero_copy: bool = False,
        written: Any = None,
    ) -> None: ...

    @staticmethod
    def plan(
        cast_named: list[tuple[str, Any]], named: list[tuple[str, Any]], options: dict[str, Any], bucket_bytes: int
    ) -> tuple[list[Any], list[int], list[Any], bool]:
        """(metas, sizes, tensors, zero_copy) of a one-sender push."""
        ...

    def part(self, metas: list[Any], sizes: list[int], tensors: list[Any]) -> tuple[list[bytes], TransportArgs]:
        """The part's handles and transport args (cuda_ipc packs and shares here)."""
        ...

    async def deliver(self, op: Awaitable[Any], timeout_s: float) -> Any:
        """Send the op carrying the part; its acks."""
        ...

    def release(self) -> None: ...


def refuse_nonfinite(bad: str | None, who: str = "") -> None:
    if bad is not None:
        skip = "check_finite=False skips this check" if who else "update_weights(check_finite=False) skips this check"
        raise BadRequest(f"{who}tensor {bad!r} has NaN or inf values: not sent ({skip})", field="tensors")


class GpuSender:
    """One sender rank of an update over a GPU transport."""

    def __init__(
        self,
        link: type[GpuLink],
        client: Any,
        update_id: str,
        rank: int,
        engines: list[P.EngineView],
        *,
        bucket_bytes: int,
        timeout_s: float,
        cast: Any,
        options: dict[str, Any],
        check_finite: bool = True,
    ) -> None:
        self.link_type = link
        self.transport = link.transport
        self.client = client
        self.update_id = update_id
        self.rank = rank
        self.engines = engines
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.cast = cast
        self.options = dict(options)
        self.check_finite = check_finite  # GPU bytes never pass the engine node: checked here
        self._link: GpuLink | None = None
        self.stats: dict[str, Any] = {}

    async def send(self, named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        """This rank's part of a multi-sender update: one ReceiveWeights."""
        t0 = time.perf_counter()
        named = [(n, self.cast(t.detach())) for n, t in named]
        if self.check_finite:
            refuse_nonfinite(first_nonfinite(named), f"sender {self.rank}: ")
        metas, sizes, tensors = plan_buckets(named, self.bucket_bytes)
        eids = [e.engine_id for e in self.engines]
        link = self._link = self.link_type(
            self.engines, self.options, part=True, rank=self.rank, tensors=tensors, bucket_bytes=self.bucket_bytes
        )
        handles, args = link.part(metas, sizes, tensors)
        op = P.ReceiveWeights(
            self.update_id, handles, sender=self.rank, tensors=metas, bucket_sizes=sizes, transport_args=args
        )
        res = await link.deliver(self.client.control(op, targets=eids, timeout_s=self.timeout_s), self.timeout_s)
        self.stats = {
            "rank": self.rank,
            "buckets": len(sizes),
            "tensors": len(metas),
            "bytes": int(sum(sizes)),
            "seconds": round(time.perf_counter() - t0, 4),
            "engines": sorted(res),
        }
        return self.stats

    def _check_in_band(self, cast_named: list[tuple[str, Any]]) -> bool:
        """Where the NaN/inf check runs: launched by push() at once, on the GPU
        while the plan runs on the CPU; or, nccl with CUDA tensors (in band),
        launched by the send thread once the op is out, on a stream of its own,
        waited for beside the broadcast (NcclArgs.verdict). CPU tensors with no
        sender device named have no GPU to go from: checked in push(), so a NaN
        is refused naming the tensor before a sender looks for a GPU."""
        return bool(
            self.check_finite
            and getattr(self.link_type, "check_in_band", False)
            and (self.options.get("device") is not None or any(t.is_cuda for _, t in cast_named))
        )

    async def push(self, upd: Any, named: list[tuple[str, Any]]) -> dict[str, Any]:
        """The whole update from this one sender (`upd`: an unopened
        trainer_bridge.weights.WeightUpdate with its engines picked): the part
        rides on the begin, then the commit — or, once the engines hold its
        layout, ONE op (one_trip.py). `LAST_PUSH` says where the trainer's
        own time went outside the round trips."""
        t0 = time.perf_counter()
        cast_named = [(n, self.cast(t.detach())) for n, t in named]
        # The trainer's writes so far, as an event: the zero-copy share waits for
        # them, not for the NaN/inf check queued behind them, which runs on the
        # GPU while the begin makes its round trip and is waited for before the
        # commit (nothing is written on the engines before it).
        written = record_written(cast_named)
        t1 = time.perf_counter()
        in_band = self._check_in_band(cast_named)
        check = start_nonfinite_check(cast_named) if self.check_finite and not in_band else None
        t2 = time.perf_counter()
        metas, sizes, tensors, zero_copy = self.link_type.plan(cast_named, named, self.options, self.bucket_bytes)
        tw = time.perf_counter()
        if check is not None and not self.link_type.check_after_begin:
            # before anything is published or a sender is made (nccl: the engines
            # would commit what is sent)
            refuse_nonfinite(check())
            check = None
        waited = time.perf_counter() - tw
        link = self._link = self.link_type(
            self.engines, self.options, part=False, rank=self.options.get("sender_rank"), tensors=tensors,
            zero_copy=zero_copy, written=written,
        )  # fmt: skip
        if in_band:
            link.check = functools.partial(check_beside, cast_named)  # type: ignore[attr-defined]
        handles, args = link.part(metas, sizes, tensors)
        t3 = time.perf_counter()
        steady = (zero_copy or _one_trips(self.link_type)) and self.options.get("one_trip", True)
        layout = one_trip.layout_id(metas, sizes, handles) if steady else ""  # one_trip=False: always two trips
        t4 = time.perf_counter()
        LAST_PUSH.clear()
        LAST_PUSH.update(
            cast_s=round(t1 - t0, 6),
            check_launch_s=round(t2 - t1, 6),
            plan_s=round(t3 - t2 - waited, 6),
            layout_s=round(t4 - t3, 6),
            check_wait_s=round(waited, 6),
        )
        try:
            if one_trip.layouts(upd.client).holds(upd.targets, layout):
                done, args = await self._one_trip(upd, layout, args, check, link)
                if done is not None:
                    return done
                check = None  # checked already
                link = self._link or link  # nccl: the renewed engines' group
            begin = P.BeginWeightUpdate(
                upd.update_id, self.transport, metas, sizes, target=upd.target, transport_args=args,
                prepare=True, handles=handles, check_finite=upd.check_finite, layout=layout,
            )  # fmt: skip
            try:
                await link.deliver(upd.open(begin=begin), upd.timeout_s)
            except BaseException as e:
                await upd.abort()
                _refuse_in_band(link, e)
                raise
            bad = check() if check is not None else None
            if bad is not None:
                await upd.abort()
                refuse_nonfinite(bad)
            res = await upd.commit()
            one_trip.layouts(upd.client).committed(upd.targets, layout, upd.engines, res)
            return res
        except BaseException:
            one_trip.layouts(upd.client).forget(upd.targets)  # the engines' layouts are not known any more
            raise
        finally:
            self.release()  # cuda_ipc: only now, after the commit (or abort) is acked

    async def _one_trip(
        self, upd: Any, layout: str, args: Any, check: Any, link: GpuLink
    ) -> tuple[dict[str, Any] | None, Any]:
        """The one-op update (trainer_bridge/transports/one_trip.py) and the
        args; (None, args) when it was refused before anything committed:
        `upd` is renewed for the two-round-trip path then (nccl: nothing was
        broadcast; the args get a fresh check-in token)."""
        if check is not None:  # the engines write at once: checked before the op leaves
            refuse_nonfinite(check())
        try:
            return await one_trip.send(upd, layout, args, self.transport, link.deliver), args
        except one_trip.Refused as e:
            _refuse_in_band(link, e)  # the engines refused what the trainer's own check found
            log.info("weight_one_trip_fallback", update_id=upd.update_id, why=str(e)[:300])
            await upd.renew(f"one-trip refused: {e}")  # a new id, a health read (and a re-pause)
            if _one_trips(self.link_type):
                # nothing was broadcast; a fresh check-in token, and the group of
                # the engines just read (another engine set: another group)
                payload = link_payload(link)
                self._link = new = self.link_type(
                    upd.engines, self.options, part=False, rank=self.options.get("sender_rank"), tensors=payload[2]
                )
                new.check = getattr(link, "check", None)  # type: ignore[attr-defined]
                _, args = new.part(*payload)
            return None, args

    def release(self) -> None:
        """Free this rank's buffers (cuda_ipc: only after the commit / abort is acked)."""
        if self._link is not None:
            self._link.release()
            self._link = None

    async def wait_released(self, timeout_s: float | None = None) -> str:
        """Wait until the head decided and applied the update (it is no longer
        open there), then release the buffers. Returns "done"; raises
        TimeoutError naming `timeout_s` when the coordinator never finished."""
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        end = time.monotonic() + limit
        while True:
            decided = (await self.client._query("weight_update_decisions", P.DecisionsView)).decisions
            if self.update_id not in decided or decided[self.update_id] == "abort":
                break  # the commit round is over (the head dropped it), or aborted
            if time.monotonic() > end:
                raise TimeoutError(
                    f"weight update {self.update_id}: the coordinator did not commit or abort within "
                    f"timeout_s={limit} (sender {self.rank} keeps its {self.transport.value} buffers meanwhile)"
                )
            await asyncio.sleep(0.02)
        self.release()
        return "done"

    async def __aenter__(self) -> GpuSender:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._link is not None and self._link.keeps_buffers:
            await self.wait_released()


# Where the last one-sender push spent the trainer's own time before its
# first op left (s): casts, the NaN/inf check, plan + link set-up, the layout id.
LAST_PUSH: dict[str, float] = {}


def _one_trips(link: type[GpuLink]) -> bool:
    """A link whose every one-sender update may go one-trip (nccl); cuda_ipc
    does only with zero_copy (its plan says so)."""
    return bool(getattr(link, "one_trip", False))


def _refuse_in_band(link: Any, e: BaseException) -> None:
    """The in-band NaN/inf check found a bad tensor (the engines refused the
    update for it): the typed refusal naming it, not the engines' errors."""
    bad = getattr(link, "bad", None)
    if bad is not None:
        try:
            refuse_nonfinite(bad)
        except BadRequest as refusal:
            raise refusal from e


def link_payload(link: Any) -> tuple[list[Any], list[int], list[Any]]:
    return link._payload


class GpuKind:
    """The SENDERS entry of a GPU transport: its link, one send path."""

    takes_plan = False  # each sender's part brings its own metas

    def __init__(self, link: type[GpuLink]) -> None:
        self.link = link
        self.transport = link.transport

    def part_sender(self, client: Any, update_id: str, rank: int, engines: list[P.EngineView], **kw: Any) -> GpuSender:
        kw.pop("with_metas", None)  # parts always carry their metas
        return GpuSender(self.link, client, update_id, rank, engines, **kw)

    async def push(self, upd: Any, named: Iterable[tuple[str, Any]], options: dict[str, Any]) -> dict[str, Any]:
        named = list(named)
        # A zero-copy layout the engines hold: their views from that update
        # (dtype casts), no health read; else the healthy and stale engines now.
        steady = options.get("zero_copy") or _one_trips(self.link)
        cached = one_trip.layouts(upd.client).engines_for(upd.targets) if steady else None
        if cached:
            upd.engines = cached
        else:
            await upd._pick_engines()
        s = GpuSender(
            self.link, upd.client, upd.update_id, 0, upd.engines, bucket_bytes=upd.bucket_bytes,
            timeout_s=upd.timeout_s, cast=upd.caster(), options=options, check_finite=upd.check_finite,
        )  # fmt: skip
        return await s.push(upd, named)
