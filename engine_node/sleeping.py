"""sleep / wake_up of an engine node, by tags: the ops that put the engine's
memory (SLEEP_TAGS: "weights", "kv_cache") to sleep and wake it, over the
submission gate (engine_node/gates.py) and the request flow
(engine_node/request_flow.py). No I/O.

Hazards this module owns:
- sleep() parks every running sample and closes SLEEP_SCOPE at once; every tag
  sleeps once the backend's op is done (a sleep of a half-awake engine too);
- wake_up(tags) wakes some tags, in any order and split; a tag already awake
  is a no-op; SLEEP_SCOPE opens only once none sleeps, and also after a failed
  sleep left the gate closed with nothing asleep (any wake_up opens it);
- a level-2 sleep discards the weights: when the engine serves again without
  an update having written them, the checkpoint's weights are back, so the
  weight version moves (and the staleness bound applies).
engine_node/weight_update.py refuses model updates while "weights" sleeps.

Ownership: the node's loop thread, through RequestCore (engine_node/core.py).
"""

from __future__ import annotations

from typing import Any

from bus import protocol as P
from bus.errors import BadRequest
from engine_node.actions import OpOutcome, Pending
from engine_node.gates import SLEEP_SCOPE, SLEEP_TAGS, wake_tags
from engine_node.pausing import Pausing
from engine_node.request_flow import RequestFlow


class Sleeping:
    def __init__(self, flow: RequestFlow, pausing: Pausing) -> None:
        self.flow = flow
        self.pausing = pausing  # releases the gate (and answers moot wait-mode pauses)

    def sleep(self, op: P.Sleep, seq: int) -> OpOutcome:
        if op.level not in (1, 2):
            raise BadRequest(f"sleep level must be 1 or 2, got {op.level}", field="level")
        flow = self.flow
        gate = flow.gate
        gate.pauses[SLEEP_SCOPE] = "abort"
        gate.sleeps += 1  # even a sleep that fails may have dropped the kept IPC maps
        parked = flow.park(flow.scoped(None))
        t0 = flow.now

        def then(res: dict[str, Any]) -> P.SleepResult:
            gate.sleep_level = op.level
            gate.asleep = set(SLEEP_TAGS)
            gate.weights_discarded = res.get("weights") == "discarded"
            return P.SleepResult(level=op.level, parked=parked, seconds=round(flow.now - t0, 4), detail=dict(res))

        return Pending(flow.backend.sleep(op.level), then)

    def wake_up(self, op: P.WakeUp, seq: int) -> OpOutcome:
        wanted = wake_tags(op.tags)
        t0 = self.flow.now

        def then(res: dict[str, Any]) -> P.WakeUpResult:
            return self._woken(wanted, res, t0)

        return Pending(self.flow.backend.wake_up(None if op.tags is None else sorted(wanted)), then)

    def _woken(self, wanted: frozenset[str], res: dict[str, Any], t0: float) -> P.WakeUpResult:
        flow = self.flow
        gate = flow.gate
        reloaded = False
        gate.asleep -= wanted
        if gate.weights_discarded and not gate.asleep:
            # Level 2 dropped the weights and no update wrote them before the
            # engine serves again: the checkpoint's are back, a weight state
            # different from any pushed version, so tokens from now on carry
            # a new version. Not at wake_up(['weights']) itself: SkyRL's
            # order pushes the new weights before waking the KV cache, and
            # that update's version is the one to serve (a bump here would
            # put the engine above a trainer that numbers its versions).
            gate.weights_discarded = False
            flow.weight_version += 1
            flow.config_epoch += 1
            reloaded = True
            res = {**res, "restarted": flow.enforce_staleness()}
        resumed = 0
        if not gate.asleep:
            gate.sleep_level = 0
            gate.pauses.pop(SLEEP_SCOPE, None)
            # thaw cannot be needed here: sleep parked everything
            _op, resumed = self.pausing.release()
        return P.WakeUpResult(
            weight_version=flow.weight_version,
            loras=flow.backend.loras(),
            epoch=flow.config_epoch,
            resumed=resumed,
            seconds=round(flow.now - t0, 4),
            weights_reloaded_from_checkpoint=reloaded,
            detail={**res, "woken": sorted(wanted), "asleep": sorted(gate.asleep)},
        )
