"""Control of the cluster, head side: fan-out of clients' control ops, joins of
new engines, cluster-wide pauses, and the typed acks that come back.

- fan-out: a client's `Control` is published on the control bus (bus/control_bus.py)
  to its targets; the acks are gathered under the op's deadline into one
  `ControlReply` {engine: typed result} / {engine: EngineFailure{code, message,
  field}} / [missing]. Silent (presumed dead) targets are reported missing at
  once, never waited on.
- joins: a registered engine is routable only after it acked a Ping (PUB/SUB
  connected) and the ops that bring it to its intended state (pauses, sleep),
  one acked command at a time.
- intended state (router_node/intended_state.py): every pause / resume /
  sleep / wake_up changes what the head intends when it is issued; acks and
  heartbeats say what engines are; an engine that differs with nothing in
  flight gets corrective ops (`correct`) under `converge_timeout_s`.
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

import msgspec
import structlog

from bus import protocol as P
from bus.control_bus import ControlBus, PendingCommand
from bus.endpoint import error_message
from bus.errors import BadRequest, StaleUpdate, Unauthorized
from bus.validate import check_control_timeout
from router_node.acks import landed, refused_by_all, tally, votes
from router_node.cluster_state import ClusterWeights, WeightTxn, check_holder
from router_node.config import RouterConfig
from router_node.intended_state import REFUSED, IntendedState
from router_node.intended_state import check as check_state_op
from router_node.one_trip import Layouts, is_one_trip, one_trip_targets
from router_node.registry import EngineEntry, EngineState

log = structlog.get_logger("router_node")


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
        incarnation: str = "",
    ) -> None:
        self.cfg = cfg
        self.bus = bus
        self.engines = engines  # the registry (owned by the router)
        self.reply = reply  # (client, message) over the frontend
        self.forget = forget  # drop an engine that never joined
        # The cluster weight version; engines below it are STALE (no traffic).
        # Update ids are bound to `incarnation` (the head's) and a counter: no replay.
        self.cluster = ClusterWeights(
            txn_timeout_s=cfg.weight_txn_timeout_s, adopt_window_s=cfg.adopt_window_s, incarnation=incarnation
        )
        self.reevaluate = reevaluate  # re-run every engine's health (the router's)
        # What every engine should be (paused scopes, sleep): an engine that
        # joins, restarts or missed an op is brought there before it serves.
        self.intended = IntendedState(converge_timeout_s=cfg.converge_timeout_s)
        # Which zero-copy layout each engine holds: may a one-trip update go out (one_trip.py)?
        self.layouts = Layouts()

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
        check_state_op(msg.op, msg.request_id)  # never intend what no engine would take
        before = self.intended.cluster.copy()

        if isinstance(msg.op, P.FinishWeightUpdate):
            txn = self.cluster.require(msg.op, msg.op.update_id)  # StaleUpdate: not the current update
            if txn is not None:
                self._finish(client, msg, txn)
                return
            # An id never seen, no update current: a head restarted mid-update; relayed.
        if is_one_trip(msg.op):
            self._one_trip(client, msg)
            return
        # One update at a time: UpdateInProgress / StaleUpdate raised here change nothing.
        now = time.monotonic()
        self.cluster.on_control(msg.op, targets, client=client, now=now, wall=time.time())
        op, timeout_s = self._bounded_op(msg, now)
        # The begin's sender secret (minted by cluster.begin): to the engines in
        # the op, and back to this client (the opener) alone in the reply.
        secret = (
            self.cluster.current.sender_secret if isinstance(op, P.BeginWeightUpdate) and self.cluster.current else ""
        )
        if secret:
            op = msgspec.structs.replace(op, sender_secret=secret)

        def done(pc: PendingCommand) -> None:
            self.intended.expired(pc.seq, pc.missing, time.monotonic())
            if msg.targets is None and refused_by_all(pc, REFUSED):
                self.intended.cluster_refused(msg.op, before)  # nobody took it: not the intent
            t = tally(pc)
            if self.cluster.on_control_done(msg.op, t.results):
                self.reevaluate(time.monotonic())  # stale / synced engines change state now
            rep = t.reply(msg.request_id)
            rep.sender_secret = secret
            self.reply(client, rep)

        # Silent (presumed dead) targets are reported missing, never waited on;
        # their intent changes all the same (they converge when they return).
        self.layouts.on_fan_out(msg.op, targets)
        pc = self.bus.publish(op, targets, timeout_s, done, gone=silent)
        self.intended.issued(msg.op, msg.targets, pc.seq, _waiting(pc))

    def _bounded_op(self, msg: P.Control, now: float) -> tuple[P.Op, float]:
        """The op as published and its deadline: an op of the current weight
        update waits no longer than the head's weight_txn_timeout_s leaves
        (a client's timeout_s shortens, never lengthens, the hold), and an
        engine's prepare wait fits inside that."""
        op, cur = msg.op, self.cluster.current
        if not isinstance(op, (P.BeginWeightUpdate, P.ReceiveWeights, P.PrepareWeights)):
            return op, msg.timeout_s
        if cur is None or cur.update_id != op.update_id:
            return op, msg.timeout_s
        timeout_s = self.cluster.bounded(cur, msg.timeout_s, now)
        if isinstance(op, P.PrepareWeights):
            op = msgspec.structs.replace(op, wait_s=min(op.wait_s, 0.75 * timeout_s))
        return op, timeout_s

    def correct(self, e: EngineEntry, op: Any) -> None:
        """Send one corrective op to an engine that differs from its intended
        state (the router's health tick asks); its ack or deadline re-checks."""
        log.info("engine_converging", engine_id=e.engine_id, op=P.OP_NAMES[type(op)], reason=e.reason)
        timeout_s = self.cfg.converge_timeout_s

        def done(pc: PendingCommand) -> None:
            self.intended.expired(pc.seq, pc.missing, time.monotonic())

        self.layouts.on_fan_out(op, [e.engine_id])
        pc = self.bus.publish(op, [e.engine_id], timeout_s, done)
        self.intended.issued(op, [e.engine_id], pc.seq, _waiting(pc), corrective=True)

    def release(self, op: Any) -> None:
        """A vanished client's hold ends (router_node/leases.py): `op` (Resume,
        WakeUp) goes cluster-wide as if a client had sent it, with no reply."""
        targets = [eid for eid, e in self.engines.items() if e.state is not EngineState.JOINING]
        silent = [t for t in targets if self.engines[t].state is EngineState.SILENT]

        def done(pc: PendingCommand) -> None:
            self.intended.expired(pc.seq, pc.missing, time.monotonic())

        self.layouts.on_fan_out(op, targets)
        pc = self.bus.publish(op, targets, self.cfg.converge_timeout_s, done, gone=silent)
        self.intended.issued(op, None, pc.seq, _waiting(pc))

    def abort_update(self, update_id: str, reason: str) -> bool:
        """Abort an undecided weight update (its holder's lease expired)."""
        txn = self.cluster.txns.get(update_id)
        if txn is None or txn.decision is not None:
            return False
        self._abort(txn, reason)
        return True

    # ------------------------------------------------------------ weight commits

    def _gone(self, targets: list[str]) -> list[str]:
        """Targets not worth waiting on: silent, or no longer registered."""
        return [t for t in targets if t not in self.engines or self.engines[t].state is EngineState.SILENT]

    def _finish(self, client: bytes, msg: P.Control, txn: WeightTxn) -> None:
        """The holder's FinishWeightUpdate: check its version, then prepare
        what has not voted and commit (one finish per update)."""
        op = msg.op
        assert isinstance(op, P.FinishWeightUpdate)
        try:
            check_holder(txn, client, op.sender_secret, "finish_weights")
        except Unauthorized as e:
            e.request_id = msg.request_id
            raise
        if txn.finishing or txn.decision is not None:
            raise BadRequest(
                f"weight update {txn.update_id!r} is already being committed",
                request_id=msg.request_id,
                field="update_id",
            )
        targets = [self.engines[t].weight_version for t in txn.targets if t in self.engines]
        try:
            self.cluster.check_version(txn, op.version, targets)
        except BadRequest as e:
            self._abort(txn, e.message)  # the trainer learns why; the cluster is free again
            e.request_id = msg.request_id
            raise
        txn.finishing = True
        self._commit(client, msg, txn)

    def _commit(self, client: bytes, msg: P.Control, txn: WeightTxn) -> None:
        op = msg.op
        assert isinstance(op, P.FinishWeightUpdate)
        if txn.decision == "abort":  # ended while its prepare ran (an abort, its lease, the timeout)
            err = StaleUpdate(f"weight update {txn.update_id!r} was aborted ({txn.reason}): it cannot commit")
            self.reply(client, error_message(msg.request_id, err.code, err.message, "update_id"))
            return
        unvoted = [t for t in txn.targets if t not in txn.prepared]
        # Every phase within the head's weight_txn_timeout_s, whatever the client asked.
        timeout_s = self.cluster.bounded(txn, msg.timeout_s, time.monotonic())
        if txn.decision is None and unvoted:
            # The engines' own wait ends well inside the command's deadline, so a
            # sender that never finished is named by the engines' error rather
            # than lost in a bare "no ack within timeout_s" race.
            prep = P.PrepareWeights(txn.update_id, wait_s=max(0.1, 0.75 * timeout_s))

            def prepared(pc: PendingCommand) -> None:
                self.cluster.on_votes(txn.update_id, votes(pc))
                errors = tally(pc).errors
                if errors or pc.missing:
                    self._abort(txn, f"prepare failed on {sorted(errors)}, no vote from {pc.missing}")
                    self.reply(client, P.ControlReply(request_id=msg.request_id, errors=errors, missing=pc.missing))
                    return
                self._commit(client, msg, txn)

            self.bus.publish(prep, unvoted, timeout_s, prepared, gone=self._gone(unvoted))
            return
        if txn.decision is None:
            versions = [e.weight_version for e in self.engines.values()]
            version = self.cluster.decide_commit(txn, op.version, versions)
            timeout_s = self.cluster.bounded(txn, msg.timeout_s, time.monotonic())  # the commit round's own bound
            log.info("weight_update_committing", update_id=txn.update_id, version=version, targets=txn.targets)
        commit = P.FinishWeightUpdate(txn.update_id, version=txn.version)

        def committed(pc: PendingCommand) -> None:
            t = tally(pc)
            errors, on = t.errors, landed(t.results)
            # The version moves only if an engine is on it; one that failed or
            # missed the commit is below it then: stale, no traffic.
            self.cluster.commit_done(txn, on, missing=bool(pc.missing))
            self.reevaluate(time.monotonic())
            if not on:
                log.warning(
                    "weight_commit_failed",
                    update_id=txn.update_id,
                    failed=sorted(errors),
                    missing=pc.missing,
                    cluster_version=self.cluster.version,
                )
            elif errors or pc.missing:
                log.warning("weight_commit_missed", update_id=txn.update_id, failed=sorted(errors), missing=pc.missing)
            self.reply(client, t.reply(msg.request_id))

        self.bus.publish(commit, txn.targets, timeout_s, committed, gone=self._gone(txn.targets))

    def _one_trip(self, client: bytes, msg: P.Control) -> None:
        """A one-trip update (router_node/one_trip.py): allowed only when every
        target holds its layout; the version is decided here, BEFORE the one
        op goes out, and that op commits on every engine that takes it."""
        op = msg.op
        assert isinstance(op, P.BeginWeightUpdate)
        states = {eid: e.state for eid, e in self.engines.items()}
        targets = one_trip_targets(op, msg.targets, states, self.layouts.held)  # refused: nothing changed
        txn = self.cluster.begin(op, targets, client=client, now=time.monotonic(), wall=time.time())
        try:
            self.cluster.check_version(txn, op.version, [self.engines[t].weight_version for t in targets])
        except BadRequest as e:
            self.cluster.decide_abort(txn, e.message)  # nothing was published: no engine to tell
            e.request_id = msg.request_id
            raise
        txn.finishing = True
        version = self.cluster.decide_commit(txn, op.version, [e.weight_version for e in self.engines.values()])
        log.info("weight_update_committing", update_id=txn.update_id, version=version, targets=targets, one_trip=True)

        def committed(pc: PendingCommand) -> None:
            t = tally(pc)
            on = landed(t.results)
            self.layouts.forget([*t.errors, *pc.missing])  # refused or silent: the layout is not known held
            # No engine committed and none is missing: every one refused before
            # writing, so the update ended as an abort; else as a commit round.
            self.cluster.commit_done(txn, on, missing=bool(pc.missing))
            self.reevaluate(time.monotonic())
            if t.errors or pc.missing:
                log.warning(
                    "weight_one_trip_failed" if not on else "weight_commit_missed",
                    update_id=txn.update_id,
                    failed=sorted(t.errors),
                    missing=pc.missing,
                )
            self.reply(client, t.reply(msg.request_id))

        out = msgspec.structs.replace(op, version=version, sender_secret="")  # engines need no copy of it
        timeout_s = self.cluster.bounded(txn, msg.timeout_s, time.monotonic())
        self.bus.publish(out, targets, timeout_s, committed, gone=self._gone(targets))

    def _abort(self, txn: WeightTxn, reason: str) -> None:
        """Decide abort and tell every target (best effort: an engine that
        misses it discards the update after its prepare_ttl_s)."""
        if txn.decision is not None:
            return  # already decided (an abort raced its prepare's failure)
        self.cluster.decide_abort(txn, reason)
        log.warning("weight_update_aborted", update_id=txn.update_id, reason=reason)
        self.bus.publish(
            P.AbortWeightUpdate(txn.update_id),
            txn.targets,
            self.cfg.join_timeout_s,
            lambda pc: None,
            gone=self._gone(txn.targets),
        )

    def tick(self, now: float) -> None:
        """The router's tick: an update undecided past weight_txn_timeout_s is
        aborted (its prepare may be running: the engines drop what they staged)."""
        txn = self.cluster.expired(now)
        if txn is not None:
            phase = "its commit's prepare did not complete" if txn.finishing else "without a commit or abort"
            self._abort(
                txn,
                f"undecided for more than weight_txn_timeout_s={self.cluster.txn_timeout_s} "
                f"({phase}) from client {txn.holder_name}",
            )

    def abort_held_by(self, client: bytes, reason: str) -> list[str]:
        """Abort the weight update that `client` (its frontend identity) holds,
        if it is not committing yet; the engines drop what they staged and the
        cluster takes the next update. The hook of client leases: call it when
        a client's lease expires. Returns the update ids aborted ([] if none)."""
        txn = self.cluster.held_by(client)
        if txn is None:
            return []
        self._abort(txn, reason)
        return [txn.update_id]

    def on_ack(self, _peer: bytes, ack: P.Ack, _b: list[Any]) -> None:
        e = self.engines.get(ack.engine_id)
        if e is not None and ack.ok and isinstance(ack.result, P.ConfigResult):
            r = ack.result
            e.apply_config(r.epoch, r.weight_version, r.loras)
            if isinstance(r, P.WeightsCommitted):
                self.layouts.committed(ack.engine_id, r.layout)
            if isinstance(r, P.WeightsCommitted) and self.cluster.late_commit(r.weight_version):
                log.info("weight_commit_late", engine_id=ack.engine_id, version=r.weight_version)
                self.reevaluate(time.monotonic())
        if e is not None:  # before the bus: its done-callback may re-evaluate health
            self.intended.acked(
                ack.engine_id,
                ack.seq,
                ok=ack.ok,
                result=ack.result,
                code=ack.failure.code if ack.failure is not None else None,
                error=ack.failure.message if ack.failure is not None else "",
                now=time.monotonic(),
            )
        self.bus.on_ack(ack)

    # ------------------------------------------------------------ joins

    def join(self, e: EngineEntry) -> None:
        """Ack a ping (so PUB/SUB is connected), then apply its intended state
        (the pauses in force, sleep), one acked command at a time; then the
        health tick routes it once a heartbeat confirms that state
        (intended_state.py). An engine that misses a step's join_timeout_s is
        forgotten (it registers again)."""
        self.intended.add(e.engine_id)
        self.layouts.forget([e.engine_id])  # a (re)joined engine keeps no IPC map of ours
        steps: list[Any] = [P.Ping()]

        def next_step(pc: PendingCommand | None) -> None:
            if self.engines.get(e.engine_id) is not e:
                return
            if pc is not None and e.engine_id not in pc.acks:
                log.warning("engine_never_joined", engine_id=e.engine_id, join_timeout_s=self.cfg.join_timeout_s)
                self.forget(e)
                return
            if pc is not None:
                self.intended.expired(pc.seq, pc.missing, time.monotonic())
            if pc is not None and isinstance(pc.op, P.Ping):
                steps.extend(self.intended.join_ops(e.engine_id))  # the intent now, not at register
            if steps:
                op = steps.pop(0)
                nxt = self.bus.publish(op, [e.engine_id], self.cfg.join_timeout_s, next_step)
                self.intended.issued(op, [e.engine_id], nxt.seq, _waiting(nxt), corrective=True)
                return
            e.state = EngineState.HEALTHY
            e.reason = "ok"
            e.last_seen = e.steps_changed_at = time.monotonic()
            # A fresh head adopts the highest version engines bring, but only
            # from one that joined: a Register alone (a peer that never acks)
            # must not make every real engine stale.
            if self.cluster.on_register(e.weight_version, e.last_seen):
                log.info("cluster_version_adopted", engine_id=e.engine_id, version=self.cluster.version)
            self.reevaluate(e.last_seen)  # stale / not yet confirmed: never routable before
            log.info(
                "engine_joined",
                engine_id=e.engine_id,
                intended=self.intended.cluster.describe(),
                state=e.state.value,
            )

        next_step(None)


def _waiting(pc: PendingCommand) -> set[str]:
    """Targets an ack is still expected from (none when it completed at once)."""
    return set() if pc.done else pc.targets - pc.gone - set(pc.acks)
