"""The head's view of the cluster's weights: which version is current, and
which engines are below it (stale).

The cluster weight version is the version of the last model update that
committed: the highest `weight_version` in the ok acks of a FinishWeightUpdate
whose update targeted the model (its BeginWeightUpdate said target="model").
Until the head has seen one (a fresh head, or a head restarted under running
engines) it adopts the highest version an engine registered with, so a head
restart does not forget where the cluster was.

An engine whose weight version is below it — restarted from its checkpoint,
joined late, or missed an update's finish — is STALE (router_node/registry.py):
no traffic, not counted healthy or ready, still a control target, so the next
`update_weights` (which carries the version to take) or `Client.sync_stale`
brings it up to date.

Ownership: the router loop thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bus import protocol as P

_MAX_TRACKED_UPDATES = 64


class ClusterWeights:
    def __init__(self) -> None:
        self.version = 0
        self.source = "none"  # "none" | "registration" | "update"
        self.updates_committed = 0
        self._targets: dict[str, str] = {}  # update id -> "model" | "lora:NAME" (begun, not finished)

    def on_register(self, weight_version: int) -> None:
        if self.source != "update" and weight_version > self.version:
            self.version = int(weight_version)
            self.source = "registration"

    def on_control(self, op: Any) -> None:
        """A control op the head fans out (before publishing it)."""
        if isinstance(op, P.BeginWeightUpdate):
            self._targets[op.update_id] = op.target
            while len(self._targets) > _MAX_TRACKED_UPDATES:
                self._targets.pop(next(iter(self._targets)))

    def on_control_done(self, op: Any, results: Mapping[str, Any]) -> bool:
        """Acks of a fanned-out op are in. True when the cluster version moved."""
        if not isinstance(op, P.FinishWeightUpdate):
            return False
        target = self._targets.pop(op.update_id, "model")
        if target != "model":
            return False
        versions = []
        for r in results.values():
            # typed results (P.ConfigResult) carry it; anything else is not a commit
            if isinstance(r, P.ConfigResult):
                versions.append(int(r.weight_version))
        if not versions:
            return False
        self.updates_committed += 1
        self.source = "update"
        new = max(versions)
        moved = new != self.version
        self.version = new
        return moved

    def is_stale(self, weight_version: int) -> bool:
        return weight_version < self.version

    def describe(self) -> dict[str, Any]:
        return {"weight_version": self.version, "source": self.source, "updates_committed": self.updates_committed}
