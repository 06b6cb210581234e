"""The node's end of vLLM's engine core: a `SyncMPClient` read without blocking.

Why SyncMPClient and not a subclass: it already runs the one thread we want
(``EngineCoreOutputQueueThread``: reads the engine core's output socket,
resolves utility futures, queues output batches). We add two things around it,
without touching its sockets:

- a wake pipe: the instance's ``outputs_queue.put_nowait`` is wrapped so every
  queued batch (or error) also writes one byte to a pipe; the node polls the
  pipe's read end (``fileno()``) and calls ``drain()``.
- utility calls that return their future instead of blocking on it
  (``SyncMPClient.call_utility`` without ``.result()``).

Ownership hazards:
- The input socket (a zmq ROUTER) belongs to the node's loop thread: ``add``,
  ``abort`` and ``utility`` must only be called there.
- Utility futures are resolved on the client's output thread. A future must
  stay registered in ``utility_results`` until the core answers: the output
  thread pops it unconditionally and dies on a missing id (KeyError), which
  would take the whole client down. So deadlines never unregister anything.
- When the engine core dies, vLLM's monitor thread marks ``resources.engine_dead``
  and stops the output thread without queueing anything; pending utility
  futures would then wait forever. ``check_alive()`` (called by the backend on
  every step/has_work/stats) fails them all with BackendError.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import uuid
from typing import Any

import structlog

from engine_node.backend import BackendError

log = structlog.get_logger("rollout_bus.vllm_engine_core")

DEAD_MESSAGE = "the vLLM engine core died (see the engine core's log); restart the engine node"


class CoreLink:
    def __init__(self, client: Any, utility_request_type: Any) -> None:
        self.client = client
        self._utility_type = utility_request_type
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._pending: dict[int, concurrent.futures.Future] = {}  # call id -> our future
        self._dead_reported = False
        self.failed: BaseException | None = None  # what the output thread died of
        q = client.outputs_queue
        orig_put = q.put_nowait

        def put_nowait(item: Any) -> None:  # runs on the client's output thread
            orig_put(item)
            self._kick()

        q.put_nowait = put_nowait  # instance attribute: the output thread looks it up per call
        self._queue: queue.Queue = q
        self._kick()  # a batch queued before the wrap

    # ------------------------------------------------------------- wake pipe
    def kick(self) -> None:
        """Make the wake fd readable (callable from any thread)."""
        self._kick()

    def _kick(self) -> None:
        try:
            os.write(self._wfd, b"\x01")
        except (BlockingIOError, OSError):
            pass  # full pipe: already readable; closed: shutting down

    def fileno(self) -> int:
        return self._rfd

    def _clear_pipe(self) -> None:
        try:
            while os.read(self._rfd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    # ------------------------------------------------------------- outputs
    def drain(self, wait_s: float = 0.0) -> list[Any]:
        """Every EngineCoreOutputs batch queued now; when none is and wait_s > 0,
        wait up to wait_s for one. Raises BackendError when the core failed."""
        self._clear_pipe()
        batches: list[Any] = []
        try:
            if wait_s > 0 and self._queue.empty():
                batches.append(self._queue.get(timeout=wait_s))
            while True:
                batches.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        for b in batches:
            if isinstance(b, BaseException):  # the output thread died with it
                self.failed = b
                self.fail_pending(b)
                raise BackendError(f"{DEAD_MESSAGE}: {type(b).__name__}: {b}")
        return batches

    def has_output(self) -> bool:
        return not self._queue.empty()

    # ------------------------------------------------------------- inputs (loop thread only)
    def add(self, request: Any) -> None:
        self._guard(self.client.add_request, request)

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and not self.dead:
            self._guard(self.client.abort_requests, request_ids)

    def utility(self, method: str, *args: Any) -> concurrent.futures.Future:
        """Send one UTILITY call. Returns OUR future: it resolves on the output
        thread when the core answers, or fails when the core dies. vLLM's own
        future (in utility_results) is never completed by us: its output thread
        sets it unconditionally and would die on an already-done one."""
        c = self.client
        call_id = uuid.uuid1().int >> 64
        inner: concurrent.futures.Future = concurrent.futures.Future()
        outer: concurrent.futures.Future = concurrent.futures.Future()
        c.utility_results[call_id] = inner
        self._pending[call_id] = outer

        def relay(f: concurrent.futures.Future, cid: int = call_id) -> None:
            self._pending.pop(cid, None)
            err = f.exception()
            _settle(outer, None if err is not None else f.result(), err)
            self._kick()  # the node wakes and sees the op finished

        inner.add_done_callback(relay)
        try:
            self._guard(c._send_input, self._utility_type, (0, call_id, method, args))
        except BackendError as e:
            c.utility_results.pop(call_id, None)
            self._pending.pop(call_id, None)
            _settle(outer, None, e)
        return outer

    def _guard(self, fn: Any, *args: Any) -> None:
        if self.dead:
            raise BackendError(DEAD_MESSAGE)
        try:
            fn(*args)
        except Exception as e:  # EngineDeadError, zmq errors on a closed socket
            raise BackendError(f"{DEAD_MESSAGE}: {type(e).__name__}: {e}") from e

    # ------------------------------------------------------------- liveness
    @property
    def dead(self) -> bool:
        res = getattr(self.client, "resources", None)
        return self.failed is not None or bool(getattr(res, "engine_dead", False))

    def check_alive(self) -> None:
        """Fail every pending utility call once the core is dead (nothing else will)."""
        if self.dead and not self._dead_reported:
            self._dead_reported = True
            log.error("vllm_engine_core_dead", pending_calls=len(self._pending))
            self.fail_pending(BackendError(DEAD_MESSAGE))
            self._kick()

    def fail_pending(self, error: BaseException) -> None:
        err = error if isinstance(error, BackendError) else BackendError(f"{DEAD_MESSAGE}: {error}")
        for fut in list(self._pending.values()):
            _settle(fut, None, err)
        self._pending.clear()

    def close(self, timeout_s: float) -> None:
        try:
            self.client.shutdown(timeout=timeout_s)
        except TypeError:  # a client whose shutdown takes no timeout
            self.client.shutdown()
        finally:
            self.fail_pending(BackendError("the vllm backend was closed"))
            for fd in (self._rfd, self._wfd):
                try:
                    os.close(fd)
                except OSError:
                    pass


def _settle(fut: concurrent.futures.Future, result: Any, error: BaseException | None) -> None:
    """Complete `fut` unless it is already done (two threads may race to it)."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def load_vllm_api() -> Any:
    """vLLM's classes the backend uses, in one namespace (the CPU test passes a
    fake one instead). Imported lazily: only where the vllm backend runs."""
    import types

    from vllm.engine.arg_utils import EngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine import EngineCoreRequest, EngineCoreRequestType
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.executor import Executor

    def build_config(engine_kw: dict[str, Any]) -> Any:
        # UsageContext.LLM_CLASS: the defaults vLLM's offline `LLM` picks for this
        # GPU (max_num_seqs, max_num_batched_tokens, CUDA-graph sizes); any of
        # them given in engine_kw (backend options) wins.
        return EngineArgs(**engine_kw).create_engine_config(usage_context=UsageContext.LLM_CLASS)

    def make_client(cfg: Any, log_stats: bool) -> Any:
        # SyncMPClient: the engine core in its own process, zmq in between.
        return EngineCoreClient.make_client(
            multiprocess_mode=True,
            asyncio_mode=False,
            vllm_config=cfg,
            executor_class=Executor.get_class(cfg),
            log_stats=log_stats,
        )

    def tokenizer_eos(cfg: Any) -> int | None:
        """The tokenizer's eos id, as InputProcessor passes it (None without a tokenizer)."""
        from vllm.tokenizers import cached_tokenizer_from_config

        tok = cached_tokenizer_from_config(cfg.model_config)
        return None if tok is None else tok.eos_token_id

    return types.SimpleNamespace(
        SamplingParams=SamplingParams,
        RequestOutputKind=RequestOutputKind,
        EngineCoreRequest=EngineCoreRequest,
        UTILITY=EngineCoreRequestType.UTILITY,
        LoRARequest=LoRARequest,
        build_config=build_config,
        make_client=make_client,
        tokenizer_eos=tokenizer_eos,
    )
