"""Methods injected into every vLLM worker process (``worker_extension_cls``).

The vLLM backend starts its engine with
``worker_extension_cls="engine_node.backends.vllm_worker_ext.RolloutBusWorkerExtension"``;
vLLM then adds this class to the bases of its GPU worker, so the methods
below run on *every* worker (every TP/PP rank) through
``AsyncLLM.collective_rpc("rollout_bus_…", args=…)``.

A weight update is a transaction on each worker:
  rollout_bus_begin(update_id, metas)      metas: [[name, dtype, shape, bucket, offset, nbytes], …]
  rollout_bus_recv_ipc(update_id, handles) cuda_ipc: map each bucket, copy it into a local buffer
  rollout_bus_nccl_init(...) + rollout_bus_recv_nccl(update_id, bucket_sizes)
                                           nccl: receive each bucket broadcast by the trainer (rank 0)
  rollout_bus_finish(update_id, path=None) apply what is staged (or the CPU tensors saved at
                                           `path` by the zmq transport) with model.load_weights
  rollout_bus_abort(update_id)             drop what is staged
Every worker receives the full (unsharded) tensors: vLLM's ``load_weights``
shards them for its TP rank itself.

Nothing here imports vllm at module level, so the module imports on machines
without vLLM (the CPU tests import it to check the packing helpers).
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch


def torch_dtype(name: str) -> torch.dtype:
    name = name.removeprefix("torch.")
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def named_views(metas: list[Any], buckets: dict[int, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Slice flat uint8 buckets into the named tensors of `metas`."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, dtype, shape, bucket, offset, nbytes in metas:
        buf = buckets[int(bucket)]
        raw = buf[int(offset) : int(offset) + int(nbytes)]
        dt = torch_dtype(dtype)
        itemsize = torch.empty((), dtype=dt).element_size()
        if int(offset) % itemsize:
            raw = raw.clone()  # view(dtype) needs an aligned storage offset
        out.append((name, raw.view(dt).view(list(shape))))
    return out


def local_device_for_uuid(uuid: str | None, default: int) -> int:
    if not uuid:
        return default
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise RuntimeError(f"the CUDA IPC handle's GPU {uuid} is not visible to this worker")


def open_ipc_handle(handle: bytes, default_device: int) -> torch.Tensor:
    """Rebuild a tensor from a pickled (rebuild_fn, args, uuid) of
    torch.multiprocessing.reductions.reduce_tensor (see trainer_bridge.gpu_transports)."""
    fn, args, uuid = pickle.loads(handle)
    args = list(args)
    # args[6] is the storage's device index in the sender's numbering: map the
    # physical GPU (uuid) to this process's numbering.
    args[6] = local_device_for_uuid(uuid, default_device)
    return fn(*args)


class _LoraUnwrapped:
    """While active, every LoRA wrapper module (vLLM's `…WithLoRA`, which keeps the
    original layer as `.base_layer`) is replaced in its parent by that base layer,
    so `model.load_weights` sees the checkpoint's parameter names. The base layer's
    parameters are the ones the wrapper uses: loading in place updates both."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.swaps: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []

    def __enter__(self) -> "_LoraUnwrapped":
        for name, mod in list(self.model.named_modules()):
            base = getattr(mod, "base_layer", None)
            if name and isinstance(base, torch.nn.Module):
                parent_name, _, attr = name.rpartition(".")
                parent = self.model.get_submodule(parent_name) if parent_name else self.model
                if parent._modules.get(attr) is mod:
                    self.swaps.append((parent, attr, mod))
        for parent, attr, mod in self.swaps:
            parent._modules[attr] = mod.base_layer
        return self

    def __exit__(self, *exc: Any) -> None:
        for parent, attr, mod in reversed(self.swaps):
            parent._modules[attr] = mod
        self.swaps = []


class RolloutBusWorkerExtension:
    """Mixed into vLLM's Worker: `self` has model_runner, device, rank, local_rank."""

    # -- helpers (underscored names are not called over RPC)
    def _rb_state(self) -> dict[str, Any]:
        st = self.__dict__.get("_rollout_bus_state")
        if st is None:
            st = {"update_id": None, "metas": [], "buckets": {}, "nccl": None, "nccl_key": None}
            self.__dict__["_rollout_bus_state"] = st
        return st

    def _rb_model(self):
        mr = self.model_runner
        return mr.get_model() if hasattr(mr, "get_model") else mr.model

    def _rb_device(self) -> torch.device:
        dev = getattr(self, "device", None)
        if isinstance(dev, torch.device) and dev.type == "cuda":
            return dev
        return torch.device("cuda", torch.cuda.current_device())

    def _rb_check(self, update_id: str) -> dict[str, Any]:
        st = self._rb_state()
        if st["update_id"] != update_id:
            raise RuntimeError(f"worker {getattr(self, 'rank', '?')}: no weight update {update_id!r} begun "
                               f"(current: {st['update_id']!r})")
        return st

    # -- RPC methods
    def rollout_bus_info(self) -> dict[str, Any]:
        dev = self._rb_device()
        free, total = torch.cuda.mem_get_info(dev)
        return {
            "rank": int(getattr(self, "rank", 0)),
            "local_rank": int(getattr(self, "local_rank", 0)),
            "device": dev.index,
            "uuid": str(torch.cuda.get_device_properties(dev).uuid),
            "gpu_free": int(free),
            "gpu_total": int(total),
        }

    def rollout_bus_begin(self, update_id: str, metas: list[Any]) -> int:
        st = self._rb_state()
        st.update({"update_id": update_id, "metas": [list(m) for m in metas], "buckets": {}})
        return len(metas)

    def rollout_bus_recv_ipc(self, update_id: str, handles: list[Any]) -> dict[str, Any]:
        st = self._rb_check(update_id)
        dev = self._rb_device()
        t0 = time.perf_counter()
        nbytes = 0
        with torch.cuda.device(dev):
            for i, h in enumerate(handles):
                if isinstance(h, dict):  # one handle per GPU (uuid -> bytes): take ours, else any
                    uuid = str(torch.cuda.get_device_properties(dev).uuid)
                    h = h.get(uuid) or next(iter(h.values()))
                src = open_ipc_handle(bytes(h), dev.index)
                dst = torch.empty(src.numel(), dtype=torch.uint8, device=dev)
                dst.copy_(src.view(torch.uint8).reshape(-1), non_blocking=True)
                st["buckets"][i] = dst
                nbytes += dst.numel()
                del src
            torch.cuda.synchronize(dev)
        return {"bytes": nbytes, "seconds": time.perf_counter() - t0}

    def rollout_bus_nccl_init(self, key: str, host: str, port: int, world_size: int, rank_offset: int,
                              timeout_s: float = 120.0) -> dict[str, Any]:
        """Join the trainer's NCCL group as rank rank_offset + this worker's rank
        (the trainer is rank 0 and hosts the TCP store at host:port)."""
        from datetime import timedelta

        from torch.distributed import TCPStore
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        st = self._rb_state()
        if st["nccl"] is not None and st["nccl_key"] == key:
            return {"rank": st["nccl"].rank, "reused": True}
        self.rollout_bus_nccl_close()
        rank = int(rank_offset) + int(getattr(self, "rank", 0))
        t0 = time.perf_counter()
        store = TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), use_libuv=False)
        pg = StatelessProcessGroup(rank=rank, world_size=int(world_size), store=store)
        comm = PyNcclCommunicator(pg, device=self._rb_device())
        st["nccl"], st["nccl_key"] = comm, key
        return {"rank": rank, "reused": False, "seconds": time.perf_counter() - t0}

    def rollout_bus_nccl_close(self) -> None:
        st = self._rb_state()
        comm, st["nccl"], st["nccl_key"] = st["nccl"], None, None
        if comm is not None:
            try:
                comm.destroy()
            except Exception:  # noqa: BLE001
                pass

    def rollout_bus_recv_nccl(self, update_id: str, bucket_sizes: list[int]) -> dict[str, Any]:
        st = self._rb_check(update_id)
        comm = st["nccl"]
        if comm is None:
            raise RuntimeError("no NCCL group: rollout_bus_nccl_init first")
        dev = self._rb_device()
        t0 = time.perf_counter()
        with torch.cuda.device(dev):
            for i, n in enumerate(bucket_sizes):
                buf = torch.empty(int(n), dtype=torch.uint8, device=dev)
                comm.broadcast(buf, src=0)
                st["buckets"][i] = buf
            torch.cuda.synchronize(dev)
        return {"bytes": int(sum(bucket_sizes)), "seconds": time.perf_counter() - t0}

    def rollout_bus_finish(self, update_id: str, path: str | None = None) -> dict[str, Any]:
        st = self._rb_check(update_id)
        dev = self._rb_device()
        t0 = time.perf_counter()
        try:
            if path is not None:  # zmq transport: CPU tensors saved by the backend process
                named = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                named = [(n, t) for n, t in named]
            else:
                named = named_views(st["metas"], st["buckets"])
            model = self._rb_model()
            with torch.cuda.device(dev), _LoraUnwrapped(model):
                loaded = model.load_weights(iter(named))
                torch.cuda.synchronize(dev)
        finally:
            st.update({"update_id": None, "metas": [], "buckets": {}})
        return {"tensors": len(named), "params_loaded": len(loaded) if loaded is not None else None,
                "seconds": time.perf_counter() - t0}

    def rollout_bus_abort(self, update_id: str | None = None) -> None:
        st = self._rb_state()
        st.update({"update_id": None, "metas": [], "buckets": {}})
        torch.cuda.empty_cache()
