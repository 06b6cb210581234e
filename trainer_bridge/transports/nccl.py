"""The nccl transport, trainer side (trainer on another GPU / node; trainer = rank 0).

The first update of a plan: two round trips (see trainer_bridge/transports/gpu.py):
    s = NcclSender(world_size=1 + sum(engine.tp for engine in engines), host=<trainer ip>)
                                                          # keep it for the trainer's lifetime
    metas, sizes, tensors = s.plan(named_tensors)
    publish BeginWeightUpdate(update_id, "nccl", metas, sizes, prepare=True,
                              transport_args=s.args())
        WITHOUT waiting for its acks: begin + receive + prepare in one op (the
        engines block in the receive until every bucket has arrived; the first
        time they also join the NCCL group; the ack is the engine's vote)
    s.send(metas, sizes, tensors, check_in, stop)         # once every engine worker checked in:
                                                          # connect() on first use, broadcast each bucket
    gather the begin's acks
    cmd FinishWeightUpdate(update_id)                     # the head commits
  Every later update with the same plan (the layout every engine kept): ONE op,
  BeginWeightUpdate("nccl", [], [], layout=L, commit=True) published, the same
  broadcast, its acks are the commits (trainer_bridge/transports/one_trip.py);
  refused (a sleep, a re-join): the two round trips again, by themselves.
  Check-in (NcclArgs.check_in, trainer_bridge/transports/nccl_broadcast.py):
  each engine worker adds itself under a fresh token in the sender's store
  before anything collective and waits for the sender's go; an op refused
  anywhere before the receive ends with nothing broadcast and the group intact.
  (A separate ReceiveWeights after the begin acked works too — warm_up_nccl
  does that — but costs a third round trip.)
  transport_args (bus.transport.NcclArgs): host, port (the sender's TCPStore),
  world_size, group_id, timeout_s; engines take ranks 1.. from a counter in
  that store (or `rank_offset` when the bridge sets one per engine). If a
  broadcast fails midway, send AbortWeightUpdate and make a new NcclSender
  (the group is broken).

  Group set-up ahead of the first update (`warm_up_nccl`, what SkyRL's
  init_weight_update_communicator calls): an EMPTY transaction on the existing
  ops (BeginWeightUpdate with no tensors, ReceiveWeights, AbortWeightUpdate):
  the engines join the group inside the receive while the trainer connects,
  so the first real update finds the group, vLLM's NCCL library and the
  trainer's vLLM import all done. No weights and no version change.

The engine side is engine_node/transports/nccl.py and the vLLM backend. The
sender needs vLLM importable in the trainer process (it uses vLLM's
PyNcclCommunicator, the same NCCL library the engines use); torch is
imported lazily.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Iterable
from datetime import timedelta
from typing import Any, ClassVar

import msgspec
import structlog

from bus import protocol as P
from bus.errors import ControlError
from bus.tensors import DEFAULT_BUCKET_BYTES, plan_buckets
from bus.transport import NcclArgs, Transport, backend_args
from trainer_bridge.transports.gpu import GpuKind
from trainer_bridge.transports.nccl_broadcast import NotCheckedIn, forget_token, send_update
from trainer_bridge.transports.packing import device_of
from trainer_bridge.update_ids import learn_update_id, take_update_id

log = structlog.get_logger("trainer_bridge.transports.nccl")


class NcclSender:
    """Rank 0 of a NCCL group with every engine worker; broadcasts each bucket."""

    def __init__(
        self,
        world_size: int,
        host: str = "127.0.0.1",
        port: int = 0,
        device: Any = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 300.0,
    ) -> None:
        import torch
        from torch.distributed import TCPStore

        if world_size < 2:
            raise ValueError("world_size counts the trainer plus every engine worker (>= 2)")
        self.world_size = int(world_size)
        self.host = host
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s = float(timeout_s)
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.group_id = uuid.uuid4().hex[:16]
        # The store is up at once (engines reserve ranks in it); the NCCL
        # communicator is made on first send() / connect(), together with the engines.
        if not port:  # a free port on that interface
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sk:
                sk.bind((host, 0))
                port = sk.getsockname()[1]
        self.store = TCPStore(
            host,
            int(port),
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.timeout_s),
            use_libuv=False,
        )
        self.port = int(self.store.port)
        self.comm: Any = None  # vLLM's PyNcclCommunicator once connected
        self.last_send_seconds = 0.0
        self.connect_timing: dict[str, float] = {}
        self.last_send_timing: dict[str, float] = {}
        self.last_send_info: dict[str, int] = {}
        self.last_verdict: str | None = None  # the in-band NaN/inf check's bad tensor (NcclArgs.verdict)
        self._pack_stream: Any = None
        self._pack_bufs: list[Any] = []

    def args(self, *, weight_check: bool = False, sender_group: bool = False) -> NcclArgs:
        """What the engines need to join this group (BeginWeightUpdate /
        ReceiveWeights transport_args)."""
        return NcclArgs(
            host=self.host,
            port=self.port,
            world_size=self.world_size,
            group_id=self.group_id,
            timeout_s=self.timeout_s,
            weight_check=weight_check,
            sender_group=sender_group,
        )

    def transport_args(self, bucket_sizes: list[int] | None = None) -> dict[str, Any]:
        """The args as a backend takes them (a backend driven directly, as the GPU tests do)."""
        a = backend_args(self.args(), list(bucket_sizes or []))
        if bucket_sizes is None:
            del a["bucket_sizes"]
        return a

    def connect(self) -> None:
        """Collective with every engine worker (they join inside ReceiveWeights).
        `connect_timing` says where the time went (import, NCCL init)."""
        if self.comm is not None:
            return
        t0 = time.perf_counter()
        try:
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup
        except ImportError as e:  # pragma: no cover
            raise RuntimeError("the nccl transport needs vllm importable in the trainer process") from e
        t1 = time.perf_counter()
        pg = StatelessProcessGroup(rank=0, world_size=self.world_size, store=self.store)
        # unique id through the store, ncclCommInitRank with every engine
        # worker, and vLLM's one-element all_reduce warm-up
        self.comm = PyNcclCommunicator(pg, device=self.device)
        self.connect_timing = {"import_s": round(t1 - t0, 4), "comm_init_s": round(time.perf_counter() - t1, 4)}

    def plan(self, named: Iterable[tuple[str, Any]]):
        return plan_buckets(list(named), self.bucket_bytes)

    def pack_stream(self) -> Any:
        """The CUDA stream the packs run on (nccl_broadcast.py), made once."""
        import torch

        if self._pack_stream is None and self.device.type == "cuda":
            self._pack_stream = torch.cuda.Stream(self.device)
        return self._pack_stream

    def pack_buffers(self, nbytes: int) -> list[Any]:
        """The two pack buffers, at least `nbytes` each (kept across updates:
        the trainer's memory holds two buckets more while the sender lives)."""
        import torch

        if nbytes and (not self._pack_bufs or self._pack_bufs[0].numel() < nbytes):
            self._pack_bufs = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return self._pack_bufs

    def send(
        self,
        metas: list[Any],
        sizes: list[int],
        tensors: list[Any],
        check_in: str = "",
        stop: threading.Event | None = None,
        check: Any = None,
    ) -> dict[str, Any]:
        """Broadcast one update (trainer_bridge/transports/nccl_broadcast.py):
        with `check_in`, only once every engine worker entered its receive
        (NotCheckedIn when `stop` is set first: nothing was sent, the group
        is intact)."""
        t0 = time.perf_counter()
        timing = send_update(self, metas, sizes, tensors, check_in, stop, check)
        self.last_send_seconds = time.perf_counter() - t0
        nbytes = int(sum(sizes))
        self.last_send_timing = timing
        return {
            "bytes": nbytes,
            "seconds": self.last_send_seconds,
            "GBps": nbytes / timing["send_s"] / 1e9 if timing["send_s"] > 0 else None,
            **timing,
        }

    def close(self) -> None:
        if self.comm is not None:
            try:
                self.comm.destroy()
            except Exception as e:  # a broken group may fail to tear down: it is dropped either way
                log.warning("nccl_destroy_failed", error=repr(e))
            self.comm = None
        self.store = None
        self._pack_bufs = []


# The trainer's groups, one per (engine set, device, host, sender rank), kept for later updates.
_NCCL_SENDERS: dict[tuple[Any, ...], NcclSender] = {}


def nccl_sender(
    engines: list[P.EngineView], options: dict[str, Any], tensors: list[Any], rank: int | None = None
) -> tuple[tuple[Any, ...], NcclSender]:
    """The trainer's one NcclSender for this engine set (made on first use, kept
    for later updates; another engine set closes the old group)."""
    import torch

    world = 1 + sum((e.tp or 1) * (e.pp or 1) for e in engines)
    dev = options.get("device")
    dev = str(torch.device(dev) if dev is not None else device_of(tensors, None))
    host = options.get("nccl_host", "127.0.0.1")
    # several senders: each rank owns a group (None: the one-sender update's group)
    key = (world, dev, host, tuple(sorted(e.engine_id for e in engines)), rank)
    s = _NCCL_SENDERS.get(key)
    if s is None:
        for k in [k for k in _NCCL_SENDERS if k[-1] == rank]:  # another engine set: that group is done
            _NCCL_SENDERS.pop(k).close()
        s = NcclSender(
            world,
            host=host,
            port=int(options.get("nccl_port", 0)),
            device=dev,
            timeout_s=float(options.get("nccl_timeout_s", 300.0)),
        )
        _NCCL_SENDERS[key] = s
    return key, s


async def warm_up_nccl(
    client: Any, options: dict[str, Any] | None = None, targets: list[str] | None = None, timeout_s: float = 120.0
) -> dict[str, Any]:
    """Set the NCCL group up now, ahead of the first update (see the module
    doc): an empty transaction the engines join the group in. Returns where the
    time went. The sender is the one later update_weights(transport="nccl")
    calls with the same options and engines use."""
    options = dict(options or {})
    t0 = time.perf_counter()
    h = await client.health_view()
    engines = [e for e in h.engines.values() if (e.healthy or e.stale) and (targets is None or e.engine_id in targets)]
    if not engines:
        raise ControlError("warm_up_nccl: no healthy engine to set the NCCL group up with", missing=list(targets or []))
    eids = [e.engine_id for e in engines]
    key, s = nccl_sender(engines, options, [], options.get("sender_rank"))
    if s.comm is not None:
        return {"seconds": round(time.perf_counter() - t0, 4), "reused": True}
    learn_update_id(client, h)
    uid = take_update_id(client)  # the head binds update ids (trainer_bridge/weights.py)
    begin = P.BeginWeightUpdate(uid, Transport.NCCL, [], [], target="model", transport_args=s.args())
    t1 = time.perf_counter()
    try:
        await client.control(begin, targets=eids, timeout_s=timeout_s)
        t2 = time.perf_counter()
        acks = asyncio.ensure_future(client.control(P.ReceiveWeights(uid), targets=eids, timeout_s=timeout_s))
        await asyncio.sleep(0)
        try:
            await asyncio.to_thread(s.connect)
        except BaseException:
            drop_group(key, s)
            raise
        t3 = time.perf_counter()
        res = await acks
        t4 = time.perf_counter()
    finally:
        try:
            await client.control(P.AbortWeightUpdate(uid), targets=eids, timeout_s=min(timeout_s, 10.0), strict=False)
        except Exception as e:  # best effort: the engines drop an idle update after their prepare_ttl_s
            log.warning("nccl_warm_up_abort_failed", update_id=uid, error=repr(e))
    engine = {}
    for eid, r in (res or {}).items():
        d = getattr(r, "detail", None) or (r.get("detail") if isinstance(r, dict) else None) or {}
        engine[eid] = d.get("nccl", d)
    return {
        "seconds": round(time.perf_counter() - t0, 4),
        "health_s": round(t1 - t0, 4),
        "begin_s": round(t2 - t1, 4),
        "connect_s": round(t3 - t2, 4),
        "acks_after_connect_s": round(t4 - t3, 4),
        "trainer": dict(s.connect_timing),
        "engines": engine,
    }


def drop_group(key: tuple[Any, ...], sender: Any) -> None:
    """A broken broadcast breaks the group: never reuse it (the next update makes a new one)."""
    _NCCL_SENDERS.pop(key, None)
    sender.close()


class NcclLink:
    """One sender's nccl delivery: the op carrying the part (the begin of a
    one-sender update, a one-trip begin, or a ReceiveWeights) is published,
    and the broadcast runs while the engines wait inside it."""

    transport: ClassVar[Transport] = Transport.NCCL
    # The NaN/inf check rides beside the broadcast (NcclArgs.verdict): the
    # engines refuse the update after their last bucket unless it said ok.
    check_after_begin: ClassVar[bool] = False
    check_in_band: ClassVar[bool] = True
    keeps_buffers: ClassVar[bool] = False
    # Steady state in ONE op (trainer_bridge/transports/one_trip.py): the
    # layout is the plan's metas and sizes; the engines keep them and their staging.
    one_trip: ClassVar[bool] = True

    def __init__(
        self,
        engines: list[P.EngineView],
        options: dict[str, Any],
        *,
        part: bool,
        rank: int | None,
        tensors: list[Any],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        zero_copy: bool = False,
        written: Any = None,
    ) -> None:
        self.options = options
        self.is_part = part
        self.key, self.sender = nccl_sender(engines, options, tensors, rank)
        self._payload: tuple[list[Any], list[int], list[Any]] = ([], [], [])
        self._check_in = ""
        self.check: Any = None  # launches the in-band NaN/inf check (gpu.py sets it before part())
        self.bad: str | None = None  # what it found, once the broadcast ran

    @staticmethod
    def plan(
        cast_named: list[tuple[str, Any]], named: list[tuple[str, Any]], options: dict[str, Any], bucket_bytes: int
    ) -> tuple[list[Any], list[int], list[Any], bool]:
        metas, sizes, tensors = plan_buckets(cast_named, bucket_bytes)
        return metas, sizes, tensors, False

    def part(self, metas: list[Any], sizes: list[int], tensors: list[Any]) -> tuple[list[bytes], NcclArgs]:
        self._payload = (metas, sizes, tensors)
        self._check_in = uuid.uuid4().hex  # fresh per op: see NcclArgs.check_in
        args = self.sender.args(weight_check=bool(self.options.get("weight_check")), sender_group=self.is_part)
        return [], msgspec.structs.replace(args, check_in=self._check_in, verdict=self.check is not None)

    async def deliver(self, op: Awaitable[Any], timeout_s: float) -> Any:
        """Publish `op` (the awaitable that sends it and gathers its acks),
        broadcast once every engine worker checked in (on a thread: NCCL
        calls block), then return its acks.

        If the acks come back first (the op was refused before the receive),
        nothing is broadcast and the group stays usable: their error is
        raised. Hazard: if the broadcast fails midway the group is broken: it
        is dropped here and the caller aborts."""
        acks = asyncio.ensure_future(op)
        stop = threading.Event()
        await asyncio.sleep(0)  # the op is on the wire before the first broadcast
        send = asyncio.ensure_future(
            asyncio.to_thread(self.sender.send, *self._payload, self._check_in, stop, self.check)
        )
        try:
            await asyncio.wait({acks, send}, return_when=asyncio.FIRST_COMPLETED)
            if not send.done():
                stop.set()  # the op is over without the broadcast: do not start it
            await send
            self.bad = self.sender.last_verdict
        except NotCheckedIn:
            return await acks  # raises the op's error (nothing was sent: the group is fine)
        except BaseException:
            stop.set()
            drop_group(self.key, self.sender)
            try:
                await asyncio.wait_for(acks, timeout_s)
            except BaseException as e:  # the broadcast's error is the one to raise
                log.warning("nccl_acks_after_broken_broadcast", error=repr(e))
            raise
        res = await acks
        if self._check_in and getattr(self.sender, "store", None) is not None:
            forget_token(self.sender.store, self._check_in)
        return res

    def release(self) -> None:
        """Nothing to free: the group is kept for later updates."""


KIND = GpuKind(NcclLink)
