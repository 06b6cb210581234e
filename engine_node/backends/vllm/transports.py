"""How each weight transport reaches vLLM's workers (the vllm backend's
receivers, looked up in VLLM_RECEIVERS by engine_node/backends/vllm/weight_ops.py).

- zmq: the node stages every bucket into shared memory (vllm/weights.ShmStage);
  the commit sends the workers begin + commit in one go.
- cuda_ipc: the handles are kept, not opened: the commit maps, validates and
  writes in ONE worker call (a bad handle fails the commit before any
  parameter is written). The trainer keeps its buckets until the commit (or
  abort) is acked. A zero-copy update (keep_maps) whose metas and handles the
  workers already keep sends only its token (vllm/weight_reuse.KeptIpc).
- nccl: the workers receive the broadcast inside the receive (their group
  joined on first use); the commit writes what they hold.
- vllm_nccl: the same, but the group and the broadcast are the trainer's own
  vLLM NCCLWeightTransferEngine (SkyRL's broadcast strategy): the workers join
  as vLLM's receiver does and take its packed chunks (vllm/worker_packed.py).

Hazard: the order of the worker calls is what the GPU timings measure; each
method issues exactly the calls its transport's branch of the backend issued.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from bus.transport import Transport
from engine_node.backend import BackendError, BackendOp
from engine_node.backends.vllm import weight_reuse as R
from engine_node.backends.vllm import weights as W


def _handle_count(what: str, handles: list[Any], buckets: int) -> BackendOp | None:
    if len(handles) == buckets:
        return None
    return BackendOp.failed(
        what, BackendError(f"cuda_ipc: {len(handles)} handle(s) for {buckets} bucket(s)", field="handles")
    )


class ZmqVllm:
    transport: ClassVar[Transport] = Transport.ZMQ

    def begin(self, be: Any, up: W.WeightUpdate) -> BackendOp:
        try:
            up.stage = W.ShmStage(up.sizes, up.uid)
        except OSError as e:
            return BackendOp.failed("begin_weight_update", BackendError(f"zmq staging: shared memory: {e}"))
        be._update = up
        return BackendOp.done("begin_weight_update", {"bytes": sum(up.sizes), "staging": up.stage.path})

    def receive(self, be: Any, up: W.WeightUpdate, handles: list[Any]) -> BackendOp:
        return BackendOp.failed(
            "receive_weights",
            BackendError(
                "receive_weights is for the GPU transports (cuda_ipc, nccl); zmq stages buckets", field="transport"
            ),
        )

    def receive_part(self, be: Any, up: W.WeightUpdate, part: W.Part) -> BackendOp:
        return BackendOp.failed(part.what, BackendError("zmq parts arrive as buckets", field="transport"))

    def ready(self, up: W.WeightUpdate) -> tuple[BackendError | None, Any]:
        """(refusal, what the commit's worker call needs)."""
        assert up.stage is not None
        missing = up.stage.missing()
        if missing:
            return BackendError(f"zmq: bucket(s) {missing[:8]} never staged"), None
        # The workers never saw a begin for zmq: begin + commit go together.
        return None, up.stage.spec()

    def committed(self, be: Any, up: W.WeightUpdate, workers: list[dict[str, Any]]) -> None:
        """The commit succeeded: nothing to keep (see CudaIpcVllm)."""

    def commit_calls(self, be: Any, up: W.WeightUpdate, shm: Any, opts: dict[str, Any]) -> list[Any]:
        return [
            be._rpc("rollout_bus_begin", up.uid, up.metas, up.sizes, timeout=be.weight_timeout_s),
            be._rpc("rollout_bus_commit", up.uid, shm, timeout=be.weight_timeout_s),
        ]


class _GpuVllm:
    def begin(self, be: Any, up: W.WeightUpdate) -> BackendOp:
        be._update = up
        # Nothing to tell the workers yet. The metas travel with the call that
        # needs them (nccl: the receive; cuda_ipc: the commit), so an update
        # costs one worker round trip (cuda_ipc) or two (nccl).
        return BackendOp.done("begin_weight_update", {"tensors": len(up.metas), "bytes": sum(up.sizes)})

    def committed(self, be: Any, up: W.WeightUpdate, workers: list[dict[str, Any]]) -> None:
        """The commit succeeded: nothing to keep (see CudaIpcVllm)."""

    def ready(self, up: W.WeightUpdate) -> tuple[BackendError | None, Any]:
        if not up.received:
            return BackendError("commit before receive_weights"), None
        return None, None


class CudaIpcVllm(_GpuVllm):
    transport: ClassVar[Transport] = Transport.CUDA_IPC

    def receive(self, be: Any, up: W.WeightUpdate, handles: list[Any]) -> BackendOp:
        refused = _handle_count("receive_weights", handles, len(up.sizes))
        if refused is not None:
            return refused
        up.handles = list(handles)  # kept, not opened: see the module doc
        up.received = True
        return BackendOp.done("receive_weights", {"bytes": int(sum(up.sizes)), "deferred": True})

    def receive_part(self, be: Any, up: W.WeightUpdate, part: W.Part) -> BackendOp:
        refused = _handle_count(part.what, part.handles, len(part.sizes))
        if refused is not None:
            return refused
        up.handles += list(part.handles)
        up.received = True
        return BackendOp.done(part.what, {"bytes": sum(part.sizes), "deferred": True})

    def commit_calls(self, be: Any, up: W.WeightUpdate, shm: Any, opts: dict[str, Any]) -> list[Any]:
        # The whole update in one worker call. The trainer's zero-copy mode
        # (keep_maps) sends the same metas and handles every update: once the
        # workers keep them, only their token goes (vllm/weight_reuse.KeptIpc).
        kept, be._ipc_kept = be._ipc_kept, None  # claimed again only by this commit's success
        if opts.get("keep_maps"):
            if kept is not None and kept.serves(up.metas, up.sizes, up.handles):
                up.keeps = kept
                return [be._rpc("rollout_bus_apply_kept", up.uid, kept.token, opts, timeout=be.weight_timeout_s)]
            be._ipc_seq += 1
            up.keeps = R.KeptIpc(f"{up.uid}.{be._ipc_seq}", up.metas, list(up.sizes), list(up.handles))
            opts = {**opts, "kept_token": up.keeps.token}
        return [
            be._rpc("rollout_bus_apply_ipc", up.uid, up.metas, up.sizes, up.handles, opts, timeout=be.weight_timeout_s)
        ]

    def committed(self, be: Any, up: W.WeightUpdate, workers: list[dict[str, Any]]) -> None:
        """The commit succeeded (vLLM's output thread): the layout is kept only
        if EVERY worker says it keeps it under the token."""
        k = up.keeps
        if k is not None and workers and all(w.get("kept_token") == k.token for w in workers):
            be._ipc_kept = k


class NcclVllm(_GpuVllm):
    transport: ClassVar[Transport] = Transport.NCCL
    recv_rpc: ClassVar[str] = "rollout_bus_recv_nccl"  # the workers' receive (begin folded in)

    def receive(self, be: Any, up: W.WeightUpdate, handles: list[Any]) -> BackendOp:
        t0 = time.perf_counter()
        nbytes = int(sum(up.sizes))

        def result(rs: list[Any]) -> dict[str, Any]:
            dt = time.perf_counter() - t0
            up.received = True
            w = rs[0][0]
            # the node keeps it as a ReceiveTiming (engine_node/timings.py, read through Stats)
            nccl = {k: w.get(k) for k in ("reused", "setup_seconds", "alloc_s", "broadcast_s")}
            return {
                "bytes": nbytes,
                "backend_seconds": round(dt, 4),
                "GBps": round(nbytes / dt / 1e9, 3) if dt > 0 else None,
                "worker_seconds": [round(x["seconds"], 4) for x in rs[0]],
                "nccl": nccl,
            }

        a = {**up.args, "timeout_s": float(up.args.get("timeout_s", be.weight_timeout_s))}
        call = be._rpc(self.recv_rpc, up.uid, a, up.metas, up.sizes, timeout=be.weight_timeout_s)
        up.workers_know = True
        return be._op("receive_weights", "weight_timeout_s", [call], result)

    def receive_part(self, be: Any, up: W.WeightUpdate, part: W.Part) -> BackendOp:
        # over the SENDER's own group (one communicator per sender rank, kept for later updates)
        args = part.args
        a = {**args, "timeout_s": float(args.get("timeout_s", be.weight_timeout_s))}
        call = be._rpc(
            "rollout_bus_recv_nccl_part", up.uid, a, part.metas, part.sizes, part.first, timeout=be.weight_timeout_s
        )
        up.workers_know = True
        t0 = time.perf_counter()

        def result(rs: list[Any]) -> dict[str, Any]:
            up.received = True
            w = rs[0][0]
            return {"bytes": sum(part.sizes), "backend_seconds": round(time.perf_counter() - t0, 4), **w}

        return be._op(part.what, "weight_timeout_s", [call], result)

    def commit_calls(self, be: Any, up: W.WeightUpdate, shm: Any, opts: dict[str, Any]) -> list[Any]:
        return [be._rpc("rollout_bus_commit", up.uid, None, opts, timeout=be.weight_timeout_s)]


class VllmNcclVllm(NcclVllm):
    transport: ClassVar[Transport] = Transport.VLLM_NCCL
    recv_rpc: ClassVar[str] = "rollout_bus_recv_packed"

    def receive_part(self, be: Any, up: W.WeightUpdate, part: W.Part) -> BackendOp:
        return BackendOp.failed(
            part.what, BackendError("vllm_nccl has one sender: the trainer's rank 0", field="transport")
        )


# Keyed by the wire string (a Transport is one): backends take the transport as a str.
VLLM_RECEIVERS: dict[str, Any] = {
    Transport.ZMQ: ZmqVllm(),
    Transport.CUDA_IPC: CudaIpcVllm(),
    Transport.NCCL: NcclVllm(),
    Transport.VLLM_NCCL: VllmNcclVllm(),
}
