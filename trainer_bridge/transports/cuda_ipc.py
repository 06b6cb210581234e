"""The cuda_ipc transport, trainer side (trainer and engines on the same GPU(s)).

Two round trips per update (the sequence `Client.update_weights` runs, see
trainer_bridge/transports/gpu.py; a zero-copy update whose layout the engines
already hold is one: trainer_bridge/transports/one_trip.py):
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
The engine side is engine_node/transports/cuda_ipc.py and the vLLM backend
(engine_node.backends.vllm.backend + vllm/worker_ext).

torch is imported lazily.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Awaitable, Iterable
from typing import Any, ClassVar

import structlog

from bus import protocol as P
from bus.protocol import TensorMeta
from bus.tensors import DEFAULT_BUCKET_BYTES, dtype_name, plan_buckets
from bus.transport import CudaIpcArgs, Transport
from trainer_bridge.transports.gpu import GpuKind
from trainer_bridge.transports.packing import by_bucket, device_of, pack_fast

log = structlog.get_logger("trainer_bridge.transports.cuda_ipc")


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
        dev = device_of(tensors, self.device)
        t0 = time.perf_counter()
        bufs = [pack_fast(i, ms, sizes, ts, dev) for i, (ms, ts) in enumerate(by_bucket(metas, tensors, len(sizes)))]
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


# ---------------------------------------------------------------- zero-copy
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
    except (AttributeError, TypeError, RuntimeError):  # not (plain) tensors: no cache
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
        metas.append(TensorMeta(name, dtype_name(t), list(t.shape), i, 0, nbytes))
        sizes.append(nbytes)
        tensors.append(t)
    return (metas, sizes, tensors) if tensors else None


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


class CudaIpcLink:
    """One sender's cuda_ipc delivery: the handles ride on the op that carries
    the part (the begin of a one-sender update, or a ReceiveWeights); the
    buckets live until release() (after the commit / abort is acked)."""

    transport: ClassVar[Transport] = Transport.CUDA_IPC
    # The NaN/inf check runs on the GPU while the begin makes its round trip
    # (nothing is written on the engines before the commit).
    check_after_begin: ClassVar[bool] = True
    keeps_buffers: ClassVar[bool] = True  # the engines read the trainer's memory at the commit

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
        self.sender = CudaIpcSender(bucket_bytes, device=options.get("device"))
        self.options = options
        self.zero_copy = zero_copy
        self.written = written  # record_written's event: what share_in_place waits for
        self.last_share_seconds = 0.0

    @staticmethod
    def plan(
        cast_named: list[tuple[str, Any]], named: list[tuple[str, Any]], options: dict[str, Any], bucket_bytes: int
    ) -> tuple[list[Any], list[int], list[Any], bool]:
        """(metas, sizes, tensors, zero_copy). zero_copy (update_weights(zero_copy=True)):
        in place only when nothing was cast (a cast tensor is a temporary:
        sharing it would pin a new allocation every update) and every tensor
        can be shared as it is; else the packed buckets, as usual."""
        planned = None
        if options.get("zero_copy"):
            uncast = all(
                c is t or c.data_ptr() == t.data_ptr() for (_, c), (_, t) in zip(cast_named, named, strict=True)
            )
            planned = plan_zero_copy(cast_named) if uncast else None
            if planned is None:
                log.warning("zero_copy_unavailable", reason="a tensor is cast, not contiguous, or not on one GPU")
        if planned is not None:
            return planned[0], planned[1], planned[2], True
        metas, sizes, tensors = plan_buckets(cast_named, bucket_bytes)
        return metas, sizes, tensors, False

    def part(self, metas: list[Any], sizes: list[int], tensors: list[Any]) -> tuple[list[bytes], CudaIpcArgs]:
        """Pack and share the buckets now (zero-copy: share the tensors
        themselves); they live until release()."""
        t0 = time.perf_counter()
        try:
            if self.zero_copy:
                handles = share_in_place(tensors, self.written)
            else:
                handles = self.sender.share(metas, sizes, tensors)
        finally:
            self.last_share_seconds = time.perf_counter() - t0
        return handles, CudaIpcArgs(weight_check=bool(self.options.get("weight_check")), keep_maps=self.zero_copy)

    async def deliver(self, op: Awaitable[Any], timeout_s: float) -> Any:
        return await op

    def release(self) -> None:
        self.sender.release()


KIND = GpuKind(CudaIpcLink)
