"""Control commands of an engine node: in arrival order, one long op at a time,
never blocking the loop.

A handler returns an `OpOutcome` (engine_node/actions.py): its op's typed
result (a `P.*Result`: ack now), `DEFERRED` (a core acks it later with a
SendAck action: pause(wait), a prepare waiting for senders) or a `Pending` (a
BackendOp still running; its `then` may return another Pending: the same op
goes on with a second backend call, started on the loop thread, and is acked
when that one is done — the nccl one-trip's commit behind its receive). While an
op runs the runner is *busy*: later state-changing commands queue behind it;
read-only ops (Ping, Stats, IsPaused) are answered at once. The op's future
gets a done-callback that writes one byte to the wake pipe, whose read end the
node's poller watches; the ack goes out when the future is done, or a
BackendTimeout naming the op's knob when the clock passes its deadline first.

Ownership: the node's loop thread calls everything here except `_wake`, which
runs on whatever thread completes a future and only writes to the pipe.
Every ack is a `SendAck` (a result or a typed `P.EngineFailure`, `failure_of`),
never parsed from text; `actions.wire_ack` makes the wire Ack.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Callable
from typing import Any

from bus import protocol as P
from bus.errors import ErrorCode
from engine_node.actions import Deferred, OpOutcome, Pending, SendAck, failure_of, wire_ack

ACK_CACHE = 4096  # republished commands are answered from here, never re-run
READ_ONLY: frozenset[type] = frozenset({P.Ping, P.Stats, P.IsPaused})


class ControlRunner:
    def __init__(
        self,
        engine_id: str,
        handlers: dict[type, Callable[[Any, int], OpOutcome]],
        send_ack: Callable[[P.Ack], object],
        *,
        on_busy_change: Callable[[], None] = lambda: None,
        before_complete: Callable[[], None] = lambda: None,
        log: Any,
    ) -> None:
        self.engine_id = engine_id
        self.handlers = handlers
        self.send_ack = send_ack
        self.on_busy_change = on_busy_change
        self.before_complete = before_complete  # e.g. refresh the core's clock
        self.log = log
        self.acks: collections.OrderedDict[int, P.Ack | None] = collections.OrderedDict()
        self.queue: collections.deque[P.Command] = collections.deque()  # state-changing, not started
        self.busy: tuple[P.Command, Pending] | None = None  # the op in progress
        self.acked_seq = 0  # highest seq acked (Heartbeat.acked_seq)
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)

    @property
    def busy_name(self) -> str:
        return P.OP_NAMES[type(self.busy[0].op)] if self.busy else ""

    def close(self) -> None:
        for fd in (self.wake_fd, self._wake_w):
            with contextlib.suppress(OSError):  # closed already
                os.close(fd)

    # ------------------------------------------------------------ events

    def on_command(self, cmd: P.Command) -> None:
        if cmd.seq in self.acks:  # republished: answer from the cache, never re-run
            cached = self.acks[cmd.seq]
            if cached is not None:
                self.send_ack(cached)
            return
        self.acks[cmd.seq] = None  # in progress: a republication is ignored
        while len(self.acks) > ACK_CACHE:
            self.acks.popitem(last=False)
        if type(cmd.op) in READ_ONLY:
            self._start(cmd)
        else:
            self.queue.append(cmd)
            self.pump()

    def on_wake(self) -> None:
        """The wake pipe is readable: an op's future completed."""
        with contextlib.suppress(BlockingIOError, OSError):  # drained (non-blocking pipe)
            while os.read(self.wake_fd, 4096):
                pass
        if self.busy is not None and self.busy[1].op.future.done():
            cmd, pending = self.busy
            self.busy = None
            self._complete(cmd, pending)
            self.on_busy_change()
        self.pump()

    def check_deadline(self, now: float) -> None:
        if self.busy is None:
            return
        cmd, pending = self.busy
        if pending.op.future.done() or now <= pending.op.deadline:
            return
        # The backend's own deadline should have fired first; this is the
        # backstop. The op may still finish later: its result is dropped.
        self.busy = None
        err = pending.op.timeout_error()
        self._rollback(pending, err)
        self._failed(cmd, err)
        self.on_busy_change()
        self.pump()

    def ack(self, a: SendAck) -> None:
        """Send one ack (a SendAck from an op, the runner or a core) and cache it
        for republished commands."""
        ack = wire_ack(self.engine_id, a)
        if a.seq in self.acks:
            self.acks[a.seq] = ack
        self.acked_seq = max(self.acked_seq, a.seq)
        self.send_ack(ack)

    # ------------------------------------------------------------ internals

    def pump(self) -> None:
        """Start queued commands, in order, until one leaves an op running."""
        while self.busy is None and self.queue:
            self._start(self.queue.popleft())

    def _start(self, cmd: P.Command) -> None:
        try:
            result = self.handlers[type(cmd.op)](cmd.op, cmd.seq)
        except Exception as e:
            self._failed(cmd, e)
            return
        if isinstance(result, Deferred):
            return
        if isinstance(result, Pending):
            if result.op.future.done():
                self._complete(cmd, result)
                return
            self.busy = (cmd, result)
            self.on_busy_change()  # the heartbeat shows busy before the next beat
            self.log.info("op_started", op=self.busy_name, seq=cmd.seq, knob=result.op.knob)
            result.op.future.add_done_callback(self._wake)
            return
        self.ack(SendAck.done(cmd.seq, result))

    def _wake(self, _f: Any) -> None:
        # Any thread: only a byte into the pipe (a full pipe already wakes us).
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"!")

    def _complete(self, cmd: P.Command, pending: Pending) -> None:
        self.before_complete()
        try:
            result = pending.then(pending.op.future.result())
        except BaseException as e:
            self._rollback(pending, e)
            self._failed(cmd, e)
            return
        if isinstance(result, Pending):  # a continuation: the same op goes on (one_trip.py: commit after receive)
            if result.op.future.done():
                self._complete(cmd, result)
                return
            self.busy = (cmd, result)
            result.op.future.add_done_callback(self._wake)
            return
        self.ack(SendAck.done(cmd.seq, result))

    def _rollback(self, pending: Pending, e: BaseException) -> None:
        if pending.on_error is None:
            return
        try:
            pending.on_error(e)
        except Exception:
            self.log.exception("op_rollback_failed", op=pending.op.what)

    def _failed(self, cmd: P.Command, e: BaseException) -> None:
        op_name = P.OP_NAMES[type(cmd.op)]
        f = failure_of(e)
        if f.code == ErrorCode.INTERNAL.value:
            self.log.error("op_crashed", op=op_name, error=f.message, exc_info=e)
        else:
            self.log.warning("op_failed", op=op_name, error=f.message, code=f.code)
        self.ack(SendAck(cmd.seq, failure=f))
