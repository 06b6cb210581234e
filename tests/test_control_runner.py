"""engine_node/control.py without sockets: arrival order, one long op at a
time, read-only ops answered while it runs, the deadline backstop, the ack
cache, the wake pipe."""

from __future__ import annotations

import select
import time

import structlog

from bus import protocol as P
from bus.errors import RequestTimeout
from engine_node.actions import DEFERRED, Pending, SendAck, wire_ack
from engine_node.backend import BackendError, BackendOp
from engine_node.control import ControlRunner


class Rig:
    def __init__(self) -> None:
        self.acks: list[P.Ack] = []
        self.ran: list[str] = []
        self.ops: dict[str, BackendOp] = {}
        handlers = {
            P.Ping: lambda op, seq: self._run("ping", {"pong": True}),
            P.Stats: lambda op, seq: self._run("stats", {"n": 1}),
            P.IsPaused: lambda op, seq: self._run("is_paused", {"paused": False}),
            P.Sleep: lambda op, seq: self._long("sleep", op.level),
            P.Pause: lambda op, seq: self._run("pause", DEFERRED),
            P.Resume: lambda op, seq: self._run("resume", {"resumed": 0}),
            P.ResetPrefixCache: lambda op, seq: self._boom(),
        }
        self.busy_changes = 0
        self.r = ControlRunner(
            "e0", handlers, self.acks.append, on_busy_change=self._busy, log=structlog.get_logger("t")
        )

    def _busy(self) -> None:
        self.busy_changes += 1

    def _run(self, name: str, result):
        self.ran.append(name)
        return result

    def _long(self, name: str, level: int):
        self.ran.append(name)
        op = BackendOp.pending(name, 0.3 if level == 2 else 30.0, "sleep_timeout_s")
        self.ops[name] = op
        return Pending(op, lambda res: {**res, "then": True})

    def _boom(self):
        raise RuntimeError("bug")

    def cmd(self, seq: int, op) -> None:
        self.r.on_command(P.Command(seq=seq, op=op))

    def woke(self, timeout: float = 2.0) -> bool:
        return bool(select.select([self.r.wake_fd], [], [], timeout)[0])


def test_long_op_queues_state_changes_and_answers_read_only_at_once() -> None:
    rig = Rig()
    try:
        rig.cmd(1, P.Sleep(level=1))
        assert rig.r.busy_name == "sleep" and rig.busy_changes == 1 and rig.acks == []
        rig.cmd(2, P.Resume())  # state-changing: waits behind the op
        rig.cmd(3, P.Ping())
        rig.cmd(4, P.Stats())
        rig.cmd(5, P.IsPaused())
        assert [a.seq for a in rig.acks] == [3, 4, 5] and rig.ran == ["sleep", "ping", "stats", "is_paused"]
        rig.cmd(1, P.Sleep(level=1))  # republished while in progress: ignored
        assert len(rig.acks) == 3
        rig.ops["sleep"].future.set_result({"level": 1})
        assert rig.woke()
        rig.r.on_wake()
        assert [a.seq for a in rig.acks] == [3, 4, 5, 1, 2]
        assert rig.acks[3].ok and rig.acks[3].result == {"level": 1, "then": True}
        assert rig.r.busy_name == "" and rig.busy_changes == 2
        rig.cmd(1, P.Sleep(level=1))  # republished after: answered from the cache, not re-run
        assert rig.acks[-1] == rig.acks[3] and rig.ran.count("sleep") == 1
    finally:
        rig.r.close()


def test_deadline_backstop_acks_a_timeout_naming_the_knob_and_moves_on() -> None:
    rig = Rig()
    try:
        rig.cmd(1, P.Sleep(level=2))  # deadline 0.3 s
        rig.cmd(2, P.Resume())
        rig.r.check_deadline(time.monotonic())
        assert rig.acks == []
        rig.r.check_deadline(time.monotonic() + 1.0)
        assert [a.seq for a in rig.acks] == [1, 2]
        f = rig.acks[0].failure
        assert f is not None and f.code == "backend_timeout" and "sleep_timeout_s" in f.message
        rig.ops["sleep"].future.set_result({})  # too late: dropped
        rig.r.on_wake()
        assert len(rig.acks) == 2
    finally:
        rig.r.close()


def test_failures_are_typed_and_deferred_ops_are_not_acked_here() -> None:
    rig = Rig()
    try:
        rig.cmd(1, P.ResetPrefixCache())
        f = rig.acks[-1].failure
        assert f is not None and f.code == "internal" and "bug" in f.message
        rig.cmd(2, P.Pause(mode="wait"))
        assert len(rig.acks) == 1  # the core acks a wait-mode pause itself
        rig.cmd(3, P.Sleep(level=1))
        rig.ops["sleep"].future.set_exception(BackendError("cannot sleep", field="level"))
        assert rig.woke()
        rig.r.on_wake()
        a = rig.acks[-1]
        assert not a.ok and a.failure is not None
        assert (a.seq, a.failure.code, a.failure.field) == (3, "backend_refused", "level")
    finally:
        rig.r.close()


def test_a_cores_late_ack_is_one_shape_cached_for_republication() -> None:
    """A SendAck a core appends later (pause(wait), a prepare that waited) goes
    out through the runner like any ack: same wire shape, cached, acked_seq."""
    rig = Rig()
    try:
        rig.cmd(7, P.Pause(mode="wait"))
        assert rig.acks == [] and rig.r.acked_seq == 0
        rig.r.ack(SendAck.done(7, P.PauseResult(mode="wait", scope="*")))
        assert rig.acks[-1].seq == 7 and rig.acks[-1].ok and rig.acks[-1].result.mode == "wait"
        assert rig.r.acked_seq == 7
        rig.cmd(7, P.Pause(mode="wait"))  # republished: answered from the cache
        assert len(rig.acks) == 2 and rig.acks[-1] == rig.acks[0] and rig.ran.count("pause") == 1
        rig.cmd(8, P.Pause(mode="wait"))
        late = SendAck.failed(8, RequestTimeout("pause(mode='wait') still had 1 running sequence(s)"))
        assert late.failure is not None and late.failure.code == "timeout" and not late.ok
        rig.r.ack(late)
        assert rig.acks[-1] == wire_ack("e0", late) and not rig.acks[-1].ok  # the one mapping to the wire
        assert SendAck.done(9).result == P.Done() and SendAck.done(9).ok  # nothing to report: Done
    finally:
        rig.r.close()


def test_a_pending_whose_then_returns_a_pending_goes_on_as_the_same_op() -> None:
    """engine_node/one_trip.py's nccl commit behind its receive: the second
    call starts on the loop thread when the first is done; the op is acked
    once, after the second; later ops wait behind both; a failing second
    stage rolls back through ITS on_error."""
    rig = Rig()
    second = BackendOp.pending("commit", 30.0, "weight_timeout_s")
    rolled: list[str] = []

    def first_then(res):
        rig.ran.append("then1")
        return Pending(second, lambda r: {"committed": r["v"]}, lambda e: rolled.append("second"))

    first = BackendOp.pending("receive", 30.0, "weight_timeout_s")
    rig.r.handlers[P.Sleep] = lambda op, seq: Pending(first, first_then, lambda e: rolled.append("first"))
    try:
        rig.cmd(1, P.Sleep(level=1))
        rig.cmd(2, P.Resume())
        first.future.set_result({})
        assert rig.woke()
        rig.r.on_wake()
        assert rig.ran == ["then1"] and rig.acks == [] and rig.r.busy_name == "sleep", "still the same op"
        second.future.set_result({"v": 3})
        assert rig.woke()
        rig.r.on_wake()
        assert [a.seq for a in rig.acks] == [1, 2] and rig.acks[0].result == {"committed": 3}
        third = BackendOp.pending("commit", 30.0, "weight_timeout_s")
        second_fail = BackendOp.pending("receive", 30.0, "weight_timeout_s")
        rig.r.handlers[P.Sleep] = lambda op, seq: Pending(
            second_fail, lambda r: Pending(third, lambda x: x, lambda e: rolled.append("third"))
        )
        rig.cmd(3, P.Sleep(level=1))
        second_fail.future.set_result({})
        assert rig.woke()
        rig.r.on_wake()
        third.future.set_exception(BackendError("write failed"))
        assert rig.woke()
        rig.r.on_wake()
        assert not rig.acks[-1].ok and "write failed" in rig.acks[-1].failure.message and rolled == ["third"]
    finally:
        rig.r.close()
