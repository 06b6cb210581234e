"""Client leases on what a client holds in the cluster — no I/O.

A pause (per scope: "*" or a LoRA name), a sleep and a weight-update
transaction belong to the client that asked for them, for as long as that
client is heard from (its `ClientPing`s, every ~0.5 s from trainer_bridge, or
any control message). A client not heard from for `lease_s` has expired: what
it held is released — the head resumes the scopes it paused, wakes the cluster
it put to sleep and aborts its open weight update — unless another live client
holds the same thing.

Several holders of one resource (two trainers that both paused "*"): the
resource is reference-counted per holder. The cluster stays paused while any
live holder holds it; an expired holder only drops its own hold, and so does
a holder's own `resume()` (issue 34: trainer B's pause + resume inside trainer
A's `paused()` block releases B's hold only; the engines stay paused for A).
Only an explicit forced release — `resume(force=True)`, a full `wake_up()`,
the transaction's commit or abort — releases it for every holder at once.

Events in (`seen`, `acquired`, `released`, `tick`), actions out (`Expired`);
router_node/router.py is the shell that turns actions into control ops, a log
line and a metric. Clients are keyed by their frontend connection identity.

Ownership: the router loop thread.
"""

from __future__ import annotations

import dataclasses

# A resource: ("pause", scope) | ("sleep", "") | ("txn", update_id).
Resource = tuple[str, str]


def pause(scope: str | None) -> Resource:
    return ("pause", scope or "*")


SLEEP: Resource = ("sleep", "")


def txn(update_id: str) -> Resource:
    return ("txn", update_id)


@dataclasses.dataclass(frozen=True)
class Expired:
    """`client`'s lease ran out while it held `resource`, and no live holder
    is left: release it (resume the scope, wake up, abort the update)."""

    client: bytes
    resource: Resource
    silent_s: float  # how long the client had not been heard from


@dataclasses.dataclass
class _Lease:
    last_seen: float
    holds: set[Resource] = dataclasses.field(default_factory=set)


class Leases:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.clients: dict[bytes, _Lease] = {}
        self.expired_total = 0  # resources released because their holder vanished

    def seen(self, client: bytes, now: float) -> None:
        lease = self.clients.get(client)
        if lease is not None:
            lease.last_seen = max(lease.last_seen, now)
        # A client that holds nothing needs no lease (no state per idle client).

    def acquired(self, client: bytes, resource: Resource, now: float) -> None:
        lease = self.clients.setdefault(client, _Lease(now))
        lease.last_seen = max(lease.last_seen, now)
        lease.holds.add(resource)

    def released(self, resource: Resource) -> None:
        """Released explicitly (by any client): no holder keeps it."""
        for client, lease in list(self.clients.items()):
            lease.holds.discard(resource)
            if not lease.holds:
                del self.clients[client]

    def released_kind(self, kind: str) -> None:
        """Every resource of a kind (a resume of every scope: "pause")."""
        for client, lease in list(self.clients.items()):
            lease.holds = {r for r in lease.holds if r[0] != kind}
            if not lease.holds:
                del self.clients[client]

    def released_by(self, client: bytes, kind: str, name: str | None = None) -> None:
        """`client` lets go of its own holds of a kind (`name`: that one only);
        other holders keep theirs."""
        lease = self.clients.get(client)
        if lease is None:
            return
        lease.holds = {r for r in lease.holds if r[0] != kind or (name is not None and r[1] != name)}
        if not lease.holds:
            del self.clients[client]

    def held_by_others(self, client: bytes, kind: str, name: str | None = None) -> set[str]:
        """Names of `kind` (`name`: that one only) some client other than
        `client` holds: what a non-forced release by `client` must keep."""
        return {
            r[1]
            for c, lease in self.clients.items()
            if c != client
            for r in lease.holds
            if r[0] == kind and (name is None or r[1] == name)
        }

    def holders(self, resource: Resource) -> list[bytes]:
        return [c for c, lease in self.clients.items() if resource in lease.holds]

    def credit(self, seconds: float) -> None:
        """The head itself was stalled this long: nobody's lease ran while it was."""
        for lease in self.clients.values():
            lease.last_seen += seconds

    def tick(self, now: float) -> list[Expired]:
        expired = [(c, lease) for c, lease in self.clients.items() if now - lease.last_seen > self.lease_s]
        actions: list[Expired] = []
        for client, lease in expired:
            del self.clients[client]
            for res in sorted(lease.holds):
                if not self.holders(res):  # the last live holder is gone
                    actions.append(Expired(client, res, now - lease.last_seen))
                    self.expired_total += 1
        return actions
