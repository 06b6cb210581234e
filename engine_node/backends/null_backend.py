"""The `null` backend (`--backend null`): an engine with NO MODEL.

It runs no forward pass and holds no weights. Every sequence added to it
produces deterministic tokens at once, so whatever is measured around it
(engine node loop, router, client, wire protocol) is the runtime's own cost,
not a model's. Benchmarks, routing and fault tests, and a cluster dry run
(placement, pause/resume, weight-update plumbing) use it; it never serves
real rollouts.

Behaviour
- Token ``i`` (0-based) of a sequence is ``(prompt[-1] + 1 + i) % vocab``. A
  resumed sequence (its prompt already ends with its earlier output) therefore
  continues the same series, so resumption is checkable.
- One ``step()`` returns a sequence's remaining tokens all at once, finishing
  with "length"; option ``tokens_per_step=k`` emits at most k tokens per
  sequence per step instead (streaming benchmarks). A generated token in
  ``params.stop_token_ids``, or in the eos ids unless ``params.ignore_eos``,
  ends the sequence with "stop" (the default series only reaches eos 2 when a
  prompt ends near the top of the vocabulary).
- Logprobs are 0.0 when asked. Seeds are ignored (the output is deterministic).
- freeze/thaw per sequence (granularity "seq"); abort returns nothing (no
  output is ever buffered between steps).
- Every control call is bookkeeping and returns a finished BackendOp
  (`BackendOp.done`, or `BackendOp.failed` on a refusal).
- sleep/wake_up are no-ops that report 0 bytes; weight updates (transport
  "zmq" only) validate names/shapes/dtypes/sizes and count bytes; LoRA is
  bookkeeping only.

Options (``make_backend("null", **options)``; strings are accepted, so CLI
``key=value`` options work): ``vocab`` (32000), ``eos`` (2; an int or a
comma list), ``tokens_per_step`` (0 = all at once, up to 65,536 per step), ``capacity`` (1024),
``max_model_len`` (1 << 20), ``step_delay_s`` (0.0: a sleep per non-empty
step, to imitate decode time).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from bus.tensors import ITEMSIZE, unpack_bucket
from engine_node.backend import BackendError, BackendInfo, BackendOp, SeqRequest, StepOutput

# A step's output per sequence with tokens_per_step=0 ("all at once"): a
# sequence of 2**20 tokens is 16 steps, not one 36 MB list of ints per sample.
MAX_TOKENS_PER_STEP = 65536


def _as_int(v: Any) -> int:
    return int(v) if not isinstance(v, str) else int(v.strip(), 0)


def _as_float(v: Any) -> float:
    return float(v)


def _as_int_list(v: Any) -> list[int]:
    if isinstance(v, str):
        return [int(x) for x in v.replace(" ", "").split(",") if x]
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v]


@dataclass(slots=True)
class _Seq:
    last: int  # prompt[-1]
    max_new: int
    produced: int
    logprobs: bool
    stop: frozenset[int]
    lora: str | None
    frozen: bool = False


def _dtype_name(t: Any) -> str:
    return str(getattr(t, "dtype", "")).removeprefix("torch.")


def _nbytes(t: Any) -> int:
    n = getattr(t, "nbytes", None)
    if n is not None:
        return int(n)
    return int(t.numel() * t.element_size())


class NullBackend:
    """No model; see the module docstring."""

    freeze_granularity = "seq"

    def __init__(
        self,
        model: str = "null",
        *,
        vocab: Any = 32000,
        eos: Any = 2,
        tokens_per_step: Any = 0,
        capacity: Any = 1024,
        max_model_len: Any = 1 << 20,
        step_delay_s: Any = 0.0,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise BackendError(f"null backend: unknown option(s) {sorted(unknown)}")
        self._model = model
        self._vocab = _as_int(vocab)
        self._eos = _as_int_list(eos)
        self._tps = _as_int(tokens_per_step)
        self._capacity = _as_int(capacity)
        self._max_len = _as_int(max_model_len)
        self._delay = _as_float(step_delay_s)
        if self._vocab < 2 or self._tps < 0 or self._capacity < 1 or self._delay < 0:
            raise BackendError("null backend: vocab >= 2, tokens_per_step >= 0, capacity >= 1, step_delay_s >= 0")
        self._seqs: dict[str, _Seq] = {}
        self._runnable = 0  # unfrozen sequences
        self._loras: dict[str, dict[str, Any]] = {}
        self._sleeping = 0
        self._asleep: set[str] = set()
        # weight update transaction
        self._wu_expect: dict[str, tuple[str, tuple[int, ...], int]] | None = None
        self._wu_staged: dict[str, int] = {}
        self._wu_metas: list[Any] = []
        self._weight_updates = 0
        self._weight_bytes = 0
        # counters
        self._steps = 0
        self._tokens_out = 0
        self._added = 0
        self._aborted = 0

    # ------------------------------------------------------------------ info
    def info(self) -> BackendInfo:
        return BackendInfo(
            backend="null",
            model=self._model,
            vocab_size=self._vocab,
            eos_token_ids=list(self._eos),
            capacity=self._capacity,
            max_model_len=self._max_len,
        )

    # -------------------------------------------------------------- requests
    def add(self, seq: SeqRequest) -> None:
        if seq.seq_id in self._seqs:
            raise BackendError(f"duplicate seq_id {seq.seq_id!r}")
        if not seq.prompt:
            raise BackendError("empty prompt", field="prompt_token_ids")
        if seq.max_new_tokens < 1:
            raise BackendError(f"max_new_tokens must be >= 1, got {seq.max_new_tokens}", field="params.max_tokens")
        if seq.lora is not None and seq.lora not in self._loras:
            raise BackendError(f"LoRA adapter {seq.lora!r} is not loaded", field="lora")
        p = seq.params
        stop = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stop.update(self._eos)
        self._seqs[seq.seq_id] = _Seq(
            last=int(seq.prompt[-1]),
            max_new=int(seq.max_new_tokens),
            produced=0,
            logprobs=p.logprobs is not False and p.logprobs is not None,  # True, 0 or k
            stop=frozenset(stop),
            lora=seq.lora,
        )
        self._runnable += 1
        self._added += 1

    def abort(self, seq_ids: Iterable[str]) -> list[StepOutput]:
        for sid in seq_ids:
            s = self._seqs.pop(sid, None)
            if s is not None:
                self._aborted += 1
                if not s.frozen:
                    self._runnable -= 1
        return []  # nothing is ever produced without being returned by step()

    def step(self) -> list[StepOutput]:
        if self._runnable == 0:
            return []
        if self._delay:
            time.sleep(self._delay)
        out: list[StepOutput] = []
        done: list[str] = []
        vocab = self._vocab
        tps = self._tps
        for sid, s in self._seqs.items():
            if s.frozen:
                continue
            n = s.max_new - s.produced
            if tps and tps < n:
                n = tps
            elif n > MAX_TOKENS_PER_STEP:  # "all at once" up to a bound: memory per step stays flat
                n = MAX_TOKENS_PER_STEP
            base = s.last + 1 + s.produced
            toks = [(base + i) % vocab for i in range(n)]
            finish = None
            if s.stop:
                for j, t in enumerate(toks):
                    if t in s.stop:
                        toks = toks[: j + 1]
                        finish = "stop"
                        break
            s.produced += len(toks)
            if finish is None and s.produced >= s.max_new:
                finish = "length"
            out.append(StepOutput(sid, toks, [0.0] * len(toks) if s.logprobs else None, finish))
            self._tokens_out += len(toks)
            if finish is not None:
                done.append(sid)
        for sid in done:
            del self._seqs[sid]
            self._runnable -= 1
        self._steps += 1
        return out

    def has_work(self) -> bool:
        return self._runnable > 0

    def num_running(self) -> int:
        return len(self._seqs)

    def freeze(self, seq_ids: Iterable[str]) -> BackendOp:
        for sid in seq_ids:
            s = self._seqs.get(sid)
            if s is not None and not s.frozen:
                s.frozen = True
                self._runnable -= 1
        return BackendOp.done("freeze")

    def thaw(self, seq_ids: Iterable[str]) -> BackendOp:
        for sid in seq_ids:
            s = self._seqs.get(sid)
            if s is not None and s.frozen:
                s.frozen = False
                self._runnable += 1
        return BackendOp.done("thaw")

    # ---------------------------------------------------------------- memory
    def sleep(self, level: int) -> BackendOp:
        if level not in (1, 2):
            return BackendOp.failed("sleep", BackendError(f"sleep level must be 1 or 2, got {level}", field="level"))
        self._sleeping = level
        self._asleep = {"weights", "kv_cache"}
        return BackendOp.done("sleep", {"level": level, "freed_bytes": 0, "backend": "null"})

    def wake_up(self, tags: list[str] | None) -> BackendOp:
        # Per tag, like the real backends: asleep until every tag woke.
        self._asleep -= {"weights", "kv_cache"} if tags is None else set(tags)
        if not self._asleep:
            self._sleeping = 0
        return BackendOp.done(
            "wake_up", {"tags": list(tags) if tags else ["weights", "kv_cache"], "restored_bytes": 0, "backend": "null"}
        )

    def reset_prefix_cache(self) -> BackendOp:
        return BackendOp.done("reset_prefix_cache")

    # --------------------------------------------------------------- weights
    def begin_weight_update(
        self, update_id: str, transport: str, tensors: list[Any], args: dict[str, Any]
    ) -> BackendOp:
        # A begin while another is open replaces it (the node aborts first).
        self._wu_expect = None
        try:
            self._begin(transport, tensors)
        except (BackendError, ValueError) as e:
            return BackendOp.failed("begin_weight_update", e)
        self._wu_metas = list(tensors)
        return BackendOp.done("begin_weight_update")

    def _begin(self, transport: str, tensors: list[Any]) -> None:
        if transport != "zmq":
            raise BackendError(f"null backend: transport {transport!r} unsupported (only 'zmq')")
        if self._wu_expect is not None:
            raise BackendError("a weight update is already in progress")
        expect: dict[str, tuple[str, tuple[int, ...], int]] = {}
        for m in tensors:
            name, dtype, shape, nbytes = m.name, m.dtype, tuple(int(d) for d in m.shape), int(m.nbytes)
            if name in expect:
                raise ValueError(f"duplicate tensor name {name!r}")
            size = ITEMSIZE.get(dtype)
            if size is None:
                raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
            numel = 1
            for d in shape:
                if d < 0:
                    raise ValueError(f"tensor {name!r}: negative dimension in shape {list(shape)}")
                numel *= d
            if numel * size != nbytes:
                raise ValueError(f"tensor {name!r}: nbytes {nbytes} != {numel} x {size} ({dtype} {list(shape)})")
            expect[name] = (dtype, shape, nbytes)
        self._wu_expect = expect
        self._wu_staged = {}

    def stage_bucket(self, bucket: int, data: memoryview) -> None:
        if self._wu_expect is None:
            raise BackendError("stage_bucket without begin_weight_update")
        self._stage(unpack_bucket(bucket, self._wu_metas, data))

    def _stage(self, named: list[tuple[str, Any]]) -> None:
        if self._wu_expect is None:
            raise BackendError("stage_bucket without begin_weight_update")
        for name, t in named:
            exp = self._wu_expect.get(name)
            if exp is None:
                raise ValueError(f"tensor {name!r} was not announced in begin_weight_update")
            dtype, shape = _dtype_name(t), tuple(int(d) for d in t.shape)
            if (dtype, shape) != exp[:2]:
                raise ValueError(f"tensor {name!r}: got {dtype} {list(shape)}, announced {exp[0]} {list(exp[1])}")
            self._wu_staged[name] = _nbytes(t)

    def receive_weights(self, handles: list[Any]) -> BackendOp:
        return BackendOp.failed(
            "receive_weights",
            BackendError("null backend: GPU weight transports (cuda_ipc, nccl) are unsupported", field="transport"),
        )

    def commit_weight_update(self) -> BackendOp:
        if self._wu_expect is None:
            return BackendOp.failed(
                "commit_weight_update", BackendError("commit_weight_update without begin_weight_update")
            )
        missing = sorted(set(self._wu_expect) - set(self._wu_staged))
        if missing:
            return BackendOp.failed(
                "commit_weight_update",
                BackendError(f"weight update incomplete: {len(missing)} tensor(s) never received, e.g. {missing[0]!r}"),
            )
        self._weight_bytes += sum(self._wu_staged.values())
        self._weight_updates += 1
        self._wu_expect, self._wu_staged = None, {}
        return BackendOp.done("commit_weight_update")

    def abort_weight_update(self) -> BackendOp:
        self._wu_expect, self._wu_staged = None, {}
        return BackendOp.done("abort_weight_update")

    # ------------------------------------------------------------------ LoRA
    def load_lora(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: list[tuple[str, Any]] | None = None,
        config: dict[str, Any] | None = None,
    ) -> BackendOp:
        if not name:
            return BackendOp.failed("load_lora", BackendError("LoRA name must be non-empty", field="name"))
        if path is None and tensors is None:
            return BackendOp.failed(
                "load_lora", BackendError(f"load_lora({name!r}): give a path or staged tensors", field="path")
            )
        nbytes = sum(_nbytes(t) for _, t in tensors) if tensors else 0
        self._loras[name] = {
            "path": path,
            "num_tensors": len(tensors or ()),
            "bytes": nbytes,
            "config": dict(config or {}),
        }
        return BackendOp.done("load_lora")

    def unload_lora(self, name: str) -> BackendOp:
        if name not in self._loras:
            return BackendOp.failed("unload_lora", BackendError(f"LoRA adapter {name!r} is not loaded", field="name"))
        if any(s.lora == name for s in self._seqs.values()):
            return BackendOp.failed("unload_lora", BackendError(f"LoRA adapter {name!r} has running sequences"))
        del self._loras[name]
        return BackendOp.done("unload_lora")

    def loras(self) -> list[str]:
        return sorted(self._loras)

    # ------------------------------------------------------------------ misc
    def stats(self) -> dict[str, Any]:
        return {
            "kv_usage": min(1.0, len(self._seqs) / self._capacity),
            "running": len(self._seqs),
            "runnable": self._runnable,
            "steps": self._steps,
            "tokens_out": self._tokens_out,
            "added": self._added,
            "aborted": self._aborted,
            "sleeping": self._sleeping,
            "weight_updates": self._weight_updates,
            "weight_bytes": self._weight_bytes,
            "loras": sorted(self._loras),
        }

    def wake_fd(self) -> int | None:
        return None

    def close(self) -> None:
        self._seqs.clear()
        self._runnable = 0


# What an engine node's --backend takes to load this one (engine_node.backend.BACKENDS).
NULL_BACKEND = "null"


def make_backend(model: str = "null", **options: Any) -> NullBackend:
    return NullBackend(model, **options)
