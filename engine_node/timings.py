"""Typed timing records of an engine node's slow moments: where a weight
update's receive and commit went, and where a resume's first output came from.

Read through the Stats control op: `StatsResult.detail["timings"]` holds a
`Timings` as plain data; `read_timings(detail)` turns it back into these
Structs (bench/gpu/weight_update.py does). No log line carries them: a reader
never parses log text.

Ownership: the node's loop thread writes (`TimingLog`, `ResumeClock`), the
Stats op reads a snapshot on the same thread. Every kind keeps its last
`KEEP` records, so a long-lived engine never grows with them; each record
has an ordinal `n` (1, 2, ... per kind), so a reader takes what is newer
than what it saw.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import msgspec

KEEP = 32


class WorkerCommit(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Where a vLLM worker's commit went (engine_node/backends/vllm/worker_ext.py;
    seconds). path: "plan", "load_weights+record" or "load_weights"."""

    path: str | None = None
    seconds: float | None = None
    open_s: float | None = None
    apply_s: float | None = None
    copy_s: float | None = None
    fallback: int | None = None  # tensors the plan could not write (loaded the slow way)
    fallback_s: float | None = None
    views_reused: bool | None = None  # the plan's source views kept from the last update (vllm/worker_reuse)
    record_s: float | None = None
    load_s: float | None = None
    verify_s: float | None = None
    verify_mismatch: list[str] | None = None
    post_sync_s: float | None = None
    copied: int | None = None  # buckets copied from another GPU
    maps_kept: int | None = None
    plan: dict[str, Any] | None = None
    why: str | None = None
    check_params: int | None = None  # weight_check=True: parameters compared with load_weights'
    check_mismatch: list[str] | None = None
    check_s: float | None = None


class CommitTiming(msgspec.Struct, kw_only=True):
    n: int
    update_id: str
    transport: str
    seconds: float  # the node: commit handed to the backend -> done
    backend_seconds: float | None = None  # the backend's own measure, when it reports one
    worker: WorkerCommit | None = None


class ReceiveTiming(msgspec.Struct, kw_only=True):
    """A GPU transport's receive (nccl: group set-up, allocation, broadcast)."""

    n: int
    update_id: str
    transport: str
    seconds: float
    backend_seconds: float | None = None
    reused: bool | None = None  # nccl: the group of an earlier update
    setup_seconds: float | None = None
    alloc_s: float | None = None
    broadcast_s: float | None = None


class OutputTrace(msgspec.Struct, omit_defaults=True, kw_only=True):
    """The backend's view of the first live output after a resume (the vLLM
    backend's `take_output_trace`), in ms after the Resume: built (the engine
    core built the batch), drained (the node's thread took it), queued /
    scheduled (only with vLLM's log_stats), ramp_released (the resume ramp let
    the held requests go); batches_before: batches with no live output first;
    sent / sent_tokens: requests and prompt tokens sent by then."""

    built_ms: float | None = None
    drained_ms: float | None = None
    queued_ms: float | None = None
    scheduled_ms: float | None = None
    ramp_released_ms: float | None = None
    batches_before: int = 0
    sent: int = 0
    sent_tokens: int = 0
    live: int = 0


class ResumeTiming(msgspec.Struct, kw_only=True):
    """A Resume that found requests parked, held or running: ms from the op to
    the core re-admitting them and to the first step with output."""

    n: int
    first_output_ms: float
    admitted_ms: float | None = None
    running: int = 0  # sequences in the backend at the first output
    backend: OutputTrace | None = None


class Timings(msgspec.Struct, kw_only=True):
    commits: list[CommitTiming] = []
    receives: list[ReceiveTiming] = []
    resumes: list[ResumeTiming] = []


def read_timings(detail: Mapping[str, Any]) -> Timings:
    """The Timings in a Stats result's detail (empty when the engine has none)."""
    return msgspec.convert(detail.get("timings") or {}, Timings)


class ResumeClock:
    """Marks of one armed resume (no I/O; times are the caller's clock, s).
    `first_output` ends it and returns the marks relative to the arming."""

    def __init__(self) -> None:
        self._t0: float | None = None
        self._admitted: float | None = None

    @property
    def armed(self) -> bool:
        return self._t0 is not None

    def arm(self, now: float) -> None:
        self._t0, self._admitted = now, None

    def disarm(self) -> None:
        self._t0 = None

    def admitted(self, now: float) -> None:
        if self._t0 is not None and self._admitted is None:
            self._admitted = now

    def first_output(self, now: float) -> tuple[float, float | None] | None:
        """(first_output_ms, admitted_ms) and disarmed; None when not armed."""
        t0, self._t0 = self._t0, None
        if t0 is None:
            return None
        adm = None if self._admitted is None else round((self._admitted - t0) * 1e3, 2)
        return round((now - t0) * 1e3, 2), adm


def _num(v: Any) -> float | None:
    return round(float(v), 4) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class TimingLog:
    """The node's bounded record of Timings (see the module docstring)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.resume = ResumeClock()
        self._commits: collections.deque[CommitTiming] = collections.deque(maxlen=keep)
        self._receives: collections.deque[ReceiveTiming] = collections.deque(maxlen=keep)
        self._resumes: collections.deque[ResumeTiming] = collections.deque(maxlen=keep)
        self._n = {"commits": 0, "receives": 0, "resumes": 0}
        # Weight senders refused their credential, per kind (engine_node/weight_socket.py counts them).
        self.weight_refusals: dict[str, int] = {}

    def _next(self, kind: str) -> int:
        self._n[kind] += 1
        return self._n[kind]

    def commit(self, update_id: str, transport: str, seconds: float, result: Mapping[str, Any]) -> None:
        """`result`: the backend's commit result; its "worker" report is kept
        (unknown keys are dropped, a malformed one is left out)."""
        worker = None
        if isinstance(result.get("worker"), Mapping):
            try:
                worker = msgspec.convert(result["worker"], WorkerCommit)
            except msgspec.ValidationError:
                worker = None  # a backend's report never fails the commit that made it
        self._commits.append(
            CommitTiming(
                n=self._next("commits"),
                update_id=update_id,
                transport=transport,
                seconds=round(seconds, 4),
                backend_seconds=_num(result.get("backend_seconds")),
                worker=worker,
            )
        )

    def receive(self, update_id: str, transport: str, seconds: float, result: Mapping[str, Any]) -> None:
        nccl = result.get("nccl")
        part = nccl if isinstance(nccl, Mapping) else {}
        reused = part.get("reused")
        self._receives.append(
            ReceiveTiming(
                n=self._next("receives"),
                update_id=update_id,
                transport=transport,
                seconds=round(seconds, 4),
                backend_seconds=_num(result.get("backend_seconds")),
                reused=reused if isinstance(reused, bool) else None,
                setup_seconds=_num(part.get("setup_seconds")),
                alloc_s=_num(part.get("alloc_s")),
                broadcast_s=_num(part.get("broadcast_s")),
            )
        )

    def resumed(self, now: float, running: int, backend_trace: Mapping[str, Any] | None) -> None:
        """The first output after an armed resume (the clock disarms)."""
        marks = self.resume.first_output(now)
        if marks is None:
            return
        trace = None
        if backend_trace:
            try:
                trace = msgspec.convert(backend_trace, OutputTrace)
            except msgspec.ValidationError:
                trace = None  # the backend's trace is optional detail
        self._resumes.append(
            ResumeTiming(
                n=self._next("resumes"), first_output_ms=marks[0], admitted_ms=marks[1], running=running, backend=trace
            )
        )

    def snapshot(self) -> Timings:
        return Timings(commits=list(self._commits), receives=list(self._receives), resumes=list(self._resumes))

    def to_builtins(self) -> dict[str, Any]:
        """The snapshot as plain data (a Stats result's detail travels as msgpack)."""
        out: dict[str, Any] = msgspec.to_builtins(self.snapshot())
        out["weight_refusals"] = dict(self.weight_refusals)
        return out
