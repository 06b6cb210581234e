"""The backend protocol: what the engine node asks of an inference engine.

Ownership: the engine node's loop thread calls every method; a backend never
calls back into the node. Everything request-level that a client can observe
(the submission gate, parking on pause(abort), resubmission, weight versions,
deadlines) is the node's job, so every backend behaves the same to a client.

A backend sees *sequences*: one sample of one request. The node gives each a
unique `seq_id` and its own `seed` (request seed + sample index).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Protocol, runtime_checkable

from bus.protocol import SamplingParams


@dataclasses.dataclass
class SeqRequest:
    seq_id: str
    # Prompt token ids. For a resumed sequence this already ends with the
    # tokens it generated before (the node appends them).
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int  # tokens still to generate (>= 1)
    seed: int | None = None  # per-sequence seed (None: unseeded)
    lora: str | None = None


@dataclasses.dataclass
class StepOutput:
    seq_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None  # chosen-token logprobs, if params.logprobs
    finish_reason: str | None = None  # "stop" | "length" when the sequence ended


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


@runtime_checkable
class Backend(Protocol):
    # "seq": freeze() works on any subset of sequences (keep mode per LoRA);
    # "all": only every sequence at once (the node parks a subset instead).
    freeze_granularity: str

    def info(self) -> BackendInfo: ...

    # -- requests
    def add(self, seq: SeqRequest) -> None: ...

    def abort(self, seq_ids: Iterable[str]) -> list[StepOutput]:
        """Drop these sequences. Returns tokens they produced that no step()
        has returned yet (finish_reason None): the node streams them before
        parking, so nothing is lost."""
        ...

    def step(self) -> list[StepOutput]:
        """Advance every runnable (not frozen) sequence by one step and return
        the new tokens; a finished sequence is dropped after its last output.
        May block briefly waiting for output when `has_work()`."""
        ...

    def has_work(self) -> bool:
        """True while a runnable (unfinished, not frozen) sequence exists."""
        ...

    def num_running(self) -> int: ...

    def freeze(self, seq_ids: Iterable[str]) -> None:
        """Keep-mode pause: keep state (KV) but do not schedule them."""
        ...

    def thaw(self, seq_ids: Iterable[str]) -> None: ...

    # -- memory
    def sleep(self, level: int) -> dict[str, Any]: ...

    def wake_up(self, tags: list[str] | None) -> dict[str, Any]: ...

    def reset_prefix_cache(self) -> None: ...

    # -- weights (transaction: nothing visible before finish; abort restores)
    def begin_weight_update(self, transport: str, tensors: list[Any], args: dict[str, Any]) -> None:
        """`tensors`: the BeginWeightUpdate's TensorMeta list; raise
        ValueError naming the tensor when a name/shape/dtype is wrong."""
        ...

    def stage_weights(self, named: list[tuple[str, Any]]) -> None:
        """zmq transport: tensors (CPU) unpacked from one bucket."""
        ...

    def receive_weights(self, update_id: str, handles: list[Any]) -> dict[str, Any]:
        """GPU transports (cuda_ipc, nccl): pull every bucket now."""
        ...

    def finish_weight_update(self) -> None:
        """Apply everything staged at once (all or nothing), reset the prefix cache."""
        ...

    def abort_weight_update(self) -> None: ...

    # -- LoRA
    def load_lora(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: list[tuple[str, Any]] | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        """Load or replace (in place) adapter `name`."""
        ...

    def unload_lora(self, name: str) -> None: ...

    def loras(self) -> list[str]: ...

    # -- misc
    def stats(self) -> dict[str, Any]:
        """At least {"kv_usage": float in [0, 1]}."""
        ...

    def wake_fd(self) -> int | None:
        """A file descriptor that becomes readable when step() has output
        (backends that produce output on another thread); None otherwise."""
        ...

    def close(self) -> None: ...


class BackendError(Exception):
    """A backend refused an operation (bad tensor name, unsupported transport…)."""


BACKENDS: dict[str, str] = {
    # name -> "module:factory"; factory(model: str, **options) -> Backend
    "torch": "engine_node.backends.torch_backend:make_backend",
    "vllm": "engine_node.backends.vllm_backend:make_backend",
}


def load_backend(name: str, model: str, **options: Any) -> Backend:
    """A registered backend by name, or any importable "module:factory"
    (out-of-tree backends; the benchmarks' model-less `bench.null_backend`)."""
    import importlib

    target = BACKENDS.get(name, name if ":" in name else None)
    if target is None:
        raise BackendError(f"unknown backend {name!r}; choose from {sorted(BACKENDS)} or give module:factory")
    mod, fn = target.split(":", 1)
    return getattr(importlib.import_module(mod), fn)(model, **options)
