"""Weight updates of the `vllm` backend: begin (validate, stage), receive
(GPU transports), commit (one worker round trip per transport) and abort.
The record, validation and staging live in vllm/weights; what runs in the
workers in vllm/worker_ext."""

from __future__ import annotations

import time
from typing import Any

from bus.transport import Transport
from engine_node.backend import BackendError, BackendOp
from engine_node.backends.vllm import weight_reuse as R
from engine_node.backends.vllm import weights as W
from engine_node.backends.vllm.ops import VllmOps
from engine_node.backends.vllm.transports import VLLM_RECEIVERS

# What the worker's commit reports about where its time went (returned; engine_node/timings.py).
_WORKER_TIMING = (
    "path",
    "maps_kept",
    "seconds",
    "open_s",
    "apply_s",
    "copy_s",
    "fallback",
    "fallback_s",
    "views_reused",
    "record_s",
    "load_s",
    "verify_s",
    "verify_mismatch",
    "post_sync_s",
    "copied",
    "plan",
    "why",
    "check_params",
    "check_mismatch",
    "check_s",
)


class VllmWeightOps(VllmOps):
    def begin_weight_update(
        self, update_id: str, transport: str, tensors: list[Any], args: dict[str, Any]
    ) -> BackendOp:
        receiver = VLLM_RECEIVERS.get(transport)
        if receiver is None:
            return BackendOp.failed(
                "begin_weight_update",
                BackendError(
                    f"vllm backend: unknown transport {transport!r} ({', '.join(W.TRANSPORTS)})", field="transport"
                ),
            )
        if self._update is not None:  # a new begin replaces an unfinished update
            self.abort_weight_update()
        checked = self._validated(tensors, args.get("bucket_sizes"))
        if isinstance(checked, BackendError):
            return BackendOp.failed("begin_weight_update", checked)
        up = W.WeightUpdate(update_id, transport, checked[0], checked[1], dict(args))
        return receiver.begin(self, up)  # engine_node/backends/vllm/transports.py

    def _validated(self, tensors: list[Any], given: Any) -> tuple[list[list[Any]], list[int]] | BackendError:
        """(metas, sizes) of a begin, validated against the checkpoint; the
        very tensor list validated last is not checked again
        (vllm/weight_reuse.Validated: the one-trip op hands the same objects)."""
        if self._ckpt_shapes is None:
            self._ckpt_shapes = W.checkpoint_shapes(self.model)
        sizes = [int(s) for s in given] if given else None
        last = self._valid
        if last is not None and sizes is not None and last.serves(tensors, sizes, self._ckpt_shapes):
            # fresh outer lists: a multi-sender update appends its parts to up.metas
            return list(last.metas), sizes
        metas = [W.meta_list(t) for t in tensors]
        if sizes is None:
            sizes = W.derive_sizes(metas)
        tied = bool(getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False))
        bad = W.validate(metas, sizes, self._ckpt_shapes, tied, self.model)
        if bad is not None:
            return BackendError(bad[1], field=bad[0])
        if tensors:
            self._valid = R.Validated(list(tensors), list(sizes), self._ckpt_shapes, list(metas))
        return metas, sizes

    def _require(self, transport: str | None = None) -> W.WeightUpdate:
        up = self._update
        if up is None:
            raise BackendError("no weight update in progress (begin_weight_update first)")
        if transport is not None and up.transport != transport:
            raise BackendError(f"weight update uses transport {up.transport!r}, not {transport!r}", field="transport")
        return up

    def stage_bucket(self, bucket: int, data: memoryview) -> None:
        up = self._require(transport=Transport.ZMQ)
        assert up.stage is not None
        try:
            up.stage.write(int(bucket), data, up.metas)
        except ValueError as e:
            raise BackendError(f"weight bucket {bucket}: {e}") from None

    def receive_weights(self, handles: list[Any]) -> BackendOp:
        try:
            up = self._require()
        except BackendError as e:
            return BackendOp.failed("receive_weights", e)
        return VLLM_RECEIVERS[up.transport].receive(self, up, handles)

    def receive_part(
        self, sender: int, tensors: list[Any], sizes: list[int], handles: list[Any], transport_args: dict[str, Any]
    ) -> BackendOp:
        """One sender's part of a multi-sender GPU update (engine_node/weight_update.py
        `_receive_part`): its metas are validated and appended to the update
        (bucket numbers shifted past the parts before it). cuda_ipc: its handles
        are kept for the commit's one worker call, so the sender keeps its
        buckets until the commit (or abort) is acked. nccl: the workers receive
        the part now over the SENDER's own group (one communicator per sender
        rank, kept for later updates)."""
        what = f"receive_part(sender {sender})"
        try:
            up = self._require()
        except BackendError as e:
            return BackendOp.failed(what, e)
        metas = [W.meta_list(t) for t in tensors]
        sizes = [int(x) for x in sizes]
        if self._ckpt_shapes is None:
            self._ckpt_shapes = W.checkpoint_shapes(self.model)
        tied = bool(getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False))
        bad = W.validate(metas, sizes, self._ckpt_shapes, tied, self.model)
        if bad is not None:
            return BackendOp.failed(what, BackendError(f"sender {sender}: {bad[1]}", field=bad[0]))
        seen = {m[0] for m in up.metas}
        dup = next((m[0] for m in metas if m[0] in seen), None)
        if dup is not None:
            return BackendOp.failed(what, BackendError(f"sender {sender}: {dup} was sent by another sender", field=dup))
        first = len(up.sizes)
        for m in metas:
            m[3] = int(m[3]) + first
        up.metas += metas
        up.sizes += sizes
        part = W.Part(what, metas, sizes, first, list(handles), transport_args)
        return VLLM_RECEIVERS[up.transport].receive_part(self, up, part)

    def commit_weight_update(self) -> BackendOp:
        try:
            up = self._require()
        except BackendError as e:
            return BackendOp.failed("commit_weight_update", e)
        receiver = VLLM_RECEIVERS[up.transport]
        refused, shm = receiver.ready(up)
        if refused is not None:
            return BackendOp.failed("commit_weight_update", refused)
        self._update = None
        t0 = time.perf_counter()
        # transport_args["weight_check"] (the trainer's update_weights(weight_check=True)):
        # the workers also run load_weights and compare every parameter with the plan's.
        opts = {
            "plan": self.weight_plan,
            "check": bool(up.args.get("weight_check")),
            # the trainer's zero-copy cuda_ipc: its handles repeat, keep the maps
            "keep_maps": bool(up.args.get("keep_maps")),
        }
        calls = []
        if self._weights_stale and not (self._ckpt_shapes and set(self._ckpt_shapes) <= {m[0] for m in up.metas}):
            # After a level-2 sleep, an update of SOME tensors: the rest must be
            # the checkpoint's before it is written (a reload after it, at the
            # wake that ends sleep, would overwrite what it wrote).
            calls.append(self._rpc("rollout_bus_reload_checkpoint", timeout=self.weight_timeout_s))
            self._weights_stale = False
        calls += receiver.commit_calls(self, up, shm, opts)
        # The prefix cache is invalidated by a new salt, not a reset (see VllmBackend._init_loop_state).
        self._weights_epoch += 1
        if self._weights_stale and self._ckpt_shapes and set(self._ckpt_shapes) <= {m[0] for m in up.metas}:
            self._weights_stale = False  # every checkpoint tensor written: no reload needed

        def result(rs: list[Any]) -> dict[str, Any]:
            dt = time.perf_counter() - t0
            w = rs[-1][0] if rs[-1] else {}
            receiver.committed(self, up, rs[-1] or [])
            timing = {k: w[k] for k in _WORKER_TIMING if k in w}  # the node's CommitTiming.worker
            return {
                "backend_seconds": round(dt, 4),
                "bytes": int(sum(up.sizes)),
                "worker_seconds": [round(x["seconds"], 4) for x in rs[-1]],
                "worker": timing,
                "prefix_cache_reset": True,
                "prefix_cache_salt": f"w{self._weights_epoch}",
            }

        return self._op("commit_weight_update", "weight_timeout_s", calls, result, lambda ok: up.close())

    def abort_weight_update(self) -> BackendOp:
        up, self._update = self._update, None
        if up is None:
            return BackendOp.done("abort_weight_update", {"had_update": False})
        if not up.workers_know:  # zmq / cuda_ipc before the commit: the workers never saw it
            up.close()
            return BackendOp.done("abort_weight_update", {"had_update": True})
        return self._op(
            "abort_weight_update",
            "rpc_timeout_s",
            [self._rpc("rollout_bus_abort", up.uid)],
            lambda rs: {"had_update": True},
        )
