"""ScriptedBackend: a model-less backend whose every token is known in advance,
for property tests of the request core (no sockets, no threads).

Token `i` (0-based output position) of sample `index` of the request whose
params.seed is `rseed` is `expected_token(rseed, index, i)`. The core derives
a sequence's seed as `params.seed + index` (the same at every re-submission),
so the backend recovers (request, sample) from the seed and the output
position from the prompt length (the test registers each request's base
prompt length).
A re-submitted sample therefore continues exactly where it left off, and any
token lost, duplicated or reordered by the core shows up as a mismatch.

Tokens are produced into a per-sequence buffer by `produce()` (the test's
"the engine ran" event) and handed over by `step()`; `abort()` returns what
was produced but not handed over (the leftovers the core must stream).
Faults: `inject(seq_id, "abort" | "error")` makes the next step end that
sequence with that backend-side finish.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import time
from collections.abc import Iterable
from typing import Any

from engine_node.backend import BackendError, BackendInfo, BackendOp, SeqRequest, StepOutput

VOCAB = 64
EOS = 2
_SEED_STRIDE = 7919


def expected_token(rseed: int, index: int, i: int) -> int:
    # Mostly away from EOS, reaching it now and then so "stop" finishes happen.
    h = (rseed * 1_000_003 + index * 10_007 + i * 97 + (i * i) % 13) % 997
    return EOS if h % 41 == 0 else 3 + h % (VOCAB - 3)


@dataclasses.dataclass
class _Seq:
    req: SeqRequest
    rseed: int
    index: int
    pos: int  # next output position
    generated: int = 0
    buffered: list[int] = dataclasses.field(default_factory=list)
    frozen: bool = False
    finish: str | None = None  # a natural finish reached by produce(), handed over by step()
    fault: str | None = None


class ScriptedBackend:
    def __init__(
        self, *, granularity: str = "seq", capacity: int = 8, max_model_len: int = 4096, seed: int = 0
    ) -> None:
        self.freeze_granularity = granularity
        self.capacity = capacity
        self.max_model_len = max_model_len
        self.base_len: dict[int, int] = {}  # request seed -> base prompt length (set by the test)
        self.seqs: dict[str, _Seq] = {}
        self.loras_loaded: set[str] = {"a", "b"}
        self.sleeping = 0
        self.asleep: set[str] = set()
        self.staged: dict[int, bytes] = {}
        self.rng = random.Random(seed)
        self.commits = 0
        self.parts: list[tuple[int, list[str], list[int]]] = []  # multi-sender GPU parts received
        # A GPU receive (one sender, nccl): set by a test, resolved when its "broadcast" lands.
        self.receive_gate: concurrent.futures.Future | None = None
        self.handed: dict[tuple[int, int], int] = {}  # (request seed, sample) -> output position handed over
        self.seeds_seen: dict[tuple[int, int], int] = {}  # (request seed, sample) -> the sequence seed it came with

    def info(self) -> BackendInfo:
        return BackendInfo(
            "scripted", "scripted", VOCAB, [EOS], capacity=self.capacity, max_model_len=self.max_model_len
        )

    # ---------------------------------------------------------------- data path
    def add(self, seq: SeqRequest) -> None:
        if self.sleeping:
            raise BackendError("sleeping")
        if seq.seq_id in self.seqs:
            raise BackendError(f"duplicate seq id {seq.seq_id}")
        if seq.lora is not None and seq.lora not in self.loras_loaded:
            raise BackendError(f"lora {seq.lora} not loaded", field="lora")
        assert seq.seed is not None, "the property test always seeds its requests"
        rseed = seq.params.seed
        index = (seq.seed - rseed) % _SEED_STRIDE
        pos = len(seq.prompt) - self.base_len[rseed]
        assert seq.max_new_tokens >= 1
        # A re-submission must carry every token this sample ever handed over
        # (step outputs and abort leftovers), no fewer: a deterministic token
        # function alone would regenerate a lost token and hide the loss.
        handed = self.handed.get((rseed, index))
        if handed is not None:
            assert pos == handed, f"sample {index} re-submitted at position {pos}, but {handed} tokens were handed over"
            assert (
                list(seq.prompt[-pos:] if pos else []) == [expected_token(rseed, index, i) for i in range(pos)][-pos:]
            )
        # The seed of a sample never changes across park / re-submission / restart.
        assert self.seeds_seen.setdefault((rseed, index), seq.seed) == seq.seed, "a sample's seed changed"
        self.seqs[seq.seq_id] = _Seq(seq, rseed, index, pos)
        self.handed.setdefault((rseed, index), pos)

    def restarted(self, rseed: int, index: int, pos: int) -> None:
        """The core dropped the sample's tokens (staleness bound): it comes back at `pos`."""
        self.handed[(rseed, index)] = pos

    def abort(self, seq_ids: Iterable[str]) -> list[StepOutput]:
        out = []
        for sid in seq_ids:
            s = self.seqs.pop(sid, None)
            if s is not None and s.buffered:
                out.append(StepOutput(sid, s.buffered, [0.0] * len(s.buffered), None))
                self.handed[(s.rseed, s.index)] = s.pos
        return out

    def produce(self, max_per_seq: int) -> None:
        """The engine ran: every runnable sequence makes 1..max_per_seq tokens
        (into its buffer, not yet returned)."""
        for s in list(self.seqs.values())[: self.capacity]:
            if s.frozen or s.finish is not None:
                continue
            for _ in range(self.rng.randint(1, max_per_seq)):
                tok = expected_token(s.rseed, s.index, s.pos)
                s.buffered.append(tok)
                s.pos += 1
                s.generated += 1
                p = s.req.params
                if tok in p.stop_token_ids or (not p.ignore_eos and tok == EOS):
                    s.finish = "stop"
                elif s.generated >= s.req.max_new_tokens:
                    s.finish = "length"
                if s.finish:
                    break

    def inject(self, seq_id: str, fault: str) -> None:
        if seq_id in self.seqs:
            self.seqs[seq_id].fault = fault

    def step(self) -> list[StepOutput]:
        out = []
        for sid, s in list(self.seqs.items()):
            if s.frozen:
                continue
            if s.fault is not None:
                out.append(StepOutput(sid, s.buffered, [0.0] * len(s.buffered), s.fault))
                self.handed[(s.rseed, s.index)] = s.pos
                del self.seqs[sid]
            elif s.buffered or s.finish:
                out.append(StepOutput(sid, s.buffered, [0.0] * len(s.buffered), s.finish))
                self.handed[(s.rseed, s.index)] = s.pos
                s.buffered = []
                if s.finish:
                    del self.seqs[sid]
        return out

    def has_work(self) -> bool:
        return any(not s.frozen for s in self.seqs.values())

    def num_running(self) -> int:
        return len(self.seqs)

    def stage_bucket(self, bucket: int, data: memoryview) -> None:
        self.staged[bucket] = bytes(data)

    def stats(self) -> dict[str, Any]:
        return {"kv_usage": len(self.seqs) / self.capacity}

    def loras(self) -> list[str]:
        return sorted(self.loras_loaded)

    # ---------------------------------------------------------------- control
    def freeze(self, seq_ids: Iterable[str]) -> BackendOp:
        ids = list(seq_ids)
        if self.freeze_granularity == "all":
            runnable = {sid for sid, s in self.seqs.items() if not s.frozen}
            assert runnable <= set(ids), "an 'all' backend was asked to freeze a subset"
        for sid in ids:
            if sid in self.seqs:
                self.seqs[sid].frozen = True
        return BackendOp.done("freeze")

    def thaw(self, seq_ids: Iterable[str]) -> BackendOp:
        for sid in seq_ids:
            if sid in self.seqs:
                self.seqs[sid].frozen = False
        return BackendOp.done("thaw")

    def sleep(self, level: int) -> BackendOp:
        if self.seqs:
            return BackendOp.failed("sleep", BackendError(f"cannot sleep with {len(self.seqs)} sequences held"))
        self.sleeping = level
        self.asleep = {"weights", "kv_cache"}
        return BackendOp.done("sleep", {"weights": "discarded" if level == 2 else "kept"})

    def wake_up(self, tags: list[str] | None) -> BackendOp:
        # Per tag, as the real backends: add() is refused until every tag is awake.
        self.asleep -= {"weights", "kv_cache"} if tags is None else set(tags)
        if not self.asleep:
            self.sleeping = 0
        return BackendOp.done("wake_up", {"sleeping": sorted(self.asleep)})

    def reset_prefix_cache(self) -> BackendOp:
        return BackendOp.done("reset_prefix_cache")

    def begin_weight_update(
        self, update_id: str, transport: str, tensors: list[Any], args: dict[str, Any]
    ) -> BackendOp:
        self.staged = {}
        self.parts = []
        return BackendOp.done("begin_weight_update")

    def receive_weights(self, handles: list[Any]) -> BackendOp:
        if self.receive_gate is not None:
            return BackendOp("receive_weights", self.receive_gate, time.monotonic() + 60.0, "weight_timeout_s")
        return BackendOp.failed("receive_weights", BackendError("zmq only", field="transport"))

    def receive_part(
        self, sender: int, tensors: list[Any], sizes: list[int], handles: list[Any], transport_args: dict[str, Any]
    ) -> BackendOp:
        """Multi-sender GPU parts, scripted: recorded; a tensor named "bad" is refused."""
        if any(getattr(t, "name", "") == "bad" for t in tensors):
            return BackendOp.failed("receive_part", BackendError(f"sender {sender}: bad refused", field="bad"))
        self.parts.append((sender, [t.name for t in tensors], list(sizes)))
        return BackendOp.done("receive_part", {"sender": sender})

    def commit_weight_update(self) -> BackendOp:
        self.commits += 1
        return BackendOp.done("commit_weight_update")

    def abort_weight_update(self) -> BackendOp:
        self.staged = {}
        return BackendOp.done("abort_weight_update")

    def load_lora(self, name: str, **_: Any) -> BackendOp:
        self.loras_loaded.add(name)
        return BackendOp.done("load_lora")

    def unload_lora(self, name: str) -> BackendOp:
        self.loras_loaded.discard(name)
        return BackendOp.done("unload_lora")

    def wake_fd(self) -> int | None:
        return None

    def close(self) -> None:
        self.seqs.clear()
