"""A CPU stand-in for the cuda_ipc transport, for real-process tests: the torch
backend, except that it takes cuda_ipc updates whose "IPC handles" are paths
of files holding a tensor's bytes (tests/test_one_trip.py's trainer-side
stand-in writes them; the same path names the same trainer tensor every
update, as a zero-copy handle names the same storage).

As the vLLM backend does: begin validates and keeps nothing but the metas,
receive keeps the handles (not opened), the commit reads every bucket
("maps" it: a kept map is not opened again under keep_maps) and writes, in
one go; a sleep drops the kept maps. The commit's result carries
`worker.maps_kept` / `worker.opened` like the vLLM worker's timing.

`--backend tests.ipc_backend:factory` (backend options: the torch backend's).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from engine_node.backend import BackendError, BackendOp


class _IpcOverTorch:
    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._ipc: dict[str, Any] | None = None  # the cuda_ipc update in progress
        self._maps: set[bytes] = set()  # kept "IPC maps" (keep_maps)
        self.opened = 0  # handles opened so far (a kept map is not opened again)

    def begin_weight_update(self, update_id: str, transport: str, tensors: list[Any], args: dict[str, Any]) -> Any:
        self._ipc = None
        if transport != "cuda_ipc":
            return self._inner.begin_weight_update(update_id, transport, tensors, args)
        op = self._inner.begin_weight_update(update_id, "zmq", tensors, args)
        if op.future.done() and op.future.exception() is None:
            self._ipc = {"sizes": list(args.get("bucket_sizes") or []), "keep": bool(args.get("keep_maps"))}
        return op

    def receive_weights(self, handles: list[Any]) -> Any:
        if self._ipc is None:
            return self._inner.receive_weights(handles)
        if len(handles) != len(self._ipc["sizes"]):
            err = BackendError(f"cuda_ipc: {len(handles)} handle(s) for {len(self._ipc['sizes'])}", field="handles")
            return BackendOp.failed("receive_weights", err)
        self._ipc["handles"] = [bytes(h) for h in handles]
        return BackendOp.done("receive_weights", {"deferred": True})

    def commit_weight_update(self) -> Any:
        ipc, self._ipc = self._ipc, None
        if ipc is None:
            return self._inner.commit_weight_update()
        if "handles" not in ipc:
            return BackendOp.failed("commit_weight_update", BackendError("commit before receive_weights"))
        maps: set[bytes] = set()
        try:
            for i, h in enumerate(ipc["handles"]):
                if not (ipc["keep"] and h in self._maps):
                    self.opened += 1
                maps.add(h)
                with open(h.decode(), "rb") as f:
                    data = f.read()
                if len(data) != ipc["sizes"][i]:
                    raise BackendError(f"bucket {i}: {len(data)} bytes behind its handle", field="handles")
                self._inner.stage_bucket(i, memoryview(data))
        except (OSError, BackendError) as e:
            self._maps = set()
            self._inner.abort_weight_update()
            return BackendOp.failed("commit_weight_update", BackendError(f"cuda_ipc stand-in: {e}"))
        self._maps = maps if ipc["keep"] else set()
        op = self._inner.commit_weight_update()
        out: concurrent.futures.Future = concurrent.futures.Future()
        worker = {"maps_kept": len(self._maps), "opened": self.opened}

        def done(f: concurrent.futures.Future) -> None:
            e = f.exception()
            if e is not None:
                out.set_exception(e)
            else:
                out.set_result({**f.result(), "worker": worker})

        op.future.add_done_callback(done)
        return BackendOp(op.what, out, op.deadline, op.knob)

    def abort_weight_update(self) -> Any:
        self._ipc = None
        return self._inner.abort_weight_update()

    def sleep(self, level: int) -> Any:
        self._maps = set()  # as the vLLM backend's rollout_bus_drop_maps
        return self._inner.sleep(level)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def factory(model: str, **options: Any) -> Any:
    from engine_node.backend import load_backend

    return _IpcOverTorch(load_backend("torch", model, **options))
