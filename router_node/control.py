"""Control of the cluster, head side: fan-out of clients' control ops, joins of
new engines, cluster-wide pauses, and the typed acks that come back.

- fan-out: a client's `Control` is published on the control bus (bus/control_bus.py)
  to its targets; the acks are gathered under the op's deadline into one
  `ControlReply` {engine: typed result} / {engine: EngineFailure{code, message,
  field}} / [missing]. Silent (presumed dead) targets are reported missing at
  once, never waited on.
- joins: a registered engine is routable only after it acked a Ping (PUB/SUB
  connected) and every cluster-wide pause in force, one acked command at a time.
- weight updates: the head coordinates their two-phase commit
  (router_node/cluster_state.py). A client's FinishWeightUpdate is not relayed
  as is: the head prepares every target that has not voted yet, and commits
  only when all voted yes — recording the decision and the version before it
  publishes the commit — else it aborts the update everywhere and the reply
  names the engines that failed or went silent.
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
from router_node.cluster_state import ClusterWeights, WeightTxn
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

        if isinstance(msg.op, P.FinishWeightUpdate):
            txn = self.cluster.txns.get(msg.op.update_id)
            if txn is not None:
                self._commit(client, msg, txn)
                return
        self.cluster.on_control(msg.op, targets)

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

    # ------------------------------------------------------------ weight commits

    def _gone(self, targets: list[str]) -> list[str]:
        """Targets not worth waiting on: silent, or no longer registered."""
        return [t for t in targets if t not in self.engines or self.engines[t].state is EngineState.SILENT]

    def _commit(self, client: bytes, msg: P.Control, txn: WeightTxn) -> None:
        op = msg.op
        assert isinstance(op, P.FinishWeightUpdate)
        if txn.decision == "abort":
            raise BadRequest(
                f"weight update {txn.update_id} was aborted ({txn.reason}): it cannot commit",
                request_id=msg.request_id,
                field="update_id",
            )
        unvoted = [t for t in txn.targets if t not in txn.prepared]
        if txn.decision is None and unvoted:
            prep = P.PrepareWeights(txn.update_id, wait_s=msg.timeout_s)

            def prepared(pc: PendingCommand) -> None:
                self.cluster.on_votes(txn.update_id, {eid: a.result for eid, a in pc.acks.items() if a.ok})
                errors = {eid: failure_of(a) for eid, a in pc.acks.items() if not a.ok}
                if errors or pc.missing:
                    self._abort(txn, f"prepare failed on {sorted(errors)}, no vote from {pc.missing}")
                    self.reply(client, P.ControlReply(request_id=msg.request_id, errors=errors, missing=pc.missing))
                    return
                self._commit(client, msg, txn)

            self.bus.publish(prep, unvoted, msg.timeout_s, prepared, gone=self._gone(unvoted))
            return
        if txn.decision is None:
            versions = [e.weight_version for e in self.engines.values()]
            version = self.cluster.decide_commit(txn, op.version, versions)
            log.info("weight_update_committing", update_id=txn.update_id, version=version, targets=txn.targets)
        commit = P.FinishWeightUpdate(txn.update_id, version=txn.version)

        def committed(pc: PendingCommand) -> None:
            results = {eid: a.result or P.Done() for eid, a in pc.acks.items() if a.ok}
            self.cluster.commit_done(txn)
            self.reevaluate(time.monotonic())  # engines that missed the commit are stale now
            errors = {eid: failure_of(a) for eid, a in pc.acks.items() if not a.ok}
            if errors or pc.missing:
                log.warning("weight_commit_missed", update_id=txn.update_id, failed=sorted(errors), missing=pc.missing)
            self.reply(
                client, P.ControlReply(request_id=msg.request_id, results=results, errors=errors, missing=pc.missing)
            )

        self.bus.publish(commit, txn.targets, msg.timeout_s, committed, gone=self._gone(txn.targets))

    def _abort(self, txn: WeightTxn, reason: str) -> None:
        """Decide abort and tell every target (best effort: an engine that
        misses it discards the update after its prepare_ttl_s)."""
        self.cluster.decide_abort(txn, reason)
        log.warning("weight_update_aborted", update_id=txn.update_id, reason=reason)
        self.bus.publish(
            P.AbortWeightUpdate(txn.update_id),
            txn.targets,
            self.cfg.join_timeout_s,
            lambda pc: None,
            gone=self._gone(txn.targets),
        )

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
            if self.cluster.is_stale(e.weight_version):  # never routable before it is synced
                self.reevaluate(e.last_seen)
            log.info("engine_joined", engine_id=e.engine_id, paused=sorted(self.cluster_pauses), state=e.state.value)

        next_step(None)
