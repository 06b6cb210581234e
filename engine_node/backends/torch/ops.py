"""Long control ops of the `torch` backend (torch/backend.py's docstring:
ONE backend-owned worker thread, the model lock, op_timeout_s,
fault_op_delay_s), and the memory the backend holds.

`TorchOps` is the base of the backend's mixins (torch/sleep, torch/weights):
it declares the state they share.
"""

from __future__ import annotations

import concurrent.futures
import gc
import threading
from typing import Any

import torch

from engine_node.backend import BackendError, BackendOp
from engine_node.lora_local import LoraHooks


def _cache_bytes(cache: Any) -> int:
    """Bytes held by a DynamicCache's key/value tensors (0 if unknown)."""
    total = 0
    for layer in getattr(cache, "layers", ()) or ():
        for attr in ("keys", "values"):
            t = getattr(layer, attr, None)
            if isinstance(t, torch.Tensor):
                total += t.nbytes
    return total


class TorchOps:
    # The backend's state, set by TorchBackend.__init__ (torch/backend.py);
    # declared here for the mixins that share it.
    path: str
    device: torch.device
    dtype: torch.dtype
    model: Any
    _seqs: dict[str, Any]  # seq id -> torch/backend._Seq
    _lora: LoraHooks
    _targets: dict[str, torch.Tensor]
    _specs: dict[str, tuple[str, tuple[int, ...]]]
    _announced: dict[str, tuple[str, tuple[int, ...]]] | None
    _announced_metas: list[Any]
    _update_id: str | None
    _staged: dict[str, torch.Tensor]
    _sleeping: set[str]
    _weights_where: str
    _closed: bool
    _op_timeout_s: float
    _fault_delay: dict[str, float]
    _model_lock: threading.Lock
    _closing: threading.Event
    _ops: concurrent.futures.ThreadPoolExecutor

    def _long_op(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> BackendOp:
        """Run fn on the worker thread, holding the model; the op resolves to
        fn's result (a dict) or its exception."""
        try:
            self._check_open()
        except BackendError as e:
            return BackendOp.failed(what, e)
        op = BackendOp.pending(what, self._op_timeout_s, "op_timeout_s")
        delay = self._fault_delay.get(what, 0.0)

        def run() -> None:
            if not op.future.set_running_or_notify_cancel():
                return
            try:
                with self._model_lock:
                    if delay:  # test-only fault injection (fault_op_delay_s); close() cuts it short
                        self._closing.wait(delay)
                    if self._closed:
                        raise BackendError(f"torch backend closed before {what} ran")
                    res = fn(*args, **kwargs)
            except BaseException as e:
                op.future.set_exception(e)
            else:
                op.future.set_result(dict(res or {}))

        try:
            self._ops.submit(run)
        except RuntimeError as e:  # executor shut down
            return BackendOp.failed(what, BackendError(f"torch backend: {e}"))
        return op

    def _weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.model.parameters())

    def _kv_bytes(self) -> int:
        return sum(_cache_bytes(s.cache) for s in self._seqs.values() if s.cache is not None)

    def _release_device_memory(self) -> None:
        # On CPU refcounting already freed what we dropped; a full gc.collect()
        # costs ~0.4 s with transformers loaded, so only pay it where it returns
        # memory to the device (cycles holding CUDA tensors, then the caching
        # allocator's free blocks).
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("torch backend is closed")

    def reset_prefix_cache(self) -> BackendOp:
        """No prefix cache: every sequence has its own KV cache."""
        return BackendOp.done("reset_prefix_cache")
