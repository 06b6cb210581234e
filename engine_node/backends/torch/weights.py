"""Weight updates of the `torch` backend over the `zmq` transport: begin
(validate every name, dtype, shape) → stage_bucket (unpack, clone once) →
commit (copy everything at once, on the worker thread). Nothing touches the
model before the commit, and the commit validates before its first copy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
import torch

from bus.tensors import unpack_bucket
from bus.transport import Transport
from engine_node.backend import BackendError, BackendOp
from engine_node.backends.torch.ops import TorchOps

# The bytes of a zmq update pass the node (stage_bucket); the GPU transports need vLLM's workers.
TRANSPORTS = frozenset({Transport.ZMQ})

log = structlog.get_logger("engine_node.backends.torch.backend")  # the backend's own logger name


class WeightUpdateError(BackendError, ValueError):
    """A weight transaction was refused (bad name / dtype / shape, missing
    tensor). Also a ValueError, as backend.begin_weight_update documents."""


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.as_tensor(value)


def _meta(m: Any) -> tuple[str, str, tuple[int, ...]]:
    """(name, dtype, shape) of a TensorMeta (msgspec Struct or plain dict)."""
    get: Callable[[str], Any] = m.get if isinstance(m, dict) else (lambda k: getattr(m, k))
    dtype = str(get("dtype")).removeprefix("torch.")
    return str(get("name")), dtype, tuple(int(x) for x in get("shape"))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class TorchWeightUpdates(TorchOps):
    def begin_weight_update(
        self, update_id: str, transport: str, tensors: list[Any], args: dict[str, Any]
    ) -> BackendOp:
        """Open a transaction for `tensors` (TensorMeta). A begin while another
        is open replaces it: a trainer that died mid-transfer must not block
        the next update. Validation is cheap: the op is done at once."""
        try:
            self._begin(transport, tensors)
        except BackendError as e:
            return BackendOp.failed("begin_weight_update", e)
        self._announced_metas = list(tensors)
        self._update_id = update_id
        return BackendOp.done("begin_weight_update", {"tensors": len(self._announced or ())})

    def _begin(self, transport: str, tensors: list[Any]) -> None:
        self._check_open()
        if transport not in TRANSPORTS:
            raise BackendError(f"transport {transport!r} not supported by torch backend (zmq only)", field="transport")
        if self._weights_where == "discarded":
            raise BackendError("weights were discarded by sleep(2); wake_up(['weights']) before a weight update")
        announced: dict[str, tuple[str, tuple[int, ...]]] = {}
        for m in tensors:
            name, dtype, shape = _meta(m)
            self._check_spec(name, dtype, shape)
            if name in announced:
                raise WeightUpdateError(f"tensor {name!r} announced twice")
            announced[name] = (dtype, shape)
        if not announced:
            raise WeightUpdateError("weight update announces no tensors")
        self._announced, self._staged = announced, {}

    def _check_spec(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        spec = self._specs.get(name)
        if spec is None:
            raise WeightUpdateError(f"tensor {name!r}: no such parameter in the model", field="tensors")
        if dtype != spec[0]:
            raise WeightUpdateError(
                f"tensor {name!r}: dtype {dtype} does not match the model's {spec[0]}", field="tensors"
            )
        if shape != spec[1]:
            raise WeightUpdateError(
                f"tensor {name!r}: shape {list(shape)} does not match the model's {list(spec[1])}", field="tensors"
            )

    def stage_bucket(self, bucket: int, data: memoryview) -> None:
        """zmq: one bucket's raw bytes (valid during the call): sliced by the
        shared unpacker, each tensor cloned once."""
        if self._announced is None:
            raise BackendError("stage_bucket without begin_weight_update")
        try:
            named = unpack_bucket(bucket, self._announced_metas, data)
        except ValueError as e:
            raise WeightUpdateError(str(e), field="bucket") from None
        self._stage_named(named)

    def _stage_named(self, named: list[tuple[str, Any]]) -> None:
        if self._announced is None:
            raise BackendError("stage_bucket without begin_weight_update")
        for name, value in named:
            if name not in self._announced:
                raise WeightUpdateError(f"tensor {name!r} was not announced by begin_weight_update")
            t = _as_tensor(value)
            dtype, shape = self._announced[name]
            if _dtype_name(t.dtype) != dtype or tuple(t.shape) != shape:
                raise WeightUpdateError(
                    f"tensor {name!r}: got {_dtype_name(t.dtype)}{list(t.shape)}, announced {dtype}{list(shape)}"
                )
            # Clone: `value` may view a receive buffer the node reuses after we return.
            self._staged[name] = t.detach().to("cpu", copy=True)

    def receive_weights(self, handles: list[Any]) -> BackendOp:
        return BackendOp.failed(
            "receive_weights",
            BackendError(
                "receive_weights (cuda_ipc / nccl) not supported by torch backend (zmq only)", field="transport"
            ),
        )

    def commit_weight_update(self) -> BackendOp:
        # The transaction is taken NOW, on the caller's thread: the worker runs
        # later, and a begin of the next update (synchronous, on the loop
        # thread) may have replaced `_announced` by then.
        announced, staged, uid = self._announced, self._staged, self._update_id
        return self._long_op("commit_weight_update", self._commit, announced, staged, uid)

    def _commit(self, announced: Any, staged: dict[str, Any], uid: str | None) -> dict[str, Any]:
        """All or nothing: every check happens before the first copy."""
        if announced is None:
            raise BackendError("commit_weight_update without begin_weight_update")
        missing = sorted(set(announced) - set(staged))
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise WeightUpdateError(f"weight update incomplete: missing tensors {missing[:5]}{more}")
        if self._weights_where == "discarded":
            raise BackendError("weights were discarded by sleep(2) during the update; wake_up first")
        with torch.no_grad():
            for name, t in staged.items():
                self._targets[name].copy_(t)
        n = len(staged)
        self._close_update(uid)
        self.reset_prefix_cache()
        # Running sequences keep KV computed by the old weights (like vLLM's
        # keep-mode pause); the node parks them when it wants fresh KV.
        log.debug("weights updated", tensors=n)
        return {"tensors": n}

    def abort_weight_update(self) -> BackendOp:
        # On the worker: it must not clear what a running commit is copying.
        # Keyed by the update open NOW: a stale abort that runs after the next
        # update began (the node aborts the old one, then begins the new one
        # at once) must not wipe the new one's staging.
        return self._long_op("abort_weight_update", self._close_update, self._update_id)

    def _close_update(self, uid: str | None) -> dict[str, Any]:
        if self._update_id == uid:
            self._announced, self._staged, self._update_id = None, {}, None
            return {"had_update": uid is not None}
        return {"had_update": False}
