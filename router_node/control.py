"""Control of the cluster, head side: fan-out of clients' control ops, joins of
new engines, cluster-wide pauses, and the typed acks that come back.

- fan-out: a client's `Control` is published on the control bus (bus/control_bus.py)
  to its targets; the acks are gathered under the op's deadline into one
  `ControlReply` {engine: typed result} / {engine: EngineFailure{code, message,
  field}} / [missing]. Silent (presumed dead) targets are reported missing at
  once, never waited on.
- joins: a registered engine is routable only after it acked a Ping (PUB/SUB
  connected) and every cluster-wide pause in force, one acked command at a time.
- acks that report the engine's configuration (`P.ConfigResult`: weight
  version, LoRA set, epoch) update the registry; the newer epoch wins over a
  heartbeat that raced it.

Ownership: the router loop thread (it owns the control bus and the PUB socket).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

from bus import protocol as P
from bus.control_bus import ControlBus, PendingCommand
from bus.errors import BadRequest, ErrorCode
from bus.validate import check_control_timeout
from router_node.cluster_state import ClusterWeights
from router_node.config import RouterConfig
from router_node.registry import EngineEntry, EngineState

log = structlog.get_logger("router_node")


def failure_of(ack: P.Ack) -> P.EngineFailure:
    return P.EngineFailure(code=ack.code or ErrorCode.INTERNAL.value, message=ack.error or "failed", field=ack.field)


class ClusterControl:
    def __init__(
        self,
        cfg: RouterConfig,
        bus: ControlBus,
        engines: dict[str, EngineEntry],
        *,
        reply: Callable[[bytes, Any], None],
        forget: Callable[[EngineEntry], None],
        reevaluate: Callable[[float], None] = lambda now: None,
    ) -> None:
        self.cfg = cfg
        self.bus = bus
        self.engines = engines  # the registry (owned by the router)
        self.reply = reply  # (client, message) over the frontend
        self.forget = forget  # drop an engine that never joined
        # The cluster weight version; engines below it are STALE (no traffic).
        self.cluster = ClusterWeights()
        self.reevaluate = reevaluate  # re-run every engine's health (the router's)
        # Cluster-wide pauses in force (scope -> Pause op): an engine that joins
        # or restarts meanwhile is paused the same way before it gets traffic.
        self.cluster_pauses: dict[str, P.Pause] = {}

    # ------------------------------------------------------------ fan-out

    def on_control(self, client: bytes, msg: P.Control, _: list[Any]) -> None:
        check_control_timeout(msg)
        if msg.targets is None:
            targets = [eid for eid, e in self.engines.items() if e.state is not EngineState.JOINING]
        else:
            unknown = [t for t in msg.targets if t not in self.engines]
            if unknown:
                raise BadRequest(f"unknown engine(s) {unknown}", request_id=msg.request_id, field="targets")
            targets = list(msg.targets)
        silent = [t for t in targets if self.engines[t].state is EngineState.SILENT]
        if msg.targets is None:
            self._track_cluster_pause(msg.op)

        self.cluster.on_control(msg.op)

        def done(pc: PendingCommand) -> None:
            results = {eid: a.result or P.Done() for eid, a in pc.acks.items() if a.ok}
            if self.cluster.on_control_done(msg.op, results):
                self.reevaluate(time.monotonic())  # stale / synced engines change state now
            errors = {eid: failure_of(a) for eid, a in pc.acks.items() if not a.ok}
            self.reply(
                client, P.ControlReply(request_id=msg.request_id, results=results, errors=errors, missing=pc.missing)
            )

        # Silent (presumed dead) targets are reported missing, never waited on.
        self.bus.publish(msg.op, targets, msg.timeout_s, done, gone=silent)

    def _track_cluster_pause(self, op: Any) -> None:
        if isinstance(op, P.Pause):
            self.cluster_pauses[op.lora or "*"] = op
        elif isinstance(op, P.Resume):
            if op.lora is None:
                self.cluster_pauses.clear()
            else:
                self.cluster_pauses.pop(op.lora, None)

    def on_ack(self, _peer: bytes, ack: P.Ack, _b: list[Any]) -> None:
        e = self.engines.get(ack.engine_id)
        if e is not None and ack.ok and isinstance(ack.result, P.ConfigResult):
            r = ack.result
            e.apply_config(r.epoch, r.weight_version, r.loras)
        self.bus.on_ack(ack)

    # ------------------------------------------------------------ joins

    def join(self, e: EngineEntry) -> None:
        """Ack a ping (so PUB/SUB is connected), then apply every cluster-wide
        pause in force, one acked command at a time; only then is the engine
        healthy and routable. An engine that misses a step's join_timeout_s is
        forgotten (it registers again)."""
        steps: list[Any] = [P.Ping(), *self.cluster_pauses.values()]

        def next_step(pc: PendingCommand | None) -> None:
            if self.engines.get(e.engine_id) is not e:
                return
            if pc is not None and e.engine_id not in pc.acks:
                log.warning("engine_never_joined", engine_id=e.engine_id, join_timeout_s=self.cfg.join_timeout_s)
                self.forget(e)
                return
            if steps:
                self.bus.publish(steps.pop(0), [e.engine_id], self.cfg.join_timeout_s, next_step)
                return
            e.state = EngineState.HEALTHY
            e.reason = "ok"
            e.last_seen = e.steps_changed_at = time.monotonic()
            # A fresh head adopts the version engines bring, but only from one
            # that joined: a Register alone (a peer that never acks) must not
            # make every real engine stale.
            before = self.cluster.version
            self.cluster.on_register(e.weight_version)
            if self.cluster.version != before or self.cluster.is_stale(e.weight_version):
                self.reevaluate(e.last_seen)  # never routable before it is synced
            log.info("engine_joined", engine_id=e.engine_id, paused=sorted(self.cluster_pauses), state=e.state.value)

        next_step(None)
