"""Trainer-side timing of a zero-copy cuda_ipc update (bench process only):
where the trainer's own time goes before the one-trip op leaves (issue 21 §2).

`instrument()` wraps, once, the calls the one-sender GPU push makes and
appends one record per update to bench.gpu.weight_update.SENDER_LOG (the
breakdown reports them as trainer.*, in ms):
- prep_s: from GpuSender.push's start to the one-trip op being sent (cast,
  plan, share, digest, the NaN/inf check's wait when it is on);
- share_s: share_in_place (the wait for the trainer's writes + the handles);
- layout_s: the layout digest (one_trip.layout_id);
- op_s: the one-trip op, from its send to its reply.
A two-round-trip update (the first, a fallback) leaves prep_s/op_s out.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from bench.gpu import weight_update as W

_NOW: dict[str, Any] = {}


def instrument() -> None:
    from trainer_bridge.transports import cuda_ipc, gpu, one_trip

    if getattr(gpu.GpuSender.push, "_bench_timed", False):
        return
    push, send, share, digest = gpu.GpuSender.push, one_trip.send, cuda_ipc.share_in_place, one_trip.layout_id

    @functools.wraps(push)
    async def timed_push(self: Any, upd: Any, named: Any) -> Any:
        _NOW.clear()
        _NOW["t0"] = time.perf_counter()
        try:
            return await push(self, upd, named)
        finally:
            rec = {k: round(v, 6) for k, v in _NOW.items() if k != "t0"}
            if rec:
                W.SENDER_LOG.append(rec)

    async def timed_send(upd: Any, layout: str, args: Any, *more: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        _NOW["prep_s"] = t - _NOW.get("t0", t)
        try:
            return await send(upd, layout, args, *more, **kw)  # more: the transport and its delivery (nccl)
        finally:
            _NOW["op_s"] = time.perf_counter() - t

    def timed(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def run(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                _NOW[name] = _NOW.get(name, 0.0) + time.perf_counter() - t

        return run

    timed_push._bench_timed = True  # type: ignore[attr-defined]
    gpu.GpuSender.push = timed_push  # type: ignore[method-assign]
    one_trip.send = timed_send
    cuda_ipc.share_in_place = timed("share_s", share)
    one_trip.layout_id = timed("layout_s", digest)
