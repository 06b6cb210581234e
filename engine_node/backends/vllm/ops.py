"""Control plumbing of the `vllm` backend: one BackendOp for a batch of
utility calls sent back to back, continuations and deadlines swept on the
loop thread (vllm/backend.py's docstring: threads, ordering hazards).

`VllmOps` is the base of the backend's mixins (vllm/data_path, vllm/sleep,
vllm/weight_ops): it declares the state they share and owns `_op` / `_sweep`.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from engine_node.backend import BackendError, BackendOp, BackendTimeout
from engine_node.backends.vllm import weight_reuse as R
from engine_node.backends.vllm import weights as W
from engine_node.backends.vllm.engine_core import CoreLink, _settle
from engine_node.backends.vllm.lora import LoraTable
from engine_node.backends.vllm.requests import OutputBuffer

log = structlog.get_logger("rollout_bus.vllm_backend")


class VllmOps:
    # The backend's state, set by VllmBackend.__init__ (vllm/backend.py says
    # what each field means); declared here for the mixins that share it.
    model: str
    rpc_timeout_s: float
    weight_timeout_s: float
    lora_timeout_s: float
    sleep_timeout_s: float
    enable_lora: bool
    weight_plan: bool
    vllm_config: Any
    cpu_placement: dict[str, Any]
    resume_ramp_tokens: int
    resume_ramp_wait_s: float
    _api: Any
    _link: CoreLink
    _out: OutputBuffer
    _max_model_len: int
    _gen_cfg: dict[str, Any]
    _eos: Any
    _seq_of: dict[str, str]
    _rid_of: dict[str, str]
    _n: int
    _aborted: int
    _frozen: set[str]
    _paused: bool
    _ramp_state: str | None
    _ramp_deadline: float
    _deferred: dict[str, Any]
    _trace: dict[str, Any] | None
    _sleep_level: int
    _sleeping: set[str]
    _weights_stale: bool
    _buffers_held: bool
    _ops: list[tuple[BackendOp, float]]
    _later: collections.deque[Callable[[], None]]
    _update: W.WeightUpdate | None
    _loras: LoraTable
    _weights_epoch: int
    _ckpt_shapes: dict[str, list[int]] | None
    _valid: R.Validated | None
    _ipc_kept: R.KeptIpc | None
    _ipc_seq: int
    _tmp: str

    def _op(
        self,
        what: str,
        knob: str,
        calls: list[tuple[str, tuple]],
        result: Callable[[list[Any]], dict] | None = None,
        after: Callable[[bool], None] | None = None,
    ) -> BackendOp:
        """Send `calls` (utility name, args) back to back; one BackendOp for all.
        `result(results)` makes the op's dict; `after(ok)` runs once when all are
        done (on vLLM's output thread: flags and file cleanup only, no sends)."""
        timeout = float(getattr(self, knob))
        op = BackendOp.pending(what, timeout, knob)
        if self._link.dead:
            return BackendOp.failed(what, BackendError(f"{what}: the vLLM engine core is dead"))
        futs = [self._link.utility(name, *args) for name, args in calls]
        lock = threading.Lock()
        left = [len(futs)]

        def done(_f: Any) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            err = next((f.exception() for f in futs if f.exception() is not None), None)
            res: dict[str, Any] = {}
            if err is None and result is not None:
                try:
                    res = result([f.result() for f in futs])
                except Exception as e:
                    err = e
            if after is not None:
                try:
                    after(err is None)
                except Exception:
                    log.exception("vllm_op_cleanup_failed", op=what)
            _settle(op.future, res, None if err is None else backend_error(what, err))

        for f in futs:
            f.add_done_callback(done)
        self._ops.append((op, timeout))
        return op

    def _sweep(self) -> None:
        """Run queued continuations; fail ops past their deadline (naming the
        knob); forget finished ones. Called from step/has_work/stats."""
        if self._link.dead:
            self._link.check_alive()
        while self._later:
            fn = self._later.popleft()
            if not self._link.dead:
                fn()
        if not self._ops:
            return
        now = time.monotonic()
        keep = []
        for op, timeout in self._ops:
            if op.future.done():
                continue
            if now > op.deadline:
                _settle(op.future, None, BackendTimeout(op.what, timeout, op.knob))
                continue
            keep.append((op, timeout))
        self._ops = keep

    def _rpc(self, method: str, *args: Any, timeout: float | None = None) -> tuple[str, tuple]:
        """A collective_rpc utility call: `method` on every worker."""
        return ("collective_rpc", (method, timeout, args, None))


def backend_error(what: str, err: BaseException) -> BackendError:
    if isinstance(err, BackendError):
        return err
    return BackendError(f"{what} failed in the vLLM engine: {err}")
