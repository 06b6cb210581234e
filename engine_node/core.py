"""The request core of an engine node: the request lifecycle without I/O.

No sockets, no threads, no clock reads. The shell (engine_node/node.py) feeds
it events and executes the typed actions it produces (engine_node/actions.py):

events in                                   actions out (take_actions, in order)
  generate(client, msg, prompt)               SendChunks(peer, Chunk|ChunkBatch, buffers)
  cancel(client, request_id)                    — chunks coalesced per peer per turn
  on_step(outputs[, now, wall]) / step_failed SendError(peer, Error)
  peer_gone(peer)                               — the turn's chunks are flushed first
  set_time(now, wall) / tick(now, wall)       SendAck(seq, result | failure): late acks
  control ops: pause / resume / is_paused /   control results (OpOutcome): P.*Result |
    sleep / wake_up / reset_prefix_cache        Pending(BackendOp, then) | DEFERRED
  weights_changed() / config_changed()        backend data-path calls (add, abort,
                                                num_running) on the injected port,
                                                synchronous and short by protocol

Where each part lives (one concept per file):
  engine_node/request_flow.py  per-request state machine: admission, submit,
                               step outputs, park / re-submit, staleness,
                               deadlines, exactly-one-final
  engine_node/chunks.py        what a sample's chunk carries
  engine_node/gates.py         the submission gate's state (pause scopes, sleep tags)
  engine_node/pausing.py       pause (abort | keep | wait) / resume / is_paused
  engine_node/sleeping.py      sleep / wake_up by tags
  engine_node/actions.py       the typed actions and control outcomes
This module puts them together as the `RequestCore` the node drives; the
node's control table names its op methods.

Ownership: one thread (the node's loop) calls everything here.
"""

from __future__ import annotations

from typing import Any

from bus import protocol as P
from engine_node.actions import DEFERRED, OpOutcome, Pending
from engine_node.backend import BackendInfo
from engine_node.gates import ALL, SLEEP_SCOPE, SLEEP_TAGS, wake_tags
from engine_node.pausing import Pausing
from engine_node.request_flow import Refused, RequestFlow
from engine_node.sleeping import Sleeping

__all__ = [
    "ALL",
    "DEFERRED",
    "SLEEP_SCOPE",
    "SLEEP_TAGS",
    "Pending",
    "Refused",
    "RequestCore",
    "wake_tags",
]


class RequestCore(RequestFlow):
    def __init__(self, backend: Any, info: BackendInfo, engine_id: str, sample_seed: int = 0) -> None:
        super().__init__(backend, info, engine_id, sample_seed)
        self.pausing = Pausing(self)
        self.sleeping = Sleeping(self, self.pausing)

    def tick(self, now: float, wall: float) -> None:
        """Clock event: request deadlines and wait-mode pause deadlines."""
        self.set_time(now, wall)
        self._check_deadlines(now)
        self.pausing.check_waits(now)

    def weights_asleep(self) -> bool:
        return self.gate.weights_asleep()

    # -- control ops (the node's control table; engine_node/control.py runs them)

    def pause(self, op: P.Pause, seq: int) -> OpOutcome:
        return self.pausing.pause(op, seq)

    def resume(self, op: P.Resume, seq: int) -> OpOutcome:
        return self.pausing.resume(op, seq)

    def is_paused(self, op: P.IsPaused, seq: int = 0) -> P.IsPausedResult:
        return self.pausing.is_paused(op, seq)

    def sleep(self, op: P.Sleep, seq: int) -> OpOutcome:
        """Every tag goes to sleep: the gate closes at once and stays closed
        until wake_up(s) woke every tag (engine_node/sleeping.py)."""
        return self.sleeping.sleep(op, seq)

    def wake_up(self, op: P.WakeUp, seq: int) -> OpOutcome:
        """Wake the named tags (None: all), in any order and split; the engine
        serves again once no tag is asleep."""
        return self.sleeping.wake_up(op, seq)

    def reset_prefix_cache(self, op: P.ResetPrefixCache, seq: int) -> OpOutcome:
        return Pending(self.backend.reset_prefix_cache(), lambda r: P.ResetPrefixCacheResult(detail=dict(r)))
