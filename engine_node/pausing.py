"""pause / resume / is_paused of an engine node: the ops that close and open
the submission gate's pause scopes (engine_node/gates.py) over the request flow
(engine_node/request_flow.py). No I/O.

Modes (`P.Pause.mode`):
- abort: the gate closes, running samples are parked (aborted in the backend,
  tokens kept) and re-submitted at resume;
- keep: the gate closes, running samples freeze in the backend (state and KV
  kept) and thaw at resume. Hazard: a backend that can only freeze everything
  (freeze_granularity "all") parks a LoRA-scoped pause's samples instead;
- wait: the gate closes, running samples finish; the ack waits until none of
  the scope runs (a SendAck action), or fails with a timeout naming
  `timeout_s` (the gate stays closed). A resume of the scope answers it at once.

Ownership: the node's loop thread, through RequestCore (engine_node/core.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import msgspec

from bus import protocol as P
from bus.errors import BadRequest, RequestTimeout
from engine_node.actions import DEFERRED, OpOutcome, Pending, SendAck
from engine_node.backend import BackendOp
from engine_node.gates import ALL, SLEEP_SCOPE
from engine_node.request_flow import Entry, RequestFlow
from engine_node.requests import SampleState, transition


@dataclasses.dataclass(eq=False)
class _Wait:
    """A pause(mode='wait') whose ack waits for its scope to drain."""

    seq: int
    scope: str
    deadline: float
    timeout_s: float
    result: P.PauseResult


class Pausing:
    def __init__(self, flow: RequestFlow) -> None:
        self.flow = flow
        self.waits: list[_Wait] = []

    def pause(self, op: P.Pause, seq: int) -> OpOutcome:
        start = _MODES.get(op.mode)
        if start is None:
            raise BadRequest(f"unknown pause mode {op.mode!r} (abort, keep, wait)", field="mode")
        flow = self.flow
        scope = op.lora or ALL
        flow.gate.pauses[scope] = op.mode  # the gate closes at once
        entries = flow.scoped(op.lora)
        held = sum(
            1 for r, s in flow.pending if s.state is SampleState.PENDING and (op.lora is None or r.lora == op.lora)
        )
        result = P.PauseResult(mode=op.mode, scope=scope, held=held)
        return start(self, op, seq, entries, result)

    def _abort(self, op: P.Pause, seq: int, entries: list[Entry], result: P.PauseResult) -> OpOutcome:
        result.parked = self.flow.park(entries)
        return result

    def _keep(self, op: P.Pause, seq: int, entries: list[Entry], result: P.PauseResult) -> OpOutcome:
        flow = self.flow
        live = [(r, s) for r, s in entries if s.state is SampleState.RUNNING]
        if op.lora is not None and flow.backend.freeze_granularity != "seq":
            # The backend can only freeze everything: park this adapter's samples.
            result.parked = flow.park(live)
            return result
        for _, s in live:
            transition(s, SampleState.FROZEN)
        result.frozen = len(live)
        return Pending(flow.backend.freeze([s.seq_id for _, s in live]), lambda _r: result)

    def _wait(self, op: P.Pause, seq: int, entries: list[Entry], result: P.PauseResult) -> OpOutcome:
        result.draining = len(entries)
        now = self.flow.now
        self.waits.append(_Wait(seq, op.lora or ALL, now + op.timeout_s, op.timeout_s, result))
        self.check_waits(now)
        return DEFERRED

    def check_waits(self, now: float) -> None:
        """Clock event: ack the wait-mode pauses whose scope drained, fail the late ones."""
        if not self.waits:
            return
        left = []
        for w in self.waits:
            busy = self.flow.scoped(None if w.scope == ALL else w.scope)
            if not busy:
                self.flow.ack(SendAck.done(w.seq, w.result))
            elif now > w.deadline:
                err = RequestTimeout(
                    f"pause(mode='wait') still had {len(busy)} running sequence(s) after "
                    f"timeout_s={w.timeout_s}; the gate stays closed"
                )
                self.flow.ack(SendAck.failed(w.seq, err))
            else:
                left.append(w)
        self.waits = left

    def resume(self, op: P.Resume, seq: int) -> OpOutcome:
        pauses = self.flow.gate.pauses
        if op.lora is None:
            scopes = [k for k in pauses if k != SLEEP_SCOPE]
        else:
            scopes = [op.lora] if op.lora in pauses else []
        for k in scopes:
            del pauses[k]
        thaw_op, n = self.release()
        result = P.ResumeResult(resumed=n, scopes=scopes, still_paused=sorted(pauses))
        if thaw_op is None:
            return result
        return Pending(thaw_op, lambda _r: result)

    def release(self) -> tuple[BackendOp | None, int]:
        """After the gate opened for some scopes: the flow thaws and admits what
        it may; wait-mode pauses whose scope was resumed are moot: answered now."""
        op, n = self.flow.release()
        pauses = self.flow.gate.pauses
        moot = [w for w in self.waits if w.scope not in pauses]
        if moot:
            self.waits = [w for w in self.waits if w.scope in pauses]
            for w in moot:
                result = msgspec.structs.replace(w.result, resumed_before_drained=True)
                self.flow.ack(SendAck.done(w.seq, result))
        return op, n

    def is_paused(self, op: P.IsPaused, seq: int = 0) -> P.IsPausedResult:
        gate = self.flow.gate
        paused = gate.gated(op.lora) if op.lora else bool(gate.pauses)
        return P.IsPausedResult(paused=paused, scopes=sorted(gate.pauses))


_Start = Callable[[Pausing, P.Pause, int, list[Entry], P.PauseResult], OpOutcome]
_MODES: dict[str, _Start] = {"abort": Pausing._abort, "keep": Pausing._keep, "wait": Pausing._wait}
