"""Trainer-side senders for the GPU weight transports (`cuda_ipc`, `nccl`).

Both pack the trainer's named tensors into flat uint8 buckets with the same
plan as the zmq transport (`bus.tensors.plan_buckets`, 256-byte aligned
offsets), so the `BeginWeightUpdate` is identical for every transport.
The engine side is `engine_node.backends.vllm_backend` + `vllm_worker_ext`
(every engine worker receives the full tensors; vLLM's load_weights shards them).

Call sequence (what `Client.update_weights` does; "cmd" = a control Command to
all targeted engines, gathered as {engine_id: ack}; the commit is the head's
two-phase decision, see trainer_bridge/weights.py):

cuda_ipc (trainer and engines on the same GPU(s)) — two round trips:
    s = CudaIpcSender(bucket_bytes)
    metas, sizes, handles = s.prepare(named_tensors)     # packs buckets on the GPU, syncs
    cmd BeginWeightUpdate(update_id, "cuda_ipc", metas, sizes, prepare=True, handles=handles)
                                                          # begin + map/validate every bucket (no copy)
                                                          # + prepare: the ack is the engine's vote
    cmd FinishWeightUpdate(update_id)                     # the head commits: load_weights FROM THE
                                                          # TRAINER'S BUCKETS, prefix cache reset, version
    s.release()                                           # only after the commit acks (or the abort's)
    on error: cmd AbortWeightUpdate(update_id); s.release()
  Contract: the engines' workers keep views into the trainer's buckets from
  the begin until FinishWeightUpdate/AbortWeightUpdate is acked (no staging
  copy on the engine side). Freeing or overwriting a bucket before that ack
  loads garbage. The source tensors themselves are free to change once
  prepare()/share() returned: the buckets are separate memory.
  handles: one `bytes` per bucket (pickled reduce_tensor tuple + the GPU's uuid:
  the engine maps the physical GPU to its own device numbering).

nccl (trainer on another GPU / node; trainer = rank 0) — two round trips:
    s = NcclSender(world_size=1 + sum(engine.tp for engine in engines), host=<trainer ip>)
                                                          # keep it for the trainer's lifetime
    metas, sizes, tensors = s.plan(named_tensors)
    publish BeginWeightUpdate(update_id, "nccl", metas, sizes, prepare=True,
                              transport_args=s.transport_args(sizes))
        WITHOUT waiting for its acks: begin + receive + prepare in one op (the
        engines block in the receive until every bucket has arrived; the first
        time they also join the NCCL group; the ack is the engine's vote)
    s.send(metas, sizes, tensors)                         # connect() on first use, broadcast each bucket
    gather the begin's acks
    cmd FinishWeightUpdate(update_id)                     # the head commits
  (A separate ReceiveWeights after the begin acked works too — warm_up_nccl
  does that — but costs a third round trip.)
  transport_args: host, port (the sender's TCPStore), world_size, group_id,
  bucket_sizes, timeout_s; engines take ranks 1.. from a counter in that store
  (or `rank_offset` when the bridge sets one per engine). If a broadcast fails
  midway, send AbortWeightUpdate and make a new NcclSender (the group is broken).

  Group set-up ahead of the first update (`warm_up_nccl`, what SkyRL's
  init_weight_update_communicator calls): an EMPTY transaction on the existing
  ops (BeginWeightUpdate with no tensors, ReceiveWeights, AbortWeightUpdate):
  the engines join the group inside the receive while the trainer connects,
  so the first real update finds the group, vLLM's NCCL library and the
  trainer's vLLM import all done. No weights and no version change.

torch is imported lazily; the NCCL sender needs vLLM importable in the trainer
process (it uses vLLM's PyNcclCommunicator, the same NCCL library the engines use).
"""

from __future__ import annotations

import pickle
import time
import uuid
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from bus import protocol as P
from bus.errors import BadRequest
from bus.tensors import DEFAULT_BUCKET_BYTES, first_nonfinite, plan_buckets


def _device_of(tensors: list[Any], device: Any) -> Any:
    import torch

    if device is not None:
        return torch.device(device)
    for t in tensors:
        if t.is_cuda:
            return t.device
    return torch.device("cuda", torch.cuda.current_device())


def pack_fast(index: int, metas: list[Any], sizes: list[int], tensors: list[Any], device: Any) -> Any:
    """bus.tensors.pack_bucket's bytes (the same layout), with the per-tensor
    copies launched as ONE torch._foreach_copy_ per dtype instead of a Python
    loop of copy_ (~300 launches for a 0.5B model)."""
    import torch

    buf = torch.empty(sizes[index], dtype=torch.uint8, device=device)
    groups: dict[Any, tuple[list[Any], list[Any]]] = {}
    typed: dict[Any, Any] = {}  # dtype -> the whole bucket viewed as it (buckets are 256-byte aligned)
    for m, t in zip(metas, tensors, strict=True):
        if m.bucket != index or m.nbytes == 0:
            continue
        if t.device != buf.device or not t.is_contiguous() or m.offset % t.element_size():
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buf[m.offset : m.offset + m.nbytes].copy_(src, non_blocking=True)
            continue
        base = typed.get(t.dtype)
        if base is None:
            base = typed[t.dtype] = buf[: buf.numel() // t.element_size() * t.element_size()].view(t.dtype)
        a = m.offset // t.element_size()
        g = groups.setdefault(t.dtype, ([], []))
        g[0].append(base[a : a + t.numel()])
        g[1].append(t.detach().view(-1))
    for dsts, srcs in groups.values():
        torch._foreach_copy_(dsts, srcs)
    return buf


class CudaIpcSender:
    """Share buckets of GPU tensors with engines on the same GPU via CUDA IPC."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: Any = None) -> None:
        self.bucket_bytes = int(bucket_bytes)
        self.device = device
        self._buffers: list[Any] = []
        self.last_pack_seconds = 0.0

    def plan(self, named: Iterable[tuple[str, Any]]):
        return plan_buckets(list(named), self.bucket_bytes)

    def prepare(self, named: Iterable[tuple[str, Any]]) -> tuple[list[Any], list[int], list[bytes]]:
        """Plan and pack every bucket on the GPU; returns (metas, bucket_sizes, handles).
        The buckets stay alive (and GPU memory stays used) until release()."""
        metas, sizes, tensors = self.plan(named)
        return metas, sizes, self.share(metas, sizes, tensors)

    def share(self, metas: list[Any], sizes: list[int], tensors: list[Any]) -> list[bytes]:
        """Pack the buckets of an existing plan on the GPU; one IPC handle (bytes) per bucket."""
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        self.release()
        dev = _device_of(tensors, self.device)
        t0 = time.perf_counter()
        bufs = [pack_fast(i, metas, sizes, tensors, dev) for i in range(len(sizes))]
        torch.cuda.synchronize(dev)
        self.last_pack_seconds = time.perf_counter() - t0
        uid = str(torch.cuda.get_device_properties(dev).uuid)
        handles = []
        for b in bufs:
            fn, args = reduce_tensor(b)
            handles.append(pickle.dumps((fn, args, uid)))
        self._buffers = bufs
        return handles

    def release(self) -> None:
        self._buffers = []

    def close(self) -> None:
        self.release()


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
            import socket

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

    def transport_args(self, bucket_sizes: list[int] | None = None) -> dict[str, Any]:
        a: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "world_size": self.world_size,
            "group_id": self.group_id,
            "timeout_s": self.timeout_s,
        }
        if bucket_sizes is not None:
            a["bucket_sizes"] = [int(s) for s in bucket_sizes]
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

    def send(self, metas: list[Any], sizes: list[int], tensors: list[Any]) -> dict[str, Any]:
        import torch

        t0 = time.perf_counter()
        self.connect()
        t1 = time.perf_counter()
        pack = 0.0
        with torch.cuda.device(self.device):
            for i in range(len(sizes)):
                p0 = time.perf_counter()
                buf = pack_fast(i, metas, sizes, tensors, self.device)
                pack += time.perf_counter() - p0
                self.comm.broadcast(buf, src=0)
            torch.cuda.synchronize(self.device)
        self.last_send_seconds = time.perf_counter() - t1
        nbytes = int(sum(sizes))
        self.last_send_timing = {
            "connect_s": round(t1 - t0, 4),
            "pack_launch_s": round(pack, 4),
            "send_s": round(self.last_send_seconds, 4),
        }
        return {
            "bytes": nbytes,
            "seconds": self.last_send_seconds,
            "GBps": nbytes / self.last_send_seconds / 1e9 if self.last_send_seconds > 0 else None,
            **self.last_send_timing,
        }

    def close(self) -> None:
        if self.comm is not None:
            try:
                self.comm.destroy()
            except Exception:
                pass
            self.comm = None
        self.store = None


# ---------------------------------------------------------------- bridge adapter
# trainer_bridge.weights.push_weights calls make_sender(...) for a GPU transport,
# puts sender.transport_args() into the BeginWeightUpdate (prepare=True: begin +
# receive + prepare in one op); cuda_ipc: the begin also carries sender.handles();
# nccl: sender.send_during(<the begin's control call>, timeout_s) broadcasts while
# the engines wait in it. Then the commit.

_NCCL_SENDERS: dict[tuple[Any, ...], NcclSender] = {}


# ---------------------------------------------------------------- zero-copy cuda_ipc
#
# update_weights(..., transport="cuda_ipc", zero_copy=True): no buckets. Every
# tensor is its own "bucket" (offset 0, its exact byte size) and its handle
# names the trainer's own parameter memory, so the engines copy straight from
# the parameters into theirs: one device copy per update instead of two (pack +
# load), and no allocation. The handles of a parameter that has not moved are
# the same bytes every update (cached here), so the engines keep their maps
# (transport_args keep_maps) and open nothing after the first update.
# Contract (stronger than the packed mode's): the parameters must not be written
# from the moment update_weights is called until it returns (the commit's ack);
# a trainer that awaits update_weights between optimizer steps satisfies it.
# Hazard: the engines' kept maps pin the memory of a parameter the trainer frees
# (torch's IPC ref counter parks it), until their next update or their sleep.

_ZERO_COPY_HANDLES: dict[tuple[Any, ...], bytes] = {}
# The last update's whole plan, keyed by every tensor's name, address, dtype
# and shape: a trainer pushing the same parameters again (every RL step) skips
# building hundreds of metas (~1 ms of Python per 100 tensors).
_ZERO_COPY_PLAN: list[Any] = [None, None]  # [key, (metas, sizes)]


def _zero_copy_key(named: list[tuple[str, Any]]) -> tuple[Any, ...] | None:
    try:
        return tuple((n, t.data_ptr(), t.dtype, t.shape, t.device) for n, t in named)
    except Exception:  # not tensors: no cache
        return None


def plan_zero_copy(named: list[tuple[str, Any]]) -> tuple[list[Any], list[int], list[Any]] | None:
    """(metas, sizes, tensors) with one tensor per bucket, or None when a
    tensor cannot be shared in place (not on a GPU, not contiguous, on another
    GPU than the first, empty): the caller packs buckets instead."""
    key = _zero_copy_key(named)
    if key is not None and _ZERO_COPY_PLAN[0] == key and all(t.is_contiguous() for _, t in named):
        metas_c, sizes_c = _ZERO_COPY_PLAN[1]
        return list(metas_c), list(sizes_c), [t for _, t in named]
    planned = _plan_zero_copy(named)
    _ZERO_COPY_PLAN[:] = [key, (planned[0], planned[1])] if planned is not None and key is not None else [None, None]
    return planned


def _plan_zero_copy(named: list[tuple[str, Any]]) -> tuple[list[Any], list[int], list[Any]] | None:
    from bus.tensors import dtype_name

    metas: list[Any] = []
    sizes: list[int] = []
    tensors: list[Any] = []
    dev = None
    for i, (name, t) in enumerate(named):
        if not getattr(t, "is_cuda", False) or not t.is_contiguous() or t.numel() == 0:
            return None
        if dev is None:
            dev = t.device
        elif t.device != dev:
            return None
        nbytes = t.numel() * t.element_size()
        metas.append(P.TensorMeta(name, dtype_name(t), list(t.shape), i, 0, nbytes))
        sizes.append(nbytes)
        tensors.append(t)
    return (metas, sizes, tensors) if tensors else None


def record_written(named: list[tuple[str, Any]]) -> Any:
    """A CUDA event after everything queued so far on the current stream of
    the tensors' GPU (None: no GPU tensor): what share_in_place waits for."""
    import torch

    dev = next((t.device for _, t in named if getattr(t, "is_cuda", False)), None)
    if dev is None:
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(dev))
    return ev


def share_in_place(tensors: list[Any], written: Any = None) -> list[bytes]:
    """One IPC handle per tensor, naming its own memory (a flat uint8 view),
    cached while the tensor stays where it is (same storage address, offset,
    size and dtype). Waits first for the trainer's writes (`written`, an event
    of record_written; None: the whole device): the engines read the tensors
    from other processes, after this returns."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensors:
        return []
    dev = tensors[0].device
    if written is not None:
        written.synchronize()
    else:
        torch.cuda.synchronize(dev)
    uid = str(torch.cuda.get_device_properties(dev).uuid)
    out: list[bytes] = []
    seen: dict[tuple[Any, ...], bytes] = {}
    for t in tensors:
        st = t.untyped_storage()
        key = (uid, st.data_ptr(), st.nbytes(), t.storage_offset(), t.numel(), str(t.dtype))
        h = _ZERO_COPY_HANDLES.get(key) or seen.get(key)
        if h is None:
            fn, args = reduce_tensor(t.detach().reshape(-1).view(torch.uint8))
            h = pickle.dumps((fn, args, uid))
        seen[key] = h
        out.append(h)
    # Only this update's tensors stay cached: a key that did not come again
    # may be memory the trainer freed (an address reused by another tensor
    # would get a fresh handle, as its storage differs).
    _ZERO_COPY_HANDLES.clear()
    _ZERO_COPY_HANDLES.update(seen)
    return out


def make_sender(
    transport: str,
    metas: list[Any],
    sizes: list[int],
    tensors: list[Any],
    engines: list[P.EngineView],
    options: dict[str, Any],
) -> Any:
    """options (update_weights(**transport_options)): device, nccl_host, nccl_port, nccl_timeout_s,
    weight_check."""
    if transport == "cuda_ipc":
        return _IpcBridgeSender(metas, sizes, tensors, options)
    if transport == "nccl":
        return _NcclBridgeSender(metas, sizes, tensors, engines, options)
    raise ValueError(f"no GPU sender for transport {transport!r}")


class _IpcBridgeSender:
    def __init__(self, metas: list[Any], sizes: list[int], tensors: list[Any], options: dict[str, Any]) -> None:
        self.metas, self.sizes, self.tensors = metas, sizes, tensors
        self.sender = CudaIpcSender(device=options.get("device"))
        self.options = options
        # zero-copy: _push_gpu planned one tensor per bucket (plan_zero_copy)
        self.zero_copy = bool(options.get("zero_copy")) and len(sizes) == len(tensors)
        self.last_share_seconds = 0.0
        self.written: Any = None  # record_written's event (set by _push_gpu)

    def transport_args(self) -> dict[str, Any]:
        a = {"bucket_sizes": [int(x) for x in self.sizes], **_check_arg(self.options)}
        if self.zero_copy:
            a["keep_maps"] = True
        return a

    def handles(self) -> list[bytes]:
        """Pack and share the buckets now (zero-copy: share the tensors
        themselves): the handles travel in the begin (begin + receive + prepare
        in one op). They live until release()."""
        t0 = time.perf_counter()
        try:
            if self.zero_copy:
                return share_in_place(self.tensors, self.written)
            return self.sender.share(self.metas, self.sizes, self.tensors)
        finally:
            self.last_share_seconds = time.perf_counter() - t0

    def release(self) -> None:
        self.sender.release()


def _check_arg(options: dict[str, Any]) -> dict[str, Any]:
    """update_weights(..., weight_check=True): the engines verify, bit for bit,
    that their fast write path equals vLLM's load_weights (slower: for checks)."""
    return {"weight_check": True} if options.get("weight_check") else {}


def _nccl_sender(
    engines: list[P.EngineView], options: dict[str, Any], tensors: list[Any]
) -> tuple[tuple[Any, ...], NcclSender]:
    """The trainer's one NcclSender for this engine set (made on first use, kept
    for later updates; another engine set closes the old group)."""
    import torch

    world = 1 + sum((e.tp or 1) * (e.pp or 1) for e in engines)
    dev = options.get("device")
    dev = str(torch.device(dev) if dev is not None else _device_of(tensors, None))
    host = options.get("nccl_host", "127.0.0.1")
    rank = options.get("sender_rank")  # several senders: each rank owns a group
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
    import asyncio

    from bus.errors import ControlError

    options = dict(options or {})
    t0 = time.perf_counter()
    h = await client.health_view()
    engines = [e for e in h.engines.values() if (e.healthy or e.stale) and (targets is None or e.engine_id in targets)]
    if not engines:
        raise ControlError("warm_up_nccl: no healthy engine to set the NCCL group up with", missing=list(targets or []))
    eids = [e.engine_id for e in engines]
    key, s = _nccl_sender(engines, options, [])
    if s.comm is not None:
        return {"seconds": round(time.perf_counter() - t0, 4), "reused": True}
    uid = "warmup-" + uuid.uuid4().hex[:12]
    begin = P.BeginWeightUpdate(uid, "nccl", [], [], target="model", transport_args=s.transport_args([]))
    t1 = time.perf_counter()
    try:
        await client.control(begin, targets=eids, timeout_s=timeout_s)
        t2 = time.perf_counter()
        acks = asyncio.ensure_future(client.control(P.ReceiveWeights(uid), targets=eids, timeout_s=timeout_s))
        await asyncio.sleep(0)
        try:
            await asyncio.to_thread(s.connect)
        except BaseException:
            _NCCL_SENDERS.pop(key, None)
            s.close()
            raise
        t3 = time.perf_counter()
        res = await acks
        t4 = time.perf_counter()
    finally:
        try:
            await client.control(P.AbortWeightUpdate(uid), targets=eids, timeout_s=min(timeout_s, 10.0), strict=False)
        except Exception:
            pass
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


class _NcclBridgeSender:
    def __init__(
        self,
        metas: list[Any],
        sizes: list[int],
        tensors: list[Any],
        engines: list[P.EngineView],
        options: dict[str, Any],
    ) -> None:
        self.metas, self.sizes, self.tensors = metas, sizes, tensors
        self.options = options
        self.key, self.sender = _nccl_sender(engines, options, tensors)

    def transport_args(self) -> dict[str, Any]:
        return {**self.sender.transport_args(self.sizes), **_check_arg(self.options)}

    async def send_during(self, begin: Any, timeout_s: float) -> Any:
        """Publish the begin (begin + receive + prepare in one op: `begin` is
        the awaitable that sends it and gathers its acks), broadcast while the
        engines wait in it (on a thread: NCCL calls block), then return its acks.

        Hazard: if the broadcast fails midway the group is broken: it is
        dropped here (the next update makes a new one) and the caller aborts."""
        import asyncio

        acks = asyncio.ensure_future(begin)
        try:
            await asyncio.sleep(0)  # the begin is on the wire before the first broadcast
            await asyncio.to_thread(self.sender.send, self.metas, self.sizes, self.tensors)
        except BaseException:
            _NCCL_SENDERS.pop(self.key, None)
            self.sender.close()
            try:
                await asyncio.wait_for(acks, timeout_s)
            except BaseException:
                pass
            raise
        return await acks


# ---------------------------------------------------------------- several senders


class GpuPartSender:
    """One sender rank's part of a multi-sender update over cuda_ipc or nccl
    (`upd.sender(rank)` of a `client.weight_update(senders=n, transport=...)`,
    or `client.weight_sender(update_id, rank)` from the rank's own process).

    `send(named)` packs this rank's tensors into its own buckets and delivers
    them in ONE ReceiveWeights carrying its metas: cuda_ipc with its IPC
    handles, nccl over its own group (rank 0 of a group with every engine
    worker; one NcclSender per rank, kept for later updates). The engines
    append the part; the coordinator's commit is all-or-nothing.

    cuda_ipc hazard: the engines load straight from this rank's buckets at the
    COMMIT, so they must live until it is acked. The coordinator's own senders
    are released after its commit / abort; a sender in another process uses
    `async with` (its exit waits for the head's decision, `wait_released`)."""

    def __init__(
        self,
        client: Any,
        update_id: str,
        rank: int,
        engines: list[P.EngineView],
        transport: str,
        *,
        bucket_bytes: int,
        timeout_s: float,
        cast: Any,
        options: dict[str, Any],
        check_finite: bool = True,
    ) -> None:
        if transport not in ("cuda_ipc", "nccl"):
            raise ValueError(f"GpuPartSender: transport {transport!r} is not a GPU transport (cuda_ipc, nccl)")
        self.client = client
        self.update_id = update_id
        self.rank = rank
        self.engines = engines
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.cast = cast
        self.options = dict(options)
        self.check_finite = check_finite  # GPU bytes never pass the engine node: checked here
        self._ipc: CudaIpcSender | None = None
        self.stats: dict[str, Any] = {}

    async def send(self, named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        import asyncio

        t0 = time.perf_counter()
        named = [(n, self.cast(t.detach())) for n, t in named]
        if self.check_finite:
            bad = first_nonfinite(named)
            if bad is not None:
                raise BadRequest(
                    f"sender {self.rank}: tensor {bad!r} has NaN or inf values: not sent "
                    "(check_finite=False skips this check)",
                    field="tensors",
                )
        metas, sizes, tensors = plan_buckets(named, self.bucket_bytes)
        eids = [e.engine_id for e in self.engines]
        if self.transport == "cuda_ipc":
            self._ipc = CudaIpcSender(self.bucket_bytes, device=self.options.get("device"))
            handles = self._ipc.share(metas, sizes, tensors)
            op = P.ReceiveWeights(self.update_id, handles, sender=self.rank, tensors=metas, bucket_sizes=sizes)
            res = await self.client.control(op, targets=eids, timeout_s=self.timeout_s)
        else:
            key, ns = _nccl_sender(self.engines, {**self.options, "sender_rank": self.rank}, tensors)
            args = {**ns.transport_args(sizes), "sender_group": True}
            op = P.ReceiveWeights(
                self.update_id, sender=self.rank, tensors=metas, bucket_sizes=sizes, transport_args=args
            )
            # The engines block in the part's receive until every bucket arrived:
            # publish it, broadcast meanwhile (a thread: NCCL calls block), gather.
            acks = asyncio.ensure_future(self.client.control(op, targets=eids, timeout_s=self.timeout_s))
            try:
                await asyncio.sleep(0)
                await asyncio.to_thread(ns.send, metas, sizes, tensors)
            except BaseException:
                _NCCL_SENDERS.pop(key, None)
                ns.close()
                try:
                    await asyncio.wait_for(acks, self.timeout_s)
                except BaseException:
                    pass
                raise
            res = await acks
        self.stats = {
            "rank": self.rank,
            "buckets": len(sizes),
            "tensors": len(metas),
            "bytes": int(sum(sizes)),
            "seconds": round(time.perf_counter() - t0, 4),
            "engines": sorted(res),
        }
        return self.stats

    def release(self) -> None:
        """Free this rank's cuda_ipc buckets (only after the commit / abort is acked)."""
        if self._ipc is not None:
            self._ipc.release()
            self._ipc = None

    async def wait_released(self, timeout_s: float | None = None) -> str:
        """Wait until the head decided and applied the update (it is no longer
        open there), then release the buckets. Returns "done"; raises
        TimeoutError naming `timeout_s` when the coordinator never finished."""
        import asyncio

        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        end = time.monotonic() + limit
        while True:
            decided = (await self.client._query("weight_update_decisions", P.DecisionsView)).decisions
            if self.update_id not in decided or decided[self.update_id] == "abort":
                break  # the commit round is over (the head dropped it), or aborted
            if time.monotonic() > end:
                raise TimeoutError(
                    f"weight update {self.update_id}: the coordinator did not commit or abort within "
                    f"timeout_s={limit} (sender {self.rank} keeps its cuda_ipc buckets meanwhile)"
                )
            await asyncio.sleep(0.02)
        self.release()
        return "done"

    async def __aenter__(self) -> GpuPartSender:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._ipc is not None:
            await self.wait_released()
