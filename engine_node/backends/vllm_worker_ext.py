"""Methods injected into every vLLM worker process (``worker_extension_cls``).

The vLLM backend starts its engine with
``worker_extension_cls="engine_node.backends.vllm_worker_ext.RolloutBusWorkerExtension"``;
vLLM adds this class to the bases of its GPU worker, so the methods below run
on *every* worker (every TP/PP rank), called by the engine core's
``collective_rpc`` utility.

A weight update is a transaction on each worker; nothing touches the model
before commit:
  rollout_bus_begin(uid, metas, sizes)     metas: [[name, dtype, shape, bucket, offset, nbytes], …]
  rollout_bus_recv_ipc(uid, handles)       cuda_ipc: map the trainer's buckets and validate them.
                                           NO copy: the views point into the trainer's memory,
                                           which the trainer keeps alive until the commit's ack.
  rollout_bus_recv_nccl(uid, args)         nccl: join the trainer's group once (kept for later
                                           updates), receive every bucket into local GPU buffers
  rollout_bus_commit(uid, shm)             load_weights from what was received, or (zmq) from the
                                           backend's shared-memory file `shm` (one H2D copy per bucket)
  rollout_bus_abort(uid)                   drop what is staged
Every worker receives the full (unsharded) tensors: vLLM's ``load_weights``
shards them for its TP rank itself.

Also: the engine's processes must not outlive the engine node (see
`arm_parent_death`, run when this module is imported in a worker).

Nothing here imports vllm at module level, so the module imports on machines
without vLLM (the CPU tests import it).
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import threading
import time
import warnings
from typing import Any

import torch

from bus.tensors import unpack_bucket
from engine_node.backends import vllm_fp8

NODE_PID_ENV = "ROLLOUT_BUS_NODE_PID"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def arm_parent_death(poll_s: float = 0.5) -> str:
    """Make this process die with the engine node, whose pid the backend puts
    in the environment before vLLM spawns anything. A daemon thread polls:

    - "watch-parent": our parent is the node (TP=1: the worker lives inside
      the EngineCore process). When we are re-parented, the node is gone: exit.
    - "watch-node": our parent is the EngineCore (TP>1 workers). vLLM's death
      pipe already ends workers when the EngineCore dies, but nothing ends the
      EngineCore when the node dies: when the node's pid is gone, kill our
      parent (the EngineCore) and exit.

    Not prctl(PR_SET_PDEATHSIG): it fires when the *thread* that spawned us
    exits, and the node may build its backend on a short-lived thread.
    The window between spawn and this import (engine start-up) is not covered."""
    try:
        node = int(os.environ.get(NODE_PID_ENV, "0"))
    except ValueError:
        return "off"
    if node <= 0 or node == os.getpid():
        return "off"
    if os.getppid() == node:
        mode, victim = "watch-parent", 0

        def gone() -> bool:
            return os.getppid() != node
    else:
        mode, victim = "watch-node", os.getppid()

        def gone() -> bool:
            return not _alive(node)

    def watch() -> None:
        while not gone():
            time.sleep(poll_s)
        try:
            if victim > 1:
                os.kill(victim, signal.SIGKILL)
        finally:
            os._exit(1)

    threading.Thread(target=watch, name="rollout-bus-node-watch", daemon=True).start()
    return mode


PARENT_DEATH = arm_parent_death()


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

    def __enter__(self) -> _LoraUnwrapped:
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


def _on(dev: torch.device) -> Any:
    import contextlib

    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def _fresh_state() -> dict[str, Any]:
    return {"uid": None, "metas": [], "sizes": [], "buckets": {}}


class RolloutBusWorkerExtension:
    """Mixed into vLLM's Worker: `self` has model_runner, device, rank, local_rank."""

    model_runner: Any  # the Worker's (annotation only: no class attribute shadows it)

    # -- helpers (underscored names are not called over RPC)
    def _rb(self) -> dict[str, Any]:
        st = self.__dict__.get("_rollout_bus_state")
        if st is None:
            st = {**_fresh_state(), "nccl": None, "nccl_key": None}
            self.__dict__["_rollout_bus_state"] = st
        return st

    def _rb_model(self):
        mr = self.model_runner
        return mr.get_model() if hasattr(mr, "get_model") else mr.model

    def _rb_device(self) -> torch.device:
        dev = getattr(self, "device", None)
        if isinstance(dev, torch.device):
            return dev  # cuda:N in vLLM's GPU worker (cpu in the CPU tests)
        return torch.device("cuda", torch.cuda.current_device())

    def _rb_check(self, uid: str) -> dict[str, Any]:
        st = self._rb()
        if st["uid"] != uid:
            raise RuntimeError(
                f"worker {getattr(self, 'rank', '?')}: no weight update {uid!r} begun (current: {st['uid']!r})"
            )
        return st

    def _rb_load(self, named: Any) -> int:
        """Load ONE whole update (an iterable of (name, tensor); a quantized
        model needs every shard of a fused layer inside one call)."""
        model = self._rb_model()
        with _LoraUnwrapped(model):
            if vllm_fp8.is_quantized(model):  # fp8 engine fed bf16: re-quantize (vllm_fp8)
                return vllm_fp8.load_into_quantized(model, named, getattr(self, "model_config", None))
            loaded = model.load_weights(named)
        return len(loaded) if loaded is not None else -1

    # -- RPC methods
    def rollout_bus_info(self) -> dict[str, Any]:
        dev = self._rb_device()
        free, total = torch.cuda.mem_get_info(dev)
        return {
            "rank": int(getattr(self, "rank", 0)),
            "device": dev.index,
            "parent_death": PARENT_DEATH,
            "uuid": str(torch.cuda.get_device_properties(dev).uuid),
            "gpu_free": int(free),
            "gpu_total": int(total),
        }

    def rollout_bus_begin(self, uid: str, metas: list[Any], sizes: list[int]) -> int:
        st = self._rb()
        st.update(_fresh_state())
        st.update(uid=uid, metas=[list(m) for m in metas], sizes=[int(s) for s in sizes])
        return len(metas)

    def rollout_bus_recv_ipc(self, uid: str, handles: list[Any]) -> dict[str, Any]:
        st = self._rb_check(uid)
        dev = self._rb_device()
        t0 = time.perf_counter()
        if len(handles) != len(st["sizes"]):
            raise ValueError(f"cuda_ipc: {len(handles)} handle(s) for {len(st['sizes'])} bucket(s)")
        my_uuid = str(torch.cuda.get_device_properties(dev).uuid)
        copied = 0
        for i, h in enumerate(handles):
            if isinstance(h, dict):  # one handle per GPU (uuid -> bytes): take ours, else any
                h = h.get(my_uuid) or next(iter(h.values()))
            src = open_ipc_handle(bytes(h), dev.index).view(torch.uint8).reshape(-1)
            if src.device != dev:
                # The trainer's buffer lives on another GPU (a TP>1 engine fed from
                # one trainer GPU). load_weights would copy strided shards straight
                # out of peer IPC memory, which CUDA refuses (invalid argument)
                # without peer access: one contiguous copy into our GPU first.
                local = torch.empty(src.numel(), dtype=torch.uint8, device=dev)
                local.copy_(src)
                torch.cuda.synchronize(dev)
                src = local
                copied += 1
            unpack_bucket(i, st["metas"], src)  # validate now: a lie fails the receive, naming the tensor
            st["buckets"][i] = src  # same GPU: a view of the trainer's buffer, alive until the commit's ack
        return {"bytes": int(sum(st["sizes"])), "seconds": time.perf_counter() - t0, "copied": copied}

    def rollout_bus_recv_nccl(self, uid: str, args: dict[str, Any]) -> dict[str, Any]:
        st = self._rb_check(uid)
        dev = self._rb_device()
        t0 = time.perf_counter()
        setup = self._rb_nccl(args)
        t1 = time.perf_counter()
        comm = st["nccl"]
        with torch.cuda.device(dev):
            for i, n in enumerate(st["sizes"]):
                buf = torch.empty(int(n), dtype=torch.uint8, device=dev)
                comm.broadcast(buf, src=0)
                st["buckets"][i] = buf
            torch.cuda.synchronize(dev)
        for i, buf in st["buckets"].items():
            unpack_bucket(i, st["metas"], buf)
        return {
            "bytes": int(sum(st["sizes"])),
            "seconds": time.perf_counter() - t0,
            "setup_seconds": round(t1 - t0, 4),
            **setup,
        }

    def _rb_nccl(self, a: dict[str, Any]) -> dict[str, Any]:
        """Join the trainer's NCCL group once per group id (trainer = rank 0,
        hosting a TCPStore at host:port); later updates reuse it. Ranks: the
        bridge's rank_offset + this worker's rank, else reserved from a counter
        in the store (each worker takes one)."""
        from datetime import timedelta

        from torch.distributed import TCPStore
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        st = self._rb()
        key = str(a.get("group_id") or f"{a['host']}:{a['port']}")
        if st["nccl"] is not None and st["nccl_key"] == key:
            return {"rank": st["nccl"].rank, "reused": True}
        self.rollout_bus_nccl_close()
        timeout = float(a.get("timeout_s", 300.0))
        store = TCPStore(
            a["host"],
            int(a["port"]),
            is_master=False,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
            use_libuv=False,
        )
        if a.get("rank_offset") is not None:
            rank = int(a["rank_offset"]) + int(getattr(self, "rank", 0))
        else:
            rank = int(store.add(f"rollout_bus/{key}/next_rank", 1))  # 1, 2, …: the trainer is 0
        pg = StatelessProcessGroup(rank=rank, world_size=int(a["world_size"]), store=store)
        st["nccl"], st["nccl_key"] = PyNcclCommunicator(pg, device=self._rb_device()), key
        return {"rank": rank, "reused": False}

    def rollout_bus_nccl_close(self) -> None:
        st = self._rb()
        comm, st["nccl"], st["nccl_key"] = st["nccl"], None, None
        if comm is not None:
            try:
                comm.destroy()
            except Exception:
                pass

    def rollout_bus_commit(self, uid: str, shm: dict[str, Any] | None = None) -> dict[str, Any]:
        st = self._rb_check(uid)
        dev = self._rb_device()
        t0 = time.perf_counter()
        try:
            with _on(dev):
                if shm is not None:
                    n = self._rb_commit_shm(st, shm, dev)
                else:
                    named = [nt for i, b in sorted(st["buckets"].items()) for nt in unpack_bucket(i, st["metas"], b)]
                    n = self._rb_load(named)
                    del named
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
        finally:
            st.update(_fresh_state())  # drop the views: the trainer may free its buffers after the ack
        return {"params_loaded": n, "seconds": time.perf_counter() - t0}

    def _rb_commit_shm(self, st: dict[str, Any], shm: dict[str, Any], dev: torch.device) -> int:
        """zmq transport: the backend wrote every bucket, once, into one shared
        memory file. Map it, copy each bucket to the GPU (one H2D copy), load
        from views of that copy. The map is closed before returning."""
        offsets = [int(o) for o in shm["offsets"]]
        fd = os.open(shm["path"], os.O_RDONLY)
        try:
            total = os.fstat(fd).st_size
            mm = mmap.mmap(fd, total, prot=mmap.PROT_READ) if total else None
        finally:
            os.close(fd)

        def tensors() -> Any:
            # One bucket on the GPU at a time; the loader pulls the next when done.
            for i, size in enumerate(st["sizes"]):
                with warnings.catch_warnings():  # read-only map: we only read it
                    warnings.simplefilter("ignore", UserWarning)
                    host = (
                        torch.frombuffer(mm, dtype=torch.uint8, count=int(size), offset=offsets[i])
                        if size
                        else torch.empty(0, dtype=torch.uint8)
                    )
                gpu = host.to(dev)
                del host
                yield from unpack_bucket(i, st["metas"], gpu)
                del gpu

        gen = tensors()
        try:
            # One load over every bucket (not one per bucket): a quantized model
            # must see all shards of a fused layer in one call (vllm_fp8).
            loaded = max(0, self._rb_load(gen))
        finally:
            gen.close()  # drop the last bucket's views before the map closes
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # a view still alive somewhere: the map goes with it
                    pass
        return loaded

    def rollout_bus_abort(self, uid: str | None = None) -> None:
        self._rb().update(_fresh_state())
