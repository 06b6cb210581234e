"""A CPU stand-in for the nccl transport, for real-process tests: the torch
backend, except that it takes nccl updates whose broadcast runs over GLOO
(torch.distributed.ProcessGroupGloo on the trainer's TCPStore) instead of
NCCL. tests/test_one_trip_nccl.py gives the trainer's NcclSender the same
kind of group (rank 0).

As the vLLM worker does (engine_node/backends/vllm/worker_nccl.py): the
receive checks in at the trainer's store (NcclArgs.check_in) and waits for
its go BEFORE it joins the group; it joins once per group id (ranks from the
store's counter) and keeps it; it receives every bucket into staging kept
while the sizes are the same; it validates every bucket against the metas;
a receive that fails drops the update (a commit after it writes nothing).
The commit stages the buckets into the torch backend (on the loop thread)
and commits there. The receive runs on its own thread: the node's loop
keeps serving meanwhile, as with the vLLM backend.

`--backend tests.nccl_backend:factory` (backend options: the torch backend's).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch

from bus.tensors import unpack_bucket
from engine_node.backend import BackendError, BackendOp


class _NcclOverTorch:
    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._up: dict[str, Any] | None = None  # the nccl update in progress
        self._groups: dict[str, Any] = {}  # group id -> (store, gloo group)
        self._staging: tuple[tuple[int, ...], list[torch.Tensor]] | None = None
        self.receives = 0

    def begin_weight_update(self, update_id: str, transport: str, tensors: list[Any], args: dict[str, Any]) -> Any:
        self._up = None
        if transport != "nccl":
            return self._inner.begin_weight_update(update_id, transport, tensors, args)
        if not tensors:  # warm_up_nccl's empty update: only the group is joined (in the receive)
            self._up = {"metas": [], "sizes": [], "args": dict(args)}
            return BackendOp.done("begin_weight_update", {"tensors": 0})
        op = self._inner.begin_weight_update(update_id, "zmq", tensors, args)
        if op.future.done() and op.future.exception() is None:
            self._up = {"metas": list(tensors), "sizes": list(args.get("bucket_sizes") or []), "args": dict(args)}
        return op

    def receive_weights(self, handles: list[Any]) -> Any:
        up = self._up
        if up is None:
            return self._inner.receive_weights(handles)
        a = up["args"]
        op = BackendOp.pending("receive_weights", float(a.get("timeout_s") or 30.0), "weight_timeout_s")

        def run() -> None:
            t0 = time.perf_counter()
            try:
                bufs = self._receive(up, a)
                for i, b in enumerate(bufs):  # a lie fails the receive, naming the tensor
                    unpack_bucket(i, up["metas"], b)
                up["buckets"] = bufs
                self.receives += 1
                op.future.set_result(
                    {"bytes": int(sum(up["sizes"])), "nccl": {"broadcast_s": round(time.perf_counter() - t0, 4)}}
                )
            except BaseException as e:
                up.clear()  # dropped: a commit after this finds nothing received
                op.future.set_exception(BackendError(f"nccl stand-in: receive failed: {e}"))

        threading.Thread(target=run, name="nccl-standin-receive", daemon=True).start()
        return op

    def _receive(self, up: dict[str, Any], a: dict[str, Any]) -> list[torch.Tensor]:
        store, pg = self._group(a)
        key = tuple(int(n) for n in up["sizes"])
        if self._staging is None or self._staging[0] != key:
            self._staging = (key, [torch.empty(n, dtype=torch.uint8) for n in key])
        for buf in self._staging[1]:
            pg.broadcast(buf, 0).wait()
        token = a.get("check_in")
        if a.get("verdict") and token:  # the vLLM worker's _rb_verdict
            got = bytes(store.get(f"rollout_bus/ok/{token}"))
            if got != b"ok":
                raise ValueError(f"tensor {got.decode()!r} has NaN or inf values (the trainer's check)")
        return self._staging[1]

    def _group(self, a: dict[str, Any]) -> tuple[Any, Any]:
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        gid = str(a["group_id"])
        timeout = timedelta(seconds=float(a.get("timeout_s") or 30.0))
        got = self._groups.get(gid)
        store = got[0] if got is not None else None
        if store is None:
            store = TCPStore(a["host"], int(a["port"]), is_master=False, wait_for_workers=False, timeout=timeout)
        token = a.get("check_in")
        if token:  # the vLLM worker's _rb_check_in
            store.add(f"rollout_bus/in/{token}", 1)
            if bytes(store.get(f"rollout_bus/go/{token}")) != b"1":
                raise RuntimeError("the trainer will not broadcast this update")
        if got is None:
            rank = int(store.add(f"rollout_bus/{gid}/next_rank", 1))
            pg = ProcessGroupGloo(PrefixStore(gid, store), rank, int(a["world_size"]), timeout)
            got = self._groups[gid] = (store, pg)
        return got

    def commit_weight_update(self) -> Any:
        up, self._up = self._up, None
        if up is None:
            return self._inner.commit_weight_update()
        if "buckets" not in up:
            self._inner.abort_weight_update()
            return BackendOp.failed("commit_weight_update", BackendError("commit before receive_weights"))
        for i, b in enumerate(up["buckets"]):
            self._inner.stage_bucket(i, memoryview(b.numpy()))
        return self._inner.commit_weight_update()

    def abort_weight_update(self) -> Any:
        up, self._up = self._up, None
        if up is not None and not up["metas"]:
            return BackendOp.done("abort_weight_update", {"had_update": True})
        return self._inner.abort_weight_update()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def factory(model: str, **options: Any) -> Any:
    from engine_node.backend import load_backend

    return _NcclOverTorch(load_backend("torch", model, **options))


def gloo_connect(sender: Any) -> None:
    """The trainer side (NcclSender.connect, patched in the test process):
    rank 0 of a gloo group on the sender's store, with a `broadcast(t, src)`."""
    from torch.distributed import PrefixStore, ProcessGroupGloo

    if sender.comm is not None:
        return
    pg = ProcessGroupGloo(
        PrefixStore(sender.group_id, sender.store), 0, sender.world_size, timedelta(seconds=sender.timeout_s)
    )

    class Comm:
        rank = 0

        def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
            pg.broadcast(t, src).wait()

        def destroy(self) -> None:
            pass

    sender.comm = Comm()
