"""The head's view of the cluster's weights: which version is current, which
engines are below it (stale), and the weight-update transactions in flight —
the head is the coordinator of their two-phase commit.

Transaction (one per update id, created when the head fans its begin out):

    begun ──every target voted (WeightsPrepared / ReceiveWeights ok)──► decision "commit"
      └──any target failed, silent or missing in the prepare, or an abort──► decision "abort"

The decision is the head's and is recorded BEFORE the commit is published,
with the version the engines take. An engine that misses the commit (killed,
frozen) stays below the cluster version once the commit round is over, so it
is STALE (router_node/registry.py: no traffic), never silently behind; if it
wakes and still commits, it lands on exactly the cluster version. A commit is
never published for an update that was aborted, so an engine can only ever
serve a version the head decided; a prepared engine that hears no decision
discards the update by itself (engine_node/weight_update.py, prepare_ttl_s).

The cluster weight version is the version of the last model update that
committed. Until the head has seen one (a fresh head, or a head restarted under
running engines) it adopts the version of the first engine that joins, so a
head restart does not forget where the cluster was; a later engine above it
is STALE (router_node/registry.py), never followed. A FinishWeightUpdate for an
update the head never saw begin (a head restarted mid-update) is relayed as is,
and the version follows its ok acks.

Ownership: the router loop thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from bus import protocol as P

_MAX_TRACKED_UPDATES = 64

# Results that are a yes vote of phase one.
_VOTES = (P.WeightsPrepared, P.ReceiveWeightsResult)


@dataclasses.dataclass(eq=False)
class WeightTxn:
    update_id: str
    target: str  # "model" | "lora:NAME"
    targets: list[str]
    transport: str = "zmq"
    senders: int = 1
    prepared: set[str] = dataclasses.field(default_factory=set)
    decision: str | None = None  # None | "commit" | "abort"
    reason: str = ""
    version: int | None = None  # decided version (model updates)

    def describe(self) -> dict[str, Any]:
        return {
            "update_id": self.update_id,
            "target": self.target,
            "targets": list(self.targets),
            "transport": self.transport,
            "senders": self.senders,
            "prepared": sorted(self.prepared),
            "decision": self.decision,
            "version": self.version,
        }


class ClusterWeights:
    def __init__(self) -> None:
        self.version = 0
        self.source = "none"  # "none" | "registration" | "update"
        self.updates_committed = 0
        self.txns: dict[str, WeightTxn] = {}  # begun updates (bounded, oldest dropped)

    def on_register(self, weight_version: int) -> None:
        """An engine joined. Only the FIRST joiner of a head that has committed
        nothing sets the version (a restarted head learns where the cluster
        was); after that only the head's commits move it, so a later engine
        registering with more (weight_version=10**6) cannot drag the cluster
        along: the registry marks it STALE (ahead) instead."""
        if self.source == "none":
            self.version = int(weight_version)
            self.source = "registration"

    # ------------------------------------------------------------ fan-out hooks

    def on_control(self, op: Any, targets: list[str] | None = None) -> None:
        """A control op the head fans out (before publishing it)."""
        if isinstance(op, P.BeginWeightUpdate):
            self.txns[op.update_id] = WeightTxn(
                op.update_id, op.target, list(targets or []), transport=op.transport, senders=op.senders
            )
            while len(self.txns) > _MAX_TRACKED_UPDATES:
                self.txns.pop(next(iter(self.txns)))
        elif isinstance(op, P.AbortWeightUpdate):
            txn = self.txns.get(op.update_id)
            if txn is not None and txn.decision is None:
                self.decide_abort(txn, "aborted by the trainer")

    def on_control_done(self, op: Any, results: Mapping[str, Any]) -> bool:
        """Acks of a fanned-out op are in. True when the cluster version moved."""
        if isinstance(op, (P.BeginWeightUpdate, P.ReceiveWeights, P.PrepareWeights)):
            self.on_votes(op.update_id, results)
            return False
        if not isinstance(op, P.FinishWeightUpdate):
            return False
        # A finish the head did not coordinate (it never saw the begin).
        versions = [int(r.weight_version) for r in results.values() if isinstance(r, P.ConfigResult)]
        txn = self.txns.pop(op.update_id, None)
        if (txn is not None and txn.target != "model") or not versions:
            return False
        return self._moved_to(max(versions))

    def on_votes(self, update_id: str, results: Mapping[str, Any]) -> None:
        txn = self.txns.get(update_id)
        if txn is None:
            return
        # A ReceiveWeights ack is a vote only for a one-sender update; with
        # several senders it acks one sender's PART (the prepare collects votes).
        votes = _VOTES if txn.senders == 1 else (P.WeightsPrepared,)
        txn.prepared.update(eid for eid, r in results.items() if isinstance(r, votes))

    # ------------------------------------------------------------ decisions

    def decide_abort(self, txn: WeightTxn, reason: str) -> None:
        if txn.decision is None:
            txn.decision, txn.reason = "abort", reason

    def decide_commit(self, txn: WeightTxn, version: int | None, engine_versions: list[int]) -> int | None:
        """Record the commit and the version it gives (model updates: the
        trainer's, else one above everything the cluster has served)."""
        assert txn.decision is None, txn.decision
        if txn.target == "model":
            if version is None:
                version = 1 + max([self.version, *engine_versions])
            txn.version = int(version)
        txn.decision = "commit"
        return txn.version

    def commit_done(self, txn: WeightTxn) -> bool:
        """The commit round is over (acked or past its deadline): the decided
        version is the cluster's now, whoever missed it. True when it moved."""
        self.txns.pop(txn.update_id, None)
        if txn.target != "model" or txn.version is None:
            return False
        return self._moved_to(txn.version)

    def _moved_to(self, version: int) -> bool:
        self.updates_committed += 1
        self.source = "update"
        moved = version != self.version
        self.version = version
        return moved

    # ------------------------------------------------------------ queries

    def is_stale(self, weight_version: int) -> bool:
        return weight_version < self.version

    def decisions(self) -> dict[str, Any]:
        """Every tracked update's decision (None: open; "commit": its commit round
        is still running; "abort"). A committed update leaves the table when its
        commit round is over: cuda_ipc senders free their buckets then."""
        return {"decisions": {uid: t.decision for uid, t in self.txns.items()}}

    def open_updates(self) -> dict[str, Any]:
        return {"updates": {uid: t.describe() for uid, t in self.txns.items() if t.decision is None}}

    def describe(self) -> dict[str, Any]:
        return {"weight_version": self.version, "source": self.source, "updates_committed": self.updates_committed}
