"""The backend protocol: what the engine node asks of an inference engine.

Ownership: the engine node's loop thread calls every method; a backend never
calls back into the node. Everything request-level that a client can observe
(the submission gate, parking on pause(abort), resubmission, weight versions,
deadlines) is the node's job, so every backend behaves the same to a client.

A backend sees *sequences*: one sample of one request. The node gives each a
unique `seq_id` and its own `seed`.

Two kinds of calls, and the hazard that separates them:

- **Data path** (`add`, `abort`, `step`, `has_work`, `num_running`,
  `stage_bucket`, `stats`, `loras`): synchronous and short. `step()` may wait
  at most a few milliseconds for output; nothing else waits at all.
- **Control** (freeze/thaw, sleep/wake, prefix cache, weight updates, LoRA):
  return a `BackendOp` at once and never block the caller. The node keeps
  reading its sockets, heartbeating and stepping while an op runs, and acks the
  command when the op's future completes (it registers a done-callback that
  wakes its poller). A backend whose op needs the model exclusively (e.g. the
  torch backend loading weights on its own thread) makes `step()` return no
  output meanwhile; it must never make `step()` block for the op's duration.
  An op's future fails with `BackendError` (refused: names the field when
  there is one) or `BackendTimeout` (its deadline passed: names the knob).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from bus import errors as bus_errors
from bus.errors import BackendRefused, ErrorCode, RolloutBusError
from bus.protocol import SamplingParams


@dataclasses.dataclass(slots=True)
class SeqRequest:
    seq_id: str
    # Prompt token ids. For a resumed sequence this already ends with the
    # tokens it generated before (the node appends them).
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int  # tokens still to generate (>= 1)
    seed: int | None = None  # per-sequence seed (None: the backend's own stream)
    lora: str | None = None
    # -- issue 10. The last `output_prefix` prompt tokens are output generated
    # before a re-submission: presence/frequency penalties count them as output.
    output_prefix: int = 0
    # Prompt logprobs to compute for this submission (None: none; the node asks
    # once per sample, whatever params.prompt_logprobs says).
    prompt_logprobs: int | None = None
    # Opaque generator state a backend returned for this sample when it was
    # last aborted (StepOutput.rng_state): continue from it instead of
    # re-seeding, so a parked sample draws exactly what it would have drawn.
    rng_state: Any = None
    # -- issue 37 (R3): None: no routes. k: return the routed experts of every
    # sequence position from k on (k <= len(prompt); positions are indexes into
    # prompt + output), each in StepOutput.routed_experts once.
    routes_from: int | None = None


@dataclasses.dataclass(slots=True)
class StepOutput:
    seq_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None  # chosen-token logprobs, if params.logprobs
    # "stop" | "length": the sequence ended naturally and is gone from the backend.
    # "abort": the backend dropped it on its own (preempted, engine-side abort):
    #          the node re-submits prompt + tokens so far.
    # "error": the backend failed this sequence only; the node fails its request.
    finish_reason: str | None = None
    # -- issue 10: top-k alternatives (params.logprobs = k >= 1), row-major
    # [len(token_ids) * k], best first; and the prompt logprobs of a submission
    # that asked for them (once, on any output of that submission).
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    prompt_logprobs: PromptLogprobsOut | None = None
    # abort() only, optional: the sequence's generator state now (opaque), which
    # the node hands back in SeqRequest.rng_state when it re-submits the sample.
    rng_state: Any = None
    # -- issue 37 (R3), when SeqRequest.routes_from is set: the expert ids the
    # positions [routes_start, routes_start + len) were routed to as the
    # model's input in this step (an int array [rows, moe_layers, top_k]);
    # rows for positions before routes_from are allowed (the node drops them).
    routed_experts: Any = None
    routes_start: int = 0


@dataclasses.dataclass(slots=True)
class PromptLogprobsOut:
    """Per token of the submitted prompt: logprobs[i] = log p(prompt[i] | prompt[:i])
    (NaN at 0); top_ids / top_logprobs: the k best at each position, row-major
    [len(prompt) * k] (row 0 zeros / NaN)."""

    k: int
    logprobs: list[float]
    top_ids: list[int] = dataclasses.field(default_factory=list)
    top_logprobs: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class BackendInfo:
    backend: str
    model: str
    vocab_size: int
    eos_token_ids: list[int]
    capacity: int = 64  # sequences stepped together
    max_model_len: int = 4096
    tp: int = 1
    pp: int = 1
    dp: int = 1
    dtype: str = ""  # weight dtype ("float32", "bfloat16"…): the bridge casts to it
    # -- issue 37: (moe_layers, top_k, num_experts) when the backend was started
    # with `return_routed_experts` (else None: a request asking is refused).
    routed_experts: tuple[int, int, int] | None = None


class BackendError(BackendRefused):
    """A backend refused an operation (bad tensor name, unsupported transport…):
    on the wire `backend_refused`, naming the field when known."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message, field=field)


class BackendTimeout(bus_errors.BackendTimeout, BackendError):
    """A backend operation did not finish within its deadline; the message
    names the option (knob) that sets it. On the wire `backend_timeout`."""

    code = ErrorCode.BACKEND_TIMEOUT

    def __init__(self, what: str, seconds: float, knob: str) -> None:
        msg = f"{what} did not finish within {seconds:g} s (raise the backend option {knob})"
        RolloutBusError.__init__(self, msg, field=knob)
        self.knob = knob
        self.seconds = seconds


@dataclasses.dataclass(eq=False)
class BackendOp:
    """A control operation in progress. `future` resolves to a dict (the op's
    result) or fails with BackendError. `deadline` (monotonic) is when the node
    stops waiting and reports BackendTimeout naming `knob`; the backend should
    fail the future itself by then, the node's check is the backstop."""

    what: str
    future: concurrent.futures.Future
    deadline: float
    knob: str

    @classmethod
    def done(cls, what: str, result: dict[str, Any] | None = None) -> BackendOp:
        """An op that finished synchronously (cheap bookkeeping)."""
        f: concurrent.futures.Future = concurrent.futures.Future()
        f.set_result(dict(result or {}))
        return cls(what, f, float("inf"), "")

    @classmethod
    def failed(cls, what: str, error: BaseException) -> BackendOp:
        f: concurrent.futures.Future = concurrent.futures.Future()
        f.set_exception(error)
        return cls(what, f, float("inf"), "")

    @classmethod
    def pending(cls, what: str, timeout_s: float, knob: str) -> BackendOp:
        return cls(what, concurrent.futures.Future(), time.monotonic() + timeout_s, knob)

    def timeout_error(self) -> BackendTimeout:
        left = self.deadline - time.monotonic()
        return BackendTimeout(self.what, max(0.0, round(-left, 3)) if left < 0 else 0.0, self.knob)


@runtime_checkable
class Backend(Protocol):
    # "seq": freeze() works on any subset of sequences (keep mode per LoRA);
    # "all": only every sequence at once (the node parks a subset instead).
    freeze_granularity: str
    # Optional (default True): the node gives unseeded sequences a seed drawn
    # from its own stream (engine_node/seeding.py). False: they reach the
    # backend with seed=None and draw from its engine-level generator, which
    # the node seeds per engine and incarnation (the `seed` backend option).
    # seeds_unseeded: bool

    def info(self) -> BackendInfo: ...

    # ---------------------------------------------------------------- data path
    def add(self, seq: SeqRequest) -> None:
        """Queue one sequence (raise BackendError(field=…) to refuse it)."""
        ...

    def abort(self, seq_ids: Iterable[str]) -> list[StepOutput]:
        """Drop these sequences now. Returns tokens they produced that no
        step() has returned yet (finish_reason None): the node streams them
        before parking, so nothing is lost. After abort() returns, step()
        never reports these seq ids again (late engine outputs are dropped)."""
        ...

    def step(self) -> list[StepOutput]:
        """New tokens since the last call, for every runnable sequence. May
        wait briefly (a few ms) for output when `has_work()`."""
        ...

    def has_work(self) -> bool:
        """True while a runnable (unfinished, not frozen) sequence exists, or
        output is waiting to be returned."""
        ...

    def num_running(self) -> int:
        """Sequences held by the backend (running, waiting for a slot, frozen)."""
        ...

    # ------------------------------------------------------------------ control
    def freeze(self, seq_ids: Iterable[str]) -> BackendOp:
        """Keep-mode pause: keep state (KV) but do not schedule them. Resolves
        when no step will produce tokens for them any more."""
        ...

    def thaw(self, seq_ids: Iterable[str]) -> BackendOp: ...

    def sleep(self, level: int) -> BackendOp:
        """Only with no sequence held (the node parks them first). Puts both
        tags ("weights", "kv_cache") to sleep, a half-awake backend's too; the
        result's "weights": "discarded" (level 2) tells the node the woken
        weights are a new weight state."""
        ...

    def wake_up(self, tags: list[str] | None) -> BackendOp:
        """Wake `tags` (None: both), in any order and split; a tag awake already
        is a no-op. The node's gate stays closed until no tag sleeps, and weight
        updates come only while the weights are awake."""
        ...

    def reset_prefix_cache(self) -> BackendOp: ...

    # -- weights: a transaction, nothing visible before commit; abort restores
    def begin_weight_update(
        self, update_id: str, transport: str, tensors: list[Any], args: dict[str, Any]
    ) -> BackendOp:
        """`tensors`: the BeginWeightUpdate's TensorMeta list; `args` carries
        "bucket_sizes" and the transport's arguments. Fails naming the tensor
        when a name / shape / dtype is wrong."""
        ...

    def stage_bucket(self, bucket: int, data: memoryview) -> None:
        """zmq transport: the raw bytes of one bucket (a view of a zmq frame,
        valid only during the call: copy what you keep, once). Slice it with
        bus.tensors.unpack_bucket. Raise BackendError to refuse it."""
        ...

    def receive_weights(self, handles: list[Any]) -> BackendOp:
        """GPU transports (cuda_ipc, nccl): pull every bucket now."""
        ...

    def commit_weight_update(self) -> BackendOp:
        """Apply everything staged at once (all or nothing), reset the prefix cache."""
        ...

    def abort_weight_update(self) -> BackendOp: ...

    # -- LoRA
    def load_lora(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: list[tuple[str, Any]] | None = None,
        config: dict[str, Any] | None = None,
    ) -> BackendOp:
        """Load or replace (in place) adapter `name`."""
        ...

    def unload_lora(self, name: str) -> BackendOp: ...

    def loras(self) -> list[str]: ...

    # --------------------------------------------------------------------- misc
    def stats(self) -> dict[str, Any]:
        """At least {"kv_usage": float in [0, 1]}. Cheap: called every heartbeat."""
        ...

    def wake_fd(self) -> int | None:
        """A file descriptor that becomes readable when step() has output
        (backends that produce output on another thread); None otherwise.
        Such a backend may also define `output_ready() -> bool` (output queued
        now) and `step_wait_s`: while output_ready() is False the node waits
        in its poll, wake fd and sockets together, for up to step_wait_s
        instead of calling step()."""
        ...

    def close(self) -> None:
        """Stop the engine and every process it started."""
        ...


BACKENDS: dict[str, str] = {
    # name -> "module:factory"; factory(model: str, **options) -> Backend
    "torch": "engine_node.backends.torch.backend:make_backend",
    "vllm": "engine_node.backends.vllm.backend:make_backend",
    "null": "engine_node.backends.null_backend:make_backend",  # no model: benches, routing tests, dry runs
}


def load_backend(name: str, model: str, **options: Any) -> Backend:
    """A registered backend by name, or any importable "module:factory"
    (out-of-tree backends)."""
    import importlib

    target = BACKENDS.get(name, name if ":" in name else None)
    if target is None:
        raise BackendError(f"unknown backend {name!r}; choose from {sorted(BACKENDS)} or give module:factory")
    mod, fn = target.split(":", 1)
    return getattr(importlib.import_module(mod), fn)(model, **options)
